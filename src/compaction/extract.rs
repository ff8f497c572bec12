//! Extractive placeholders: what is left of an old tool result.
//!
//! Blind head+tail keeps whatever happened to be first and last. An agent
//! needs the lines it may refer to again: file paths, error and exception
//! lines, failing test names, definitions, counts. The placeholder keeps
//! those lines verbatim (within a character budget, in their original
//! order), and says what was elided and how much. JSON output gets a shape
//! digest ("array of 15 objects with keys id, name, status") plus the
//! identifier-like values it held (ids, codes, numbers), which is what a
//! later step looks up again; JSON that wraps text (Codex's `{"output":
//! …, "metadata": {"exit_code": …}}`, a tool returning a file in a field)
//! is read for that text's key lines instead. Source code also gets the
//! names it defines and imports that its key lines left out
//! (`key_lines_and_names`). A line said again is kept once, and how
//! much a placeholder keeps grows with what it replaces
//! ([`placeholder_size`]) and with the model's window
//! ([`placeholder_base`]). A digest of dropped turns is sized here too
//! ([`digest_size`]), and lists the paths they named ([`named_paths`]).
//!
//! Tried on all the shared traces and dropped: a bonus for identifiers that
//! occur once in an output (TF-IDF within it), and for lines naming what
//! the agent's answer to the output named (the answer already holds those:
//! retention fell 0.01 at 32k).
//!
//! Also tried and dropped: a list of named paths in a placeholder as in a
//! digest (it displaced key lines a later step needed: reused retention
//! fell 0.008–0.010 at 32k), and a lower score for the error words in
//! diff lines (no change).
//!
//! Placeholders depend on the text and the model's window alone, never on
//! the budget or the turn, so a masked message is byte-identical on every
//! later turn.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use aho_corasick::{AhoCorasick, MatchKind};

use serde_json::Value;

use super::text::MARK;

/// The placeholder for a tool result's text, with about `budget` characters
/// of kept content.
pub fn placeholder(text: &str, budget: usize) -> String {
    let chars = text.chars().count();
    let lines = text.lines().count();
    let trimmed = text.trim_start();
    if (trimmed.starts_with('{') || trimmed.starts_with('['))
        && let Ok(v) = serde_json::from_str::<Value>(text)
    {
        // A wrapper around text (Codex's `{"output": …, "metadata":
        // {"exit_code": …}}`, a tool that returns a file in a field): the
        // key lines of that text, as for any other output.
        if let Some(inner) = wrapped_text(&v, chars) {
            let kept = key_lines_and_names(&inner, budget);
            return format!(
                "{MARK} earlier tool output elided: {chars} chars of JSON, {}; key lines kept:]\n{kept}",
                shape(&v)
            );
        }
        return format!(
            "{MARK} earlier tool output elided: {chars} chars of JSON, {}]",
            json_digest(&v, budget)
        );
    }
    let kept = key_lines_and_names(text, budget);
    if kept.is_empty() {
        format!("{MARK} earlier tool output elided: {chars} chars, {lines} lines]")
    } else {
        format!(
            "{MARK} earlier tool output elided: {chars} chars, {lines} lines; key lines kept:]\n{kept}"
        )
    }
}

/// The key lines of `text` within `budget` characters; for source code
/// (three names or more by [`code_names`]), a quarter of it holds the
/// names the key lines left out, as `names: a, b, c`.
///
/// A 19 KB source file of 60 definitions masked at 760 characters kept a
/// dozen of them as whole lines; a later step named others. As names
/// alone, a quarter of the placeholder holds about as many again. On all
/// the shared traces this took mean retention from 0.878 to 0.883 at 16k
/// (chars:3.6) and 0.854 to 0.859 (chars:3.0), 0.947 to 0.949 and 0.939
/// to 0.942 at 32k, 64k even; mean stability even but for -0.001 at 32k
/// and 64k (chars:3.6). Most of it is an OpenHands session that read
/// Django's query.py (0.889 to 0.920 at 16k, 0.973 to 0.997 at 32k, where
/// its chat form had kept 0.022 less than its Messages form); a Claude
/// Code session gained 0.015 to 0.018 at 16k, a Codex session lost 0.013
/// there, and another Codex session's stability at 64k fell 0.013. All
/// the names a placeholder has room for (a quarter or more), a third or
/// two fifths measured the same within 0.002.
fn key_lines_and_names(text: &str, budget: usize) -> String {
    let for_names = budget / 4;
    let names = code_names(text, name_cap(for_names));
    if names.len() < 3 {
        return key_lines(text, budget);
    }
    let mut kept = key_lines(text, budget - for_names);
    let list = left_out(names, &kept, for_names.saturating_sub(LABEL_CHARS));
    push_labelled(&mut kept, "names", &list);
    kept
}

/// The names `text` defines and imports (by `code_names`, three or more)
/// that `held` does not hold as words, comma-separated within `budget`
/// characters; empty when `text` is not source code. For a file an agent
/// wrote, cut to its head, key lines and tail (`mask::extractive_cut`).
pub fn names_left_out(text: &str, held: &str, budget: usize) -> String {
    let names = code_names(text, name_cap(budget));
    if names.len() < 3 {
        return String::new();
    }
    left_out(names, held, budget)
}

/// How many names to read for a list of `budget` characters: twice as
/// many as it could hold (a name and its comma take five characters or
/// more), so that memory stays within the budget whatever the file holds.
fn name_cap(budget: usize) -> usize {
    (budget / 5 * 2).max(3)
}

/// `names` less those `held` has as words, within `budget` characters.
fn left_out(names: Vec<&str>, held: &str, budget: usize) -> String {
    // The words of what is held, looked up once each: a name found in them
    // by a substring search cost a pass over them for each of a crafted
    // file's million names.
    let said: HashSet<&str> = held.split(|c: char| !identifier_char(c)).collect();
    comma_list(names, budget, |n| said.contains(n))
}

/// Whether `c` can be part of an identifier in source code.
fn identifier_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$'
}

/// `items` in their order, comma-separated within `budget` characters,
/// less those `held` says are held already; an item too long for what is
/// left does not stop a shorter one after it. The size is checked first:
/// only an item that fits is looked up.
fn comma_list<'a>(
    items: impl IntoIterator<Item = &'a str>,
    budget: usize,
    held: impl Fn(&str) -> bool,
) -> String {
    let mut out = String::new();
    for item in items {
        if out.len() + item.len() + 2 > budget || held(item) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(item);
    }
    out
}

/// What [`push_labelled`] adds beside the list for `names` (the label,
/// its colon and space, the newline before it).
pub const LABEL_CHARS: usize = 8;

/// `kept` with a `label: list` line after it, when `list` holds anything.
pub fn push_labelled(kept: &mut String, label: &str, list: &str) {
    if list.is_empty() {
        return;
    }
    if !kept.is_empty() {
        kept.push('\n');
    }
    kept.push_str(label);
    kept.push_str(": ");
    kept.push_str(list);
}

/// Words that introduce a name in source code (`def load(`, `class
/// Trainer`, `export function Dialog(`, `raise ValueError(`).
const DEFINING: &[&str] = &[
    "def",
    "class",
    "fn",
    "function",
    "func",
    "struct",
    "enum",
    "trait",
    "impl",
    "interface",
    "type",
    "export",
    "raise",
    "except",
];

/// Words that may stand before or between those and the name.
const MODIFIERS: &[&str] = &[
    "pub",
    "pub(crate)",
    "async",
    "default",
    "const",
    "let",
    "static",
];

/// The longest word a line of code that [`code_names`] reads starts with
/// (`pub(crate)`).
const LONGEST_FIRST: usize = 10;

/// The names `text` defines, imports and raises as source code does, each
/// once, in their order: the name after a defining word (and its
/// modifiers), and the names a Python or JavaScript import brings in.
/// Names of fewer than three characters are left out; at most `most`.
fn code_names(text: &str, most: usize) -> Vec<&str> {
    fn name(w: &str) -> Option<&str> {
        let end = w.find(|c: char| !identifier_char(c)).unwrap_or(w.len());
        (end >= 3 && !w.as_bytes()[0].is_ascii_digit()).then(|| &w[..end])
    }
    let mut seen: HashSet<&str> = HashSet::new();
    let mut out = Vec::new();
    for line in text.lines() {
        if line.len() > 600 {
            continue;
        }
        let code = after_line_number(line);
        // Most lines are not code: the first word rules them out, read no
        // further than the longest word that can start a line of code.
        let (first, rest) = match code.bytes().take(LONGEST_FIRST + 1).position(|b| b == b' ') {
            Some(end) => (&code[..end], &code[end + 1..]),
            None if code.len() <= LONGEST_FIRST => (code, ""),
            None => continue,
        };
        let imported = match first {
            "from" => rest.split_once(" import ").map(|(_, r)| r),
            "import" => Some(rest),
            _ if DEFINING.contains(&first) || MODIFIERS.contains(&first) => None,
            _ => continue,
        };
        let mut found: Vec<&str> = Vec::new();
        if let Some(list) = imported {
            // `A, B as C`, `(A, B)`, `{ A, B } from './x'`, `React from 'react'`.
            let list = list.split(" from ").next().unwrap_or(list);
            for part in list.split(',') {
                let part = part.trim().trim_matches(['(', ')', '{', '}', ' ']);
                let part = part.split(" as ").next().unwrap_or(part).trim();
                found.extend(name(part).filter(|n| n.len() == part.len()));
            }
        } else {
            let mut defining = false;
            for word in code.split_whitespace() {
                if DEFINING.contains(&word) {
                    defining = true;
                } else if !MODIFIERS.contains(&word) {
                    found.extend(name(word).filter(|_| defining));
                    break;
                }
            }
        }
        for n in found {
            if seen.insert(n) {
                out.push(n);
                if out.len() == most {
                    return out;
                }
            }
        }
    }
    out
}

/// The text a JSON value carries when it is mostly text (its multi-line
/// strings hold at least half of its `chars`): its string values, and its
/// numbers and booleans as `key: value` (an exit code), one per line, in
/// document order. None for data (records, lists of ids).
fn wrapped_text(v: &Value, chars: usize) -> Option<String> {
    fn multiline(v: &Value, depth: usize) -> usize {
        match v {
            Value::String(s) if s.contains('\n') => s.chars().count(),
            Value::Array(a) if depth < 8 => a.iter().map(|v| multiline(v, depth + 1)).sum(),
            Value::Object(o) if depth < 8 => o.values().map(|v| multiline(v, depth + 1)).sum(),
            _ => 0,
        }
    }
    if multiline(v, 0) * 2 < chars {
        return None;
    }
    let mut out = String::with_capacity(chars);
    readable_into(v, None, &mut out, 0);
    Some(out)
}

/// `text` as key lines are read from it: itself, or when it is JSON (a
/// tool call's arguments, a wrapped output) its strings, numbers and
/// booleans one per line, so that a script or a file in a string field has
/// its own lines instead of one escaped line.
pub fn readable(text: &str) -> std::borrow::Cow<'_, str> {
    let trimmed = text.trim_start();
    if (trimmed.starts_with('{') || trimmed.starts_with('['))
        && let Ok(v) = serde_json::from_str::<Value>(text)
    {
        let mut out = String::with_capacity(text.len());
        readable_into(&v, None, &mut out, 0);
        return std::borrow::Cow::Owned(out);
    }
    std::borrow::Cow::Borrowed(text)
}

fn readable_into(v: &Value, key: Option<&str>, out: &mut String, depth: usize) {
    let scalar = |out: &mut String, s: &str| {
        if let Some(k) = key {
            out.push_str(k);
            out.push_str(": ");
        }
        out.push_str(s);
        out.push('\n');
    };
    match v {
        Value::String(s) if s.contains('\n') => {
            out.push_str(s);
            out.push('\n');
        }
        Value::String(s) => scalar(out, s),
        Value::Number(n) => scalar(out, &n.to_string()),
        Value::Bool(b) => scalar(out, if *b { "true" } else { "false" }),
        Value::Null => {}
        // serde_json reads no deeper than 128 levels; this walk stops
        // sooner, as the digest does.
        Value::Array(a) if depth < 16 => {
            for v in a {
                readable_into(v, key, out, depth + 1);
            }
        }
        Value::Object(o) if depth < 16 => {
            for (k, v) in o {
                readable_into(v, Some(k), out, depth + 1);
            }
        }
        _ => {}
    }
}

/// About what a masked result of `tokens` costs with placeholders of
/// `base` characters (its label, the lines, and the message's own frame),
/// for planning before the placeholder exists.
pub fn placeholder_tokens(base: usize, tokens: u64) -> u64 {
    // About 4 characters a token in what tools return.
    let len = usize::try_from(tokens.saturating_mul(4)).unwrap_or(usize::MAX);
    (placeholder_size(base, len) / 3 + 40) as u64
}

/// The characters of key lines a placeholder keeps for a text of `len`
/// bytes: `base` for a 3 KB output, more for a larger one (up to 3 times
/// `base`, from 27 KB), as the square root of its size, and down to 0.6
/// of it for a smaller one. A whole file or a long log holds more that a
/// later step needs than one short answer does; at a flat 300 characters a
/// 25 KB source file kept 18 of its 60 definitions. On all the shared
/// traces (natives included, chars:3.6 and 3.0) this took mean retention
/// from 0.902 to 0.912 at 32k and 0.787 to 0.795 at 16k, stability flat.
/// A larger scale (2 KB, up to 4 times) gained 0.004 more on the mean but
/// cost one Claude Code session 0.05 at 32k: larger placeholders brought
/// its first drop seven turns sooner.
pub fn placeholder_size(base: usize, len: usize) -> usize {
    let scale = (len as f64 / 3000.0).sqrt().clamp(0.6, 3.0);
    (base as f64 * scale) as usize
}

/// The placeholder size for a model whose window is `window` tokens:
/// `chars` (`compaction.placeholder_chars`) up to a 16k window, then as the
/// square root of the window, up to twice that (from 64k). A larger window
/// has room for more of each result, and it depends on the model alone, so
/// a masked result keeps its bytes from turn to turn.
pub fn placeholder_base(chars: usize, window: u64) -> usize {
    let scale = (window as f64 / 16384.0).sqrt().clamp(1.0, 2.0);
    (chars as f64 * scale) as usize
}

/// Characters of key lines a digest keeps for the least it replaces.
pub const DIGEST_CHARS: usize = 1200;

/// The characters of key lines a digest of dropped messages keeps, for
/// `dropped` raw tokens of them (at their masked size) and `room` raw
/// tokens left for the conversation (the budget less the fixed tokens and
/// the pinned head): [`DIGEST_CHARS`] up to 1,000 dropped tokens, then as
/// the square root of them up to 3 times that (from 9,000), but at most a
/// fifth of the room (and never under [`DIGEST_CHARS`]). 160 dropped
/// messages of a Codex session hold far more errors and paths worth a line
/// than 1,200 characters take; at a flat size one such session kept 0.61
/// of its probes at 32k, 0.82 with this. Both inputs stay put while the
/// dropped set does (`room` is that of the turn that last dropped more,
/// not today's, which moves with the plan ratio), so the digest stays
/// byte-identical from turn to turn. Sized by today's room, it was
/// rewritten with nothing more dropped; held, mean stability at 16k
/// (chars:3.0) went from 0.825 to 0.827 over all the shared traces: two
/// Claude Code sessions +0.014 and +0.018 (one kept one probe fewer, 0.006
/// of its retention), a Codex session +0.006 at chars:3.6; nothing else
/// moved by 0.002.
pub fn digest_size(dropped: u64, room: f64) -> usize {
    let scale = (dropped as f64 / 1000.0).sqrt().clamp(1.0, 3.0);
    let most = (room * 0.2 * 3.0).max(DIGEST_CHARS as f64);
    (DIGEST_CHARS as f64 * scale).min(most) as usize
}

/// What the plan counts for a digest of [`digest_size`] (an upper bound:
/// key lines have about 3 characters a token or more, the frame is within
/// the rounding).
pub fn digest_tokens(dropped: u64, room: f64) -> u64 {
    (digest_size(dropped, room) / 3) as u64
}

/// The paths (and URLs) `text` names that `kept` does not hold, the most
/// named first (then the one named last first), comma-separated within
/// `budget` characters. Where a digest's key lines are mostly errors, this
/// says which files the dropped turns read, wrote and listed: most of what
/// an agent looks up again is a path.
pub fn named_paths(text: &str, kept: &str, budget: usize) -> String {
    // Per path: how often it is named, and the last line naming it (a line
    // gives one path, so that order has no ties).
    let mut named: HashMap<&str, (usize, usize)> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let Some(p) = path_in(line) else {
            continue;
        };
        let p = p.trim_end_matches(['.', ';']);
        if (4..=160).contains(&p.len()) {
            let e = named.entry(p).or_insert((0, 0));
            e.0 += 1;
            e.1 = i;
        }
    }
    let mut order: Vec<(&str, (usize, usize))> = named.into_iter().collect();
    order.sort_unstable_by(|a, b| b.1.0.cmp(&a.1.0).then(b.1.1.cmp(&a.1.1)));
    comma_list(order.into_iter().map(|(p, _)| p), budget, |p| {
        kept.contains(p)
    })
}

/// Whether a tool result reports a failure: a line such as "ValueError: ...",
/// "ERROR: File already exists" or "FAILED tests/...". The agent may retry
/// the call, so its arguments are worth keeping until it has.
pub fn reports_error(text: &str) -> bool {
    text.lines().any(|l| score(l).0 >= 7)
}

/// The words [`score`] looks for, found in one pass over a line (ASCII
/// case ignored): a failure (the first eleven), an outcome, a test, an
/// exit status.
const WORDS: &[&str] = &[
    "error",
    "exception",
    "traceback",
    "failed",
    "panic",
    "fatal",
    "denied",
    "not found",
    "no such",
    "cannot",
    "invalid",
    " passed",
    " failed",
    "warning",
    "test_",
    "assert",
    "exit",
];
const FAILURE_WORDS: u32 = (1 << 11) - 1;
const OUTCOME_WORDS: u32 = 0b111 << 11;
const TEST_WORDS: u32 = 0b11 << 14;
const EXIT_WORD: u32 = 1 << 16;

/// [`WORDS`] as one automaton, every occurrence reported. None if it
/// cannot be built (it can; [`words_in`] then searches word by word).
static WORD_FINDER: LazyLock<Option<AhoCorasick>> = LazyLock::new(|| {
    AhoCorasick::builder()
        .ascii_case_insensitive(true)
        .match_kind(MatchKind::Standard)
        .build(WORDS)
        .ok()
});

/// Which of [`WORDS`] occur in `l`, as bits in their order.
///
/// One pass: a search per word, on a lowercased copy of each line, was a
/// third of what masking a 128k-token conversation cost.
fn words_in(l: &str) -> u32 {
    if let Some(finder) = &*WORD_FINDER
        && let Ok(hits) = finder.try_find_overlapping_iter(l)
    {
        return hits
            .filter(|hit| counts(l, hit.pattern().as_usize(), hit.start()))
            .fold(0, |bits, hit| bits | 1 << hit.pattern().as_u32());
    }
    words_each(l)
}

/// [`words_in`] word by word.
fn words_each(l: &str) -> u32 {
    let lower = l.to_ascii_lowercase();
    WORDS
        .iter()
        .enumerate()
        .filter(|(i, w)| lower.match_indices(*w).any(|(at, _)| counts(l, *i, at)))
        .fold(0, |bits, (i, _)| bits | 1 << i)
}

/// Whether the word `WORDS[word]` found at byte `at` of `l` counts: a
/// failure word only where a word begins, not inside a name or a path
/// (`thiserror`, `src/error.rs`, `yarn-error.log`, `test_error_paths`),
/// save an exception's name (`TypeError`, `IOException`). A Codex
/// session's `find | grep error` listing of a Rust target directory
/// scored as eleven failures; its lines took the digest's room, and the
/// `fatal: Could not read from remote repository.` before them left it.
/// Over all the shared traces, mean probe retention at 16k went from 0.890
/// to 0.900 (chars:3.6) and 0.866 to 0.875 (chars:3.0), of facts the agent
/// used again from 0.923 to 0.940 and 0.897 to 0.914; at 32k up 0.001, at
/// 64k even; mean stability even.
fn counts(l: &str, word: usize, at: usize) -> bool {
    if 1 << word & FAILURE_WORDS == 0 {
        return true;
    }
    let b = l.as_bytes();
    let Some(&before) = at.checked_sub(1).and_then(|i| b.get(i)) else {
        return true;
    };
    let camel = before.is_ascii_lowercase() && b.get(at).is_some_and(u8::is_ascii_uppercase);
    camel || !(before.is_ascii_alphanumeric() || matches!(before, b'_' | b'/' | b'-' | b'.'))
}

/// Whether `s` starts with `prefix`, ASCII case ignored.
fn starts_with_ignoring_case(s: &str, prefix: &str) -> bool {
    s.as_bytes()
        .get(..prefix.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(prefix.as_bytes()))
}

/// How likely a line is to matter again, and the path it names (so that a
/// traceback's twenty frames in one file count once).
fn score(line: &str) -> (u32, Option<&str>) {
    let l = line.trim();
    if l.is_empty() || l.len() > 600 {
        return (0, None);
    }
    let words = words_in(l);
    let mut s = 0;
    // "Exit code: 2", "exit_code: 1", "Process exited with code 1": a
    // command failed (whose output says why, in lines that score more).
    if words & EXIT_WORD != 0 && failed_exit(l) {
        s += 4;
    }
    // "ValueError: ...", "requests.exceptions.ProxyError: ...": the line a
    // traceback ends with (after pytest's "E   ", as it reports one: scored
    // as any "E" line, the lines around it naming the test file took its
    // place, and a Codex session lost the "No module named" it acted on;
    // its retention at 32k went from 0.825 to 0.858, nothing else moved).
    let head = l
        .strip_prefix("E   ")
        .unwrap_or(l)
        .trim_start()
        .split(':')
        .next()
        .unwrap_or("");
    if l.contains(':')
        && !head.contains(' ')
        && [
            "Error",
            "Exception",
            "Warning",
            "Failure",
            "Interrupt",
            "Exit",
        ]
        .iter()
        .any(|k| head.ends_with(k))
    {
        s += 8;
    } else if l.starts_with("FAILED ")
        || l.starts_with("ERROR ")
        || l.starts_with("E   ")
        || starts_with_ignoring_case(l, "error:")
        || starts_with_ignoring_case(l, "error[")
    {
        s += 7;
    } else if words & FAILURE_WORDS != 0 {
        s += if command_error(l, words) { 7 } else { 4 };
    }
    let t = after_line_number(l);
    if [
        "def ",
        "class ",
        "fn ",
        "pub fn ",
        "async def ",
        "function ",
        "func ",
        "struct ",
        "impl ",
        "interface ",
        "export ",
        "type ",
    ]
    .iter()
    .any(|k| starts_with_ignoring_case(t, k))
    {
        s += 4;
    }
    let path = path_in(l);
    let python_frame = starts_with_ignoring_case(l, "file \"") || pytest_frame(l);
    let frame = python_frame || l.starts_with("at ");
    if path.is_some_and(|p| !(frame && library(p))) {
        s += 3;
    }
    if python_frame || words & OUTCOME_WORDS != 0 {
        s += 2;
    }
    if words & TEST_WORDS != 0 {
        s += 1;
    }
    (s, path)
}

/// Whether `l` is a command's own error line in the Unix form `prog:
/// message` with a failure in the message (or a program that is one,
/// git's `fatal:`, Go's `panic:`): `bash: line 3: rsync: command not
/// found`, `cat: spec.md: No such file or directory`. It says what failed
/// as plainly as `error: …` does, and now counts as much. Scored as any
/// line with a failure word, it tied with a file's definitions, and a
/// Claude Code session's digest kept 14 `def` lines of one file where the
/// `rsync` its agent lacked went. Over all the shared traces this took
/// mean probe retention at 16k from 0.902 to 0.913 (chars:3.6) and 0.878
/// to 0.889 (chars:3.0), at 32k from 0.955 to 0.960 and 0.947 to 0.954,
/// 64k even; mean stability and facts the agent used again moved 0.002 at
/// most. All five Claude Code and Codex sessions gained (0.02 to 0.09 in
/// a cell); two Codex sessions each lost a path the agent used again in
/// one cell (-0.03) and gained as much in another; the chat agents'
/// traces did not move. The program is one lowercase word, and the
/// message does not end as code does: a line number (`293:    raise
/// AttributeError(`), a key (`formState: { errors }`, `source:
/// std::io::Error,`) or a path is no program.
///
/// `words` are [`words_in`] of `l`: when the program names no failure,
/// the failure they hold is in the message (a program that names one,
/// `errors: 0`, is no failure but for `fatal` and `panic`).
fn command_error(l: &str, words: u32) -> bool {
    let Some((program, message)) = l.split_once(": ") else {
        return false;
    };
    (1..=20).contains(&program.len())
        && program.starts_with(|c: char| c.is_ascii_lowercase())
        && program
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && !message.trim_end().ends_with([',', '{', '(', '[', ';'])
        && words & FAILURE_WORDS != 0
        && (matches!(program, "fatal" | "panic")
            || !WORDS[..FAILURE_WORDS.count_ones() as usize]
                .iter()
                .any(|w| program.contains(w)))
}

/// Whether `path` is a file of an installed library or toolchain: a
/// traceback's frames inside a package (`File "…"`, pytest's `…: in`, a
/// JavaScript or Java `at …`) say less than the agent's own files, and
/// earn no path bonus. A Claude Code session's digest held four frames
/// inside `site-packages/litdata/` where the names of the agent's own
/// modules went; over all the shared traces this took mean retention of
/// facts the agent used again at 16k from 0.940 to 0.942 (chars:3.6) and
/// 0.914 to 0.919 (chars:3.0), that session's from 0.577 to 0.702
/// (chars:3.0); 32k and 64k even. Looked up on frames only: on every line
/// with a path, a 16 MB result of path lines took about 7% longer to mask.
fn library(path: &str) -> bool {
    [
        "site-packages/",
        "dist-packages/",
        "node_modules/",
        "/usr/lib/",
        ".cargo/registry/",
        "/rustc/",
    ]
    .iter()
    .any(|lib| path.contains(lib))
}

/// `line` after the line number `cat -n`, `nl` and grep put before it,
/// and Claude Code's Read (`    41→def load(`).
fn after_line_number(line: &str) -> &str {
    line.trim_start_matches(|c: char| {
        c.is_ascii_digit() || c == ' ' || c == '\t' || c == '|' || c == ':' || c == '→'
    })
}

/// Whether `l` reports a command that exited with a code other than 0.
/// Such a line is short: a longer one is not lowercased at all.
fn failed_exit(l: &str) -> bool {
    l.len() < 120 && exit_code(&l.to_ascii_lowercase()).is_some_and(|code| code != "0")
}

/// The code of a line reporting a command's exit status (`lower` is the
/// line lowercased).
fn exit_code(lower: &str) -> Option<&str> {
    // Nearly every line has none: one search rules it out.
    if !lower.contains("exit") {
        return None;
    }
    let rest = ["exit code", "exit_code", "exit status", "exited with code"]
        .iter()
        .find_map(|k| {
            lower
                .strip_prefix(k)
                .or_else(|| lower.split_once(k).map(|(_, r)| r))
        })?;
    let rest = rest.trim_start_matches([':', '=', ' ']);
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '-'))
        .unwrap_or(rest.len());
    (end > 0).then(|| &rest[..end])
}

/// A frame of pytest's short traceback: `pkg/render.py:142: in render`.
fn pytest_frame(l: &str) -> bool {
    l.split_once(": in ").is_some_and(|(at, _)| {
        at.rsplit_once(':').is_some_and(|(file, line)| {
            file.ends_with(".py") && !line.is_empty() && line.bytes().all(|b| b.is_ascii_digit())
        })
    })
}

/// What a line names: its first URL, else its first path-like word (two
/// slashes, or one slash and a file name with an extension).
///
/// A URL is whole, scheme, credentials, port and all: split at its colons,
/// `http://localhost:5000/health` named `//localhost` (and every other
/// localhost URL the same), so a digest listed no port and a placeholder
/// counted a second service's URL as a path it already had. On all the
/// shared traces this took mean retention at 16k from 0.875 to 0.877
/// (chars:3.6) and 0.849 to 0.853 (chars:3.0), a Codex session whose
/// services listen on three local ports from 0.491 to 0.541; 32k even
/// (one session -0.010, another +0.008). The URL goes before the path of a
/// search hit's location (`docs/run.md:112: curl http://…`): keeping the
/// location first gained half as much.
fn path_in(l: &str) -> Option<&str> {
    // Both need a slash, which most lines lack: one byte search rules
    // them out.
    if !l.contains('/') {
        return None;
    }
    url_in(l).or_else(|| {
        l.split(|c: char| {
            c.is_whitespace() || matches!(c, '"' | '\'' | '(' | ')' | ',' | ':' | '[' | ']' | '`')
        })
        .find(|w| {
            let slash = w.matches('/').count();
            slash >= 2
                || (slash >= 1
                    && w.rsplit('/')
                        .next()
                        .is_some_and(|f| f.contains('.') && f.len() > 2))
        })
    })
}

/// The first URL in a line: a scheme (`https`, `db+postgresql`), `://`,
/// and what follows up to a space, a quote or a bracket, less a trailing
/// `.`, `;` or `:`.
fn url_in(l: &str) -> Option<&str> {
    // Each colon found by a byte search, then `//` after it: a search for
    // `://` itself cost every line of a 16 MB output more.
    l.match_indices(':').find_map(|(at, _)| {
        if !l[at + 1..].starts_with("//") {
            return None;
        }
        let scheme = l[..at]
            .bytes()
            .rev()
            .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'.' | b'-'))
            .count();
        if scheme == 0 {
            return None;
        }
        let rest = &l[at + 3..];
        let end = rest
            .find(|c: char| {
                c.is_whitespace()
                    || matches!(
                        c,
                        '"' | '\'' | '<' | '>' | '(' | ')' | '[' | ']' | '`' | ',' | '\\'
                    )
            })
            .unwrap_or(rest.len());
        let url = l[at - scheme..at + 3 + end].trim_end_matches(['.', ';', ':']);
        (end > 0 && url.len() > scheme + 3).then_some(url)
    })
}

/// The highest-scoring lines, in their original order, within `budget`
/// characters. A line naming a path already kept counts only for its other
/// merits; long lines are cut (error lines less than others).
///
/// Linear in the text (plus a sort of the scored lines): a tool result is
/// whatever file or page the agent read, and a crafted one of 400k
/// distinct path lines cost minutes of CPU when each path was looked up in
/// a list of the ones seen.
pub fn key_lines(text: &str, budget: usize) -> String {
    let mut seen_paths: HashSet<&str> = HashSet::new();
    // (score, line index, line, where a path new to the placeholder ends)
    let mut scored: Vec<(u32, usize, &str, Option<usize>)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let (mut s, path) = score(line);
        let mut path_end = None;
        if let Some(p) = path {
            if !seen_paths.insert(p) {
                s = s.saturating_sub(3);
            } else {
                path_end = line.find(p).map(|at| line[..at + p.len()].chars().count());
            }
        }
        if s > 0 {
            scored.push((s, i, line.trim_end(), path_end));
        }
    }
    // Best first; among equals the later line (the final error, the last
    // test summary) first.
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
    let mut chosen: Vec<(usize, String)> = Vec::new();
    // A line said again (a warning per epoch, the same error per file, a
    // line of code as a diff removes, adds and shows it) is kept once. A
    // Codex session's digest held `self.log(f"[WS] Init failed: {e}")` as
    // added and as context; told apart by their markers no more, its
    // retention at 16k went from 0.758 to 0.765 and 0.727 to 0.735
    // (chars:3.6, 3.0), at 32k chars:3.0 from 0.807 to 0.820, stability
    // even; no other trace moved. Looked up only for lines that would go
    // in, which are few (every line of a 16 MB result in a set cost a
    // third more time).
    let mut kept: HashSet<&str> = HashSet::new();
    let mut used = 0;
    for (s, i, line, path_end) in scored {
        // Nothing more can go in: the rest need not be looked at.
        if used + 2 > budget {
            break;
        }
        // Without a diff's markers (and a bullet under one: `+- item` is
        // `- item` added).
        let same = line.trim().trim_start_matches(['+', '-']).trim_start();
        if kept.contains(same) {
            continue;
        }
        // An error line keeps up to 240 characters, any other line up to
        // 120 (or half the budget, when less): a long line's head says what
        // it is, and four of them can say more than one whole. On all the
        // shared traces this took mean retention of facts the agent used
        // again from 0.786 to 0.805 at 16k (chars:3.0) and from 0.935 to
        // 0.940 at 32k (chars:3.6), stability flat; 80 kept less at 32k.
        let mut max_line = if s >= 7 {
            240
        } else {
            (budget / 2).clamp(60, 120)
        };
        let chars = line.chars().count();
        // A line too long for what is left still goes in, cut, when the
        // path it names fits (a traceback's middle frames).
        let room = budget.saturating_sub(used + 2);
        if chars + used + 1 > budget && path_end.is_some_and(|end| end <= room) {
            max_line = max_line.min(room);
        }
        // What the line costs, worked out before anything is copied.
        let cost = chars.min(max_line) + usize::from(chars > max_line) + 1;
        if used + cost > budget {
            continue;
        }
        kept.insert(same);
        let line = if chars > max_line {
            let cut: String = line.chars().take(max_line).collect();
            format!("{cut}…")
        } else {
            line.to_string()
        };
        used += cost;
        chosen.push((i, line));
    }
    chosen.sort_by_key(|(i, _)| *i);
    chosen
        .into_iter()
        .map(|(_, l)| l)
        .collect::<Vec<_>>()
        .join("\n")
}

/// "array of 15 objects with keys id, name, status; values: JG7FMM, ..."
pub fn json_digest(v: &Value, budget: usize) -> String {
    let shape = shape(v);
    let mut ids = Vec::new();
    collect_identifiers(v, &mut ids, 0);
    let mut out = shape;
    let mut used = out.len();
    let mut first = true;
    for id in ids {
        if used + id.len() + 2 > budget + 60 {
            break;
        }
        out.push_str(if first { "; values: " } else { ", " });
        first = false;
        used += id.len() + 2;
        out.push_str(&id);
    }
    out
}

fn shape(v: &Value) -> String {
    let keys = |o: &serde_json::Map<String, Value>| {
        let mut k: Vec<&str> = o.keys().map(String::as_str).take(12).collect();
        if o.len() > 12 {
            k.push("…");
        }
        k.join(", ")
    };
    match v {
        Value::Array(a) => match a.first() {
            Some(Value::Object(o)) if a.iter().all(Value::is_object) => {
                format!("array of {} objects with keys {}", a.len(), keys(o))
            }
            Some(first) => format!("array of {} {}", a.len(), kind(first)),
            None => "empty array".to_string(),
        },
        Value::Object(o) => format!("object with keys {}", keys(o)),
        other => kind(other).to_string(),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nulls",
        Value::Bool(_) => "booleans",
        Value::Number(_) => "numbers",
        Value::String(_) => "strings",
        Value::Array(_) => "arrays",
        Value::Object(_) => "objects",
    }
}

/// Short strings (keys or values) that look like identifiers: no spaces,
/// 3 to 40 characters, with a digit or in capitals; and numbers with a unit
/// of meaning (amounts). Deduplicated, in document order.
fn collect_identifiers(v: &Value, out: &mut Vec<String>, depth: usize) {
    if depth > 8 || out.len() > 200 {
        return;
    }
    fn push(out: &mut Vec<String>, s: &str) {
        let ok = (3..=40).contains(&s.len())
            && !s.contains(char::is_whitespace)
            && (s.chars().any(|c| c.is_ascii_digit())
                || s.chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit()))
            && !out.iter().any(|o| o == s);
        if ok {
            out.push(s.to_string());
        }
    }
    match v {
        Value::String(s) => push(out, s),
        Value::Object(o) => {
            for (k, v) in o {
                push(out, k);
                collect_identifiers(v, out, depth + 1);
            }
        }
        Value::Array(a) => {
            for v in a {
                collect_identifiers(v, out, depth + 1);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_line_keeps_its_head_and_an_error_line_more_of_it() {
        let long_path = format!("src/app/module.py: {}", "x".repeat(300));
        let long_error = format!("ValueError: {}", "y".repeat(300));
        let text = format!("{long_path}\n{long_error}\n");
        let kept = key_lines(&text, 2000);
        let lines: Vec<&str> = kept.lines().collect();
        assert_eq!(lines.len(), 2, "{kept}");
        assert_eq!(lines[0].chars().count(), 121, "{kept}");
        assert!(lines[0].starts_with("src/app/module.py: xxx") && lines[0].ends_with('…'));
        assert_eq!(lines[1].chars().count(), 241, "{kept}");
        // A small budget keeps half of it a line, as before.
        let small = key_lines(&long_path, 150);
        assert_eq!(small.chars().count(), 76, "{small}");
    }

    #[test]
    fn named_paths_come_most_named_first_then_latest_within_the_budget() {
        let text = "cat src/a.rs\n\
            src/b.rs:3: warning\n\
            open(\"src/c.rs\")\n\
            see src/a.rs.\n\
            src/d.rs\n\
            src/c.rs\n\
            https://example.com/docs/page\n\
            lib/kept.py\n";
        let all = named_paths(text, "  File lib/kept.py, line 3", 1000);
        assert_eq!(
            all,
            "src/c.rs, src/a.rs, https://example.com/docs/page, src/d.rs, src/b.rs"
        );
        // Within the budget, and a path too long for what is left does not
        // stop a shorter one after it.
        let few = named_paths(text, "", 30);
        assert!(few.len() <= 30, "{few}");
        assert_eq!(few, "src/c.rs, src/a.rs, src/d.rs");
        assert_eq!(named_paths("no paths here\n", "", 100), "");
    }

    #[test]
    fn a_url_is_named_whole_with_its_port_before_the_path_of_its_line() {
        let text = "docs/run.md:12: curl http://localhost:5000/internal/status.\n\
            docs/run.md:14: broker = \"amqp://guest:guest@localhost:5672//\"\n\
            CELERY_RESULT_BACKEND=db+postgresql://mm:***@localhost:5432/mm\n\
            see (https://example.com:8929/root/repo.git) and src/a.py\n";
        assert_eq!(
            named_paths(text, "", 1000),
            "https://example.com:8929/root/repo.git, \
             db+postgresql://mm:***@localhost:5432/mm, \
             amqp://guest:guest@localhost:5672//, \
             http://localhost:5000/internal/status"
        );
        // Each service's URL is a path of its own: the placeholder of a
        // listing keeps the line of each, not only the first.
        let kept = key_lines(text, 1000);
        for port in ["5000", "5672", "5432", "8929"] {
            assert!(kept.contains(port), "{port}: {kept}");
        }
        assert_eq!(url_in("a ://b c"), None);
        assert_eq!(url_in("x://"), None);
        assert_eq!(url_in("é中http://h:1/p"), Some("http://h:1/p"));
    }

    #[test]
    fn a_larger_window_affords_larger_placeholders_up_to_twice() {
        assert_eq!(placeholder_base(300, 8000), 300);
        assert_eq!(placeholder_base(300, 16384), 300);
        assert_eq!(placeholder_base(300, 4 * 16384), 600);
        assert_eq!(placeholder_base(300, 200_000), 600);
        let mid = placeholder_base(300, 32768);
        assert!((420..=425).contains(&mid), "{mid}");
    }

    #[test]
    fn a_digest_grows_with_what_it_replaces_within_a_fifth_of_the_room() {
        let room = 100_000.0;
        assert_eq!(digest_size(0, room), DIGEST_CHARS);
        assert_eq!(digest_size(1000, room), DIGEST_CHARS);
        assert_eq!(digest_size(4000, room), 2 * DIGEST_CHARS);
        assert_eq!(digest_size(9000, room), 3 * DIGEST_CHARS);
        assert_eq!(digest_size(1_000_000, room), 3 * DIGEST_CHARS);
        let sizes: Vec<usize> = (0..100).map(|k| digest_size(k * 200, room)).collect();
        assert!(sizes.windows(2).all(|w| w[0] <= w[1]), "{sizes:?}");
        // A fifth of 4,000 tokens of room, at 3 characters a token ...
        assert_eq!(digest_size(1_000_000, 4000.0), 2400);
        // ... and never under the least, however little room there is.
        assert_eq!(digest_size(1_000_000, 500.0), DIGEST_CHARS);
        assert_eq!(digest_size(1_000_000, -500.0), DIGEST_CHARS);
        assert_eq!(digest_tokens(9000, room), (DIGEST_CHARS as u64 * 3) / 3);
    }

    #[test]
    fn keeps_paths_errors_and_definitions() {
        let mut text = String::new();
        for i in 0..200 {
            text.push_str(&format!("noise line {i} with nothing in it\n"));
        }
        text.push_str("  File \"/app/src/models/base.py\", line 42, in save\n");
        text.push_str("RuntimeError: Model class app.Foo doesn't declare an explicit app_label\n");
        text.push_str("def relabeled_clone(self, relabels):\n");
        let p = placeholder(&text, 300);
        assert!(p.contains("/app/src/models/base.py"), "{p}");
        assert!(
            p.contains("RuntimeError: Model class app.Foo doesn't declare an explicit app_label"),
            "{p}"
        );
        assert!(p.contains("def relabeled_clone"), "{p}");
        assert!(!p.contains("noise line"));
        assert!(p.starts_with("[condense:"));
        assert!(p.len() < 500, "{}", p.len());
    }

    #[test]
    fn a_traceback_keeps_the_file_of_a_middle_frame_too_long_to_fit() {
        // The error line and the innermost frame take most of the budget;
        // the middle frames' file must still be named, its line cut short.
        let text = "Traceback (most recent call last):\n\
  File \"/srv/app/pkg/dataset.py\", line 836, in __getattr_for_missing_element__\n\
    return object.__getattribute__(self, name)\n\
  File \"/srv/app/pkg/dataset.py\", line 1563, in _do_pixel_data_conversion\n\
    arr = handler.get_pixeldata(self)\n\
  File \"/srv/app/pkg/pixel_data_handlers/numpy_handler_for_uncompressed.py\", line 293, in get_pixeldata\n\
    raise AttributeError(\n\
AttributeError: Unable to convert the pixel data as the following required elements are missing from the dataset: PixelRepresentation\n";
        let p = placeholder(text, 300);
        for kept in [
            "/srv/app/pkg/dataset.py",
            "/srv/app/pkg/pixel_data_handlers/numpy_handler_for_uncompressed.py\", line 293",
            "missing from the dataset: PixelRepresentation",
        ] {
            assert!(p.contains(kept), "{kept} missing from {p}");
        }
        let kept_chars = p.split_once('\n').map_or(0, |(_, k)| k.chars().count());
        assert!(kept_chars <= 300, "{kept_chars}: {p}");
    }

    #[test]
    fn a_pytest_failure_keeps_its_frame() {
        let mut text = String::from("collected 120 items\n\n");
        for f in [
            "cli", "parser", "inline", "blocks", "toc", "config", "cache",
        ] {
            text.push_str(&format!("tests/test_{f}.py ............\n"));
        }
        text.push_str(
            "tests/test_render.py:88: \n\
inkwell/render.py:142: in render_heading\n\
    return '<h%d>' % level + text + '</h%d>' % level\n\
E   TypeError: can only concatenate str (not \"NoneType\") to str\n\
FAILED tests/test_render.py::test_heading - TypeError\n",
        );
        let p = placeholder(&text, 200);
        assert!(
            p.contains("inkwell/render.py:142: in render_heading"),
            "{p}"
        );
        assert!(p.contains("E   TypeError"), "{p}");
        assert!(!pytest_frame("tests/test_cache.py ........"));
        assert!(!pytest_frame("see render.py:x: in a comment"));
    }

    #[test]
    fn json_gets_a_shape_and_its_identifiers() {
        let v = r#"[{"id":"JG7FMM","name":"a","status":"ok"},{"id":"LQ940Q","name":"b","status":"ok"}]"#;
        let p = placeholder(v, 300);
        assert!(
            p.contains("array of 2 objects with keys id, name, status"),
            "{p}"
        );
        assert!(p.contains("JG7FMM") && p.contains("LQ940Q"), "{p}");
        let o = r#"{"payment_methods":{"credit_card_2929732":{"brand":"visa"}},"reservations":["2FBBAH"]}"#;
        let p = placeholder(o, 300);
        assert!(
            p.contains("credit_card_2929732") && p.contains("2FBBAH"),
            "{p}"
        );
    }

    #[test]
    fn json_wrapping_text_keeps_the_text_s_key_lines() {
        // Codex's older shell output: the command's output inside a JSON
        // string, its exit code in the metadata.
        let mut out = String::from("============ ERRORS ============\n");
        for i in 0..80 {
            out.push_str(&format!("collected line {i} of nothing much\n"));
        }
        out.push_str("E   ModuleNotFoundError: No module named 'opk'\n");
        out.push_str("ERROR tests/test_schema_profiles.py\n");
        let v = serde_json::json!({"output": out, "metadata": {"exit_code": 2, "duration_seconds": 0.4}});
        let p = placeholder(&v.to_string(), 300);
        for kept in [
            "ModuleNotFoundError: No module named 'opk'",
            "ERROR tests/test_schema_profiles.py",
            "exit_code: 2",
            "object with keys metadata, output",
        ] {
            assert!(p.contains(kept), "{kept} missing from {p}");
        }
        assert!(!p.contains("collected line"), "{p}");
        // Data stays a digest of its shape and identifiers.
        let data = r#"{"reservations":["2FBBAH","X1Y2Z3"],"name":"a\nb"}"#;
        assert!(placeholder(data, 300).contains("values: 2FBBAH"));
    }

    #[test]
    fn a_failed_command_s_exit_code_is_a_key_line() {
        let mut text = String::from("Exit code: 255\nWall time: 0.2 seconds\nOutput:\n");
        for i in 0..60 {
            text.push_str(&format!("plain output line {i}\n"));
        }
        assert!(placeholder(&text, 200).contains("Exit code: 255"));
        let ok = text.replace("Exit code: 255", "Exit code: 0");
        assert!(!placeholder(&ok, 200).contains("Exit code"));
        assert_eq!(exit_code("process exited with code 1"), Some("1"));
        assert_eq!(exit_code("[command finished with exit code 0]"), Some("0"));
        assert_eq!(exit_code("the exit code matters"), None);
    }

    /// pytest reports the exception a test module raised on a line of its
    /// own after "E   ": that line is the one an agent acts on, before
    /// the lines around it that name the same files.
    #[test]
    fn pytest_s_exception_line_is_kept_before_the_lines_around_it() {
        let mut text = String::from(
            "==================================== ERRORS ====================================\n",
        );
        for m in ["bundle_roundtrip", "schema_profiles"] {
            text.push_str(&format!(
                "_______________ ERROR collecting tests/test_{m}.py ________________\n\
                 ImportError while importing test module '/home/u/proj/tests/test_{m}.py'.\n\
                 Hint: make sure your test modules/packages have valid Python names.\n\
                 Traceback:\n\
                 /usr/lib/python3.10/importlib/__init__.py:126: in import_module\n    \
                 return _bootstrap._gcd_import(name[level:], package, level)\n\
                 tests/test_{m}.py:2: in <module>\n    from opk.core import {m}\n\
                 E   ModuleNotFoundError: No module named 'opk'\n"
            ));
        }
        text.push_str(
            "ERROR tests/test_bundle_roundtrip.py\nERROR tests/test_schema_profiles.py\n",
        );
        for budget in [180, 250, 330, 400] {
            let kept = placeholder(&text, budget);
            assert!(
                kept.contains("E   ModuleNotFoundError: No module named 'opk'"),
                "{budget}: {kept}"
            );
        }
    }

    #[test]
    fn readable_json_has_its_strings_as_lines() {
        let args = r#"{"command":["bash","-lc","apply_patch <<'P'\n*** Add File: tests/test_install.py\n+import x\nP"],"workdir":"/w"}"#;
        let r = readable(args);
        assert!(
            r.lines()
                .any(|l| l == "*** Add File: tests/test_install.py"),
            "{r}"
        );
        assert!(r.lines().any(|l| l == "workdir: /w"), "{r}");
        assert_eq!(readable("plain text"), "plain text");
    }

    #[test]
    fn a_line_said_again_is_kept_once() {
        let mut text = String::new();
        for epoch in 0..40 {
            text.push_str("UserWarning: torchaudio.load is deprecated\n");
            text.push_str(&format!("epoch {epoch} done\n"));
        }
        text.push_str("ValueError: sample rate 22050 does not match 44100\n");
        text.push_str("  File \"/srv/train/loader.py\", line 88, in load\n");
        let p = placeholder(&text, 200);
        assert_eq!(p.matches("UserWarning").count(), 1, "{p}");
        assert!(
            p.contains("ValueError: sample rate") && p.contains("loader.py"),
            "{p}"
        );
    }

    #[test]
    fn a_line_a_diff_adds_and_shows_is_kept_once() {
        let text = "@@ -10,4 +10,6 @@\n\
             def init(self):\n\
            -        self.log(f\"[WS] Init failed: {e}\")\n\
            +        self.log(f\"[WS] Init failed: {e}\")\n\
            +        QMessageBox.critical(self, \"Workspace\", \"Init failed\")\n\
            +- `opk rules` reports errors\n\
                    self.log(f\"[WS] Init failed: {e}\")\n\
            - `opk rules` reports errors\n\
            ValueError: bad printer profile\n";
        let kept = key_lines(text, 1000);
        assert_eq!(kept.matches("self.log").count(), 1, "{kept}");
        assert_eq!(kept.matches("opk rules").count(), 1, "{kept}");
        assert!(kept.contains("QMessageBox.critical"), "{kept}");
        assert!(kept.contains("ValueError: bad printer profile"), "{kept}");
    }

    /// A file as Claude Code's Read gives it (lines numbered `    41→`)
    /// with `definitions` at the given lines and filler elsewhere.
    fn read_output(definitions: &[(usize, &str)]) -> String {
        let mut text = String::new();
        for n in 1..=120 {
            let line = definitions
                .iter()
                .find(|(at, _)| *at == n)
                .map_or("    <Box sx={{ gap: 2 }} /> value = compute(n)", |d| d.1);
            text.push_str(&format!("{n:>6}→{line}\n"));
        }
        text
    }

    #[test]
    fn claude_code_s_numbered_lines_keep_their_definitions() {
        let python = read_output(&[(41, "def load_config(path):"), (90, "class Trainer:")]);
        let p = placeholder(&python, 120);
        assert!(p.contains("41→def load_config(path):"), "{p}");
        assert!(p.contains("90→class Trainer:"), "{p}");
        // What a JavaScript or TypeScript module exports.
        let typescript = read_output(&[
            (
                12,
                "export default function ForgotPasswordDialog({ open }: Props) {",
            ),
            (60, "export const theme = createTheme({"),
        ]);
        let p = placeholder(&typescript, 160);
        assert!(
            p.contains("export default function ForgotPasswordDialog"),
            "{p}"
        );
        assert!(p.contains("export const theme"), "{p}");
    }

    #[test]
    fn one_pass_finds_the_words_a_search_per_word_finds() {
        for l in [
            "FAILED tests/test_x.py::test_y - AssertionError",
            "2 failed, 3 passed, 1 warning in 0.2s",
            "Exit code: 1",
            "Permission DENIED: cannot open /etc/x (No such file)",
            "erreur fatale: invalide — échec",
            "rust/target/debug/.fingerprint/thiserror-c851/lib-thiserror",
            "raise TypeError(msg) from self.error_handler",
            "Traceback (most recent call last):",
            "nothing to see here",
            "",
        ] {
            assert_eq!(words_in(l), words_each(l), "{l}");
        }
        let both = words_in("2 failed");
        assert_eq!(both & (1 << 3 | 1 << 12), 1 << 3 | 1 << 12);
        assert_eq!(words_in("nothing to see here"), 0);
    }

    #[test]
    fn a_failure_word_inside_a_name_or_a_path_is_no_failure() {
        let failure = |l: &str| words_in(l) & FAILURE_WORDS != 0;
        for l in [
            "rust/shannon-api/target/debug/.fingerprint/thiserror-c85141cebfdd2830/lib-thiserror",
            "rust/agent-core/src/error.rs",
            "yarn-error.log*",
            "tests/test_error_paths.py",
            "    self.log.error(msg)",
            "cc -Werror -o build/main main.c",
        ] {
            assert!(!failure(l), "{l}");
        }
        for l in [
            "fatal: Could not read from remote repository.",
            "error: cannot find value `x` in this scope",
            "raise TypeError(msg)",
            "java.io.FileNotFoundException: /etc/x",
            "[ERROR] Failed to execute goal",
            "sh: 1: make: not found",
            "Permission denied (publickey).",
        ] {
            assert!(failure(l), "{l}");
        }
        // A listing of paths that merely name errors keeps none of them
        // over the failure it holds.
        let mut listing: String = (0..40)
            .map(|i| format!("rust/target/debug/.fingerprint/thiserror-{i:04x}/lib-thiserror\n"))
            .collect();
        listing.push_str("fatal: Could not read from remote repository.\n");
        let kept = key_lines(&listing, 120);
        assert!(kept.contains("fatal: Could not read"), "{kept}");
    }

    #[test]
    fn a_command_s_own_error_line_goes_before_a_file_s_definitions() {
        for l in [
            "bash: line 3: rsync: command not found",
            "zsh: command not found: import",
            "cat: /repo/spec.md: No such file or directory",
            "fatal: Could not read from remote repository.",
            "sh: 1: make: not found",
        ] {
            assert!(command_error(l, words_in(l)), "{l}");
        }
        for l in [
            "293:        raise AttributeError(",
            "formState: { errors, isSubmitting }",
            "source: std::io::Error,",
            "src/error.rs: cannot read",
            "log::error!(\"Failed to create data directory: {}\", e);",
            "Note: nothing failed",
            "errors: 0",
        ] {
            assert!(!command_error(l, words_in(l)), "{l}");
        }
        // A digest's text: a file's definitions read after the command
        // that failed. Room for one line: the failure's.
        let mut text =
            String::from("$ rsync -a data/ remote:data/\nbash: line 3: rsync: command not found\n");
        for i in 0..14 {
            text.push_str(&format!("def _load_part_{i}(path):\n    return path\n"));
        }
        let kept = key_lines(&text, 60);
        assert!(kept.contains("rsync: command not found"), "{kept}");
    }

    #[test]
    fn a_traceback_keeps_the_agent_s_frames_over_a_library_s() {
        let lib = "/home/u/.venv/lib/python3.12/site-packages/litdata/streaming";
        let mut out = String::from("Traceback (most recent call last):\n");
        out.push_str("  File \"/work/app/train.py\", line 48, in main\n    run()\n");
        for (i, f) in ["dataset", "client", "downloader", "reader"]
            .iter()
            .enumerate()
        {
            out.push_str(&format!(
                "  File \"{lib}/{f}.py\", line {}, in _{f}\n    x()\n",
                100 + i
            ));
        }
        out.push_str("RuntimeError: data_connection_id is required\n");
        let kept = key_lines(&out, 120);
        assert!(kept.contains("RuntimeError: data_connection_id"), "{kept}");
        assert!(kept.contains("/work/app/train.py"), "{kept}");
        assert!(!kept.contains("site-packages"), "{kept}");
    }

    #[test]
    fn source_code_names_what_it_defines_imports_and_raises() {
        let text = "from django.db.models.fields.related_lookups import MultiColSource\n\
            from django.db import (DEFAULT_DB_ALIAS, NotSupportedError as NSE)\n\
            import { Dialog, DialogTitle } from '@mui/material';\n\
            import os\n\
            class Query(BaseExpression):\n\
            \x20   def relabeled_clone(self, change_map):\n\
            \x20       raise ValueError(\"Need either using or connection\")\n\
            \x20   except AttributeError:\n\
            \x20 105→    async def __repr__(self):\n\
            export default function ForgotPasswordDialog({ open }) {\n\
            pub(crate) async fn load_config(path: &Path) -> Config {\n\
            impl Display for Query {\n\
            const total = 3;\n\
            the class of 2024 said def is fine\n\
            class Query:\n";
        assert_eq!(
            code_names(text, 100),
            [
                "MultiColSource",
                "DEFAULT_DB_ALIAS",
                "NotSupportedError",
                "Dialog",
                "DialogTitle",
                "Query",
                "relabeled_clone",
                "ValueError",
                "AttributeError",
                "__repr__",
                "ForgotPasswordDialog",
                "load_config",
                "Display",
            ]
        );
        assert!(code_names("error: x\nexit code 1\nsee docs/x.md\n", 100).is_empty());
        assert_eq!(code_names(text, 2), ["MultiColSource", "DEFAULT_DB_ALIAS"]);
    }

    #[test]
    fn a_masked_source_file_names_the_definitions_its_key_lines_left_out() {
        let mut text = String::from("from app.core import Registry, load_plugins\n");
        for n in 0..60 {
            text.push_str(&format!(
                "def handler_{n:02}(request, registry: Registry, *, timeout: float = 30.0) -> Response:\n    return registry.get({n})\n\n"
            ));
        }
        let p = placeholder(&text, 760);
        assert!(p.len() < 760 + 120, "{}", p.len());
        let names = p.lines().find_map(|l| l.strip_prefix("names: "));
        let names = names.unwrap_or_else(|| panic!("no names: {p}"));
        // What the key lines left out, none of it twice.
        for n in names.split(", ") {
            assert_eq!(p.matches(n).count(), 1, "{n}: {p}");
        }
        // `Registry` is in the key lines already.
        assert!(names.starts_with("load_plugins, handler_00"), "{names}");
        let defined = (0..60)
            .filter(|n| p.contains(&format!("handler_{n:02}")))
            .count();
        let as_lines = key_lines(&text, 760).matches("def handler_").count();
        assert!(defined > as_lines * 3 / 2, "{defined} vs {as_lines}: {p}");
        // Output that is not source code has no names line.
        let log = "INFO starting\nERROR: disk full at /var/lib/x.db\n".repeat(40);
        assert!(!placeholder(&log, 300).contains("names:"));
    }

    #[test]
    fn placeholders_are_pure() {
        let t = "error: x\n".repeat(100);
        assert_eq!(placeholder(&t, 300), placeholder(&t, 300));
    }
}
