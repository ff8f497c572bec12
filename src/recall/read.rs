//! Reading an original for `condense_recall`: the whole of it when it
//! fits, else the part the model asks for (a line range, or the lines
//! holding a search), always within the room the prompt has left and saying
//! how to read on.
//!
//! The range is two integers, `start_line` and `end_line` (from 1, both
//! inclusive, either may be left out), not one `lines: "120-180"` string:
//! each is a typed field that the API checks and models fill like any other
//! number; there is no separator to guess (`120:180`, `120..180`, `L120`);
//! reading on is one number (`start_line` alone reads to the end, as far as
//! fits); and models know the pair from their file-reading tools. Numbers
//! may come as strings (`"120"`); a number that is not a whole one gets a
//! result saying so.
//!
//! What a recall returns:
//! - no range and no search, and the original fits: the original, byte
//!   for byte;
//! - no range and no search, too large: a whole prefix of its lines,
//!   verbatim, after a first line saying which lines these are and the
//!   exact arguments that read on (a prefix, not head and tail, so that
//!   the rest is one call away);
//! - a range: its lines numbered `N: text`, cut to fit at a line boundary
//!   the same way (a first line longer than the room: its head, saying so);
//! - a search (within the range, when one is given): each line holding
//!   the text, ignoring case, as `N: text`, with [`CONTEXT`] lines around
//!   it as `N- text` and `--` between groups (grep's convention), at most
//!   [`MAX_MATCHES`] of them, saying how many there are and where to go on;
//!   a line longer than [`LONG_LINE`] shows the part around the match;
//! - arguments that cannot be answered (a reversed range, a line past the
//!   end, a number that is not one, a search too long or spanning lines):
//!   one line saying what is wrong.
//!
//! Cost: the search is a substring search on each line case-folded in turn
//! (no patterns: what a model or a hostile client sends costs linear time);
//! memory: the result, one folded line and `MAX_MATCHES + 1` line numbers.
//! The result never exceeds the room (in bytes, so in characters too).

use std::borrow::Cow;
use std::fmt::Write as _;

use memchr::memmem::Finder;
use serde_json::Value;

use crate::compaction::text::floor_boundary;
use crate::wire::tools::{Part, RECALL_TOOL};

/// Lines shown before and after each line a search finds.
pub const CONTEXT: usize = 2;
/// Lines a search shows at most in one result.
pub const MAX_MATCHES: usize = 20;
/// Longest search, in characters.
pub const MAX_SEARCH_CHARS: usize = 200;
/// Longest line a search shows whole, in bytes; longer ones show the part
/// around the match (or their head, for a line of context).
pub const LONG_LINE: usize = 300;
/// What marks a line a search shows in part.
const ELLIPSIS: &str = "…";

/// What a recall of `key` returns from `original` for `part`, in at most
/// `room` bytes.
pub fn read(original: &str, key: &str, part: &Part, room: usize) -> String {
    let mut text = match answer(original, key, part, room) {
        Ok(text) => text,
        Err(what) => format!("[condense: {what}]"),
    };
    // Only a room smaller than a note (never given: the proxy gives each
    // recall at least 1000) gets here with more.
    text.truncate(floor_boundary(&text, room));
    text
}

fn answer(original: &str, key: &str, part: &Part, room: usize) -> Result<String, String> {
    let search = match &part.search {
        None => None,
        Some(Err(given)) => return Err(format!("search must be text, got {given}")),
        // Models that fill every field send an empty one for "none".
        Some(Ok(s)) if s.is_empty() => None,
        Some(Ok(s)) if s.chars().nth(MAX_SEARCH_CHARS).is_some() => {
            return Err(format!(
                "search is longer than {MAX_SEARCH_CHARS} characters: pass a short part of one line"
            ));
        }
        Some(Ok(s)) if s.contains('\n') => {
            return Err(
                "search holds a line break, but lines are searched one at a time: pass text from one line"
                    .into(),
            );
        }
        Some(Ok(s)) => Some(s.as_str()),
    };
    let ranged = part.start_line.is_some() || part.end_line.is_some();
    if search.is_none() && !ranged && original.len() <= room {
        return Ok(original.to_string());
    }
    let total = line_count(original);
    if total == 0 {
        return Err("the original under this key is empty".into());
    }
    let start = line_arg("start_line", part.start_line.as_ref(), total)?.unwrap_or(1);
    let given_end = line_arg("end_line", part.end_line.as_ref(), total)?;
    if start > total as u64 {
        let lines = if total == 1 { "line" } else { "lines" };
        return Err(format!(
            "start_line {start} is past the end: the original has {total} {lines}"
        ));
    }
    if let Some(end) = given_end.filter(|e| *e < start) {
        return Err(format!("end_line {end} is before start_line {start}"));
    }
    // Both within 1..=total now.
    let start = start as usize;
    let end = given_end.map_or(total, |e| e.min(total as u64) as usize);
    let span = Span {
        key,
        start,
        end,
        total,
        // Reading on keeps the end the model asked for.
        keep_end: end < total,
    };
    Ok(match search {
        Some(needle) => span.search(original, needle, room),
        None => span.lines(original, ranged, room),
    })
}

/// A line number argument: None when absent, an error saying what is
/// wrong when it is not a whole number from 1.
fn line_arg(
    name: &str,
    given: Option<&Result<u64, String>>,
    total: usize,
) -> Result<Option<u64>, String> {
    match given {
        None => Ok(None),
        Some(Ok(n)) if *n >= 1 => Ok(Some(*n)),
        Some(Ok(n)) => Err(format!(
            "{name} must be a whole number from 1 to {total}, got {n}"
        )),
        Some(Err(given)) => Err(format!(
            "{name} must be a whole number from 1 to {total}, got {given}"
        )),
    }
}

/// The lines of a text: split at `\n`, a final `\n` ending the last line
/// (not starting an empty one); an empty text has none.
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let body = text.strip_suffix('\n').unwrap_or(text);
    body.split('\n')
        .take(if text.is_empty() { 0 } else { usize::MAX })
}

fn line_count(text: &str) -> usize {
    if text.is_empty() {
        return 0;
    }
    let body = text.strip_suffix('\n').unwrap_or(text);
    memchr::memchr_iter(b'\n', body.as_bytes()).count() + 1
}

/// The lines a recall reads (`start..=end` of `total`, from 1) of the
/// original under `key`.
struct Span<'a> {
    key: &'a str,
    start: usize,
    end: usize,
    total: usize,
    /// Whether the arguments that read on name `end` (the model asked for
    /// an end before the last line).
    keep_end: bool,
}

/// What a result cut to fit shows of a span.
enum Shown {
    /// Lines `from..=to`, whole.
    Lines(usize, usize),
    /// The first `shown` bytes of line `line`, `len` bytes long.
    Head {
        line: usize,
        len: usize,
        shown: usize,
    },
}

impl Span<'_> {
    /// The arguments that read from line `from` on (with `search`).
    fn call(&self, from: usize, search: Option<&str>) -> String {
        let mut args = format!("{{\"key\":{},\"start_line\":{from}", json_string(self.key));
        if self.keep_end {
            let _ = write!(args, ",\"end_line\":{}", self.end);
        }
        if let Some(s) = search {
            let _ = write!(args, ",\"search\":{}", json_string(s));
        }
        args.push('}');
        format!("call {RECALL_TOOL} with {args}")
    }

    /// The first line of a result cut to fit.
    fn cut_note(&self, shown: &Shown) -> String {
        let total = self.total;
        match *shown {
            Shown::Lines(from, to) => {
                let rest = match to < self.end {
                    true => format!(". For the rest {}", self.call(to + 1, None)),
                    false => String::new(),
                };
                format!("[condense: cut to fit: lines {from}-{to} of {total} shown{rest}]")
            }
            Shown::Head { line, len, shown } => {
                let rest = match line < self.end {
                    true => format!(". For the lines after it {}", self.call(line + 1, None)),
                    false => String::new(),
                };
                format!(
                    "[condense: cut to fit: line {line} of {total} is {len} bytes, its first {shown} shown; a search finds text further in it{rest}]"
                )
            }
        }
    }

    /// The span's lines, numbered (`N: text`) when a range was asked for,
    /// else verbatim (the original, too large to give whole, from its start).
    fn lines(&self, original: &str, numbered: bool, room: usize) -> String {
        if numbered {
            let note = format!(
                "[condense: lines {}-{} of {}]",
                self.start, self.end, self.total
            );
            let (body, last) = self.fill(original, numbered, room.saturating_sub(note.len() + 1));
            if last == self.end {
                return format!("{note}\n{body}");
            }
        }
        // Room for the longest note a cut can need.
        let reserve = self
            .cut_note(&Shown::Lines(self.end, self.end - 1))
            .len()
            .max(
                self.cut_note(&Shown::Head {
                    line: self.start,
                    len: original.len(),
                    shown: original.len(),
                })
                .len(),
            )
            + 1;
        let budget = room.saturating_sub(reserve);
        let (mut body, last) = self.fill(original, numbered, budget);
        let shown = match last >= self.start {
            true => Shown::Lines(self.start, last),
            false => {
                // Not even one line fits: the head of the first.
                let line = lines(original).nth(self.start - 1).unwrap_or("");
                let prefix = if numbered { digits(self.start) + 2 } else { 0 };
                let head = &line[..floor_boundary(line, budget.saturating_sub(prefix + 1))];
                if numbered {
                    let _ = write!(body, "{}: ", self.start);
                }
                body.push_str(head);
                body.push('\n');
                Shown::Head {
                    line: self.start,
                    len: line.len(),
                    shown: head.len(),
                }
            }
        };
        format!("{}\n{body}", self.cut_note(&shown))
    }

    /// The span's lines that fit in `budget` bytes, each ending in `\n`,
    /// and the last one given (`start - 1` when none fits).
    fn fill(&self, original: &str, numbered: bool, budget: usize) -> (String, usize) {
        let mut out = String::new();
        let mut last = self.start - 1;
        for (i, line) in lines(original)
            .enumerate()
            .skip(self.start - 1)
            .take(self.end + 1 - self.start)
        {
            let n = i + 1;
            let prefix = if numbered { digits(n) + 2 } else { 0 };
            if out.len() + prefix + line.len() + 1 > budget {
                break;
            }
            if numbered {
                let _ = write!(out, "{n}: ");
            }
            out.push_str(line);
            out.push('\n');
            last = n;
        }
        (out, last)
    }

    /// The span's lines holding `needle` (ignoring case), with context.
    fn search(&self, original: &str, needle: &str, room: usize) -> String {
        let mut folded = String::new();
        fold_into(needle, &mut folded);
        let finder = Finder::new(folded.as_bytes()).into_owned();
        let needle_chars = needle.chars().count();
        let in_span = || {
            lines(original)
                .enumerate()
                .skip(self.start - 1)
                .take(self.end + 1 - self.start)
                .map(|(i, l)| (i + 1, l))
        };
        // The first MAX_MATCHES + 1 lines found (the last: where to go on),
        // and how many there are.
        let mut found = Vec::new();
        let mut count = 0usize;
        for (n, line) in in_span() {
            fold_into(line, &mut folded);
            if finder.find(folded.as_bytes()).is_some() {
                count += 1;
                if found.len() <= MAX_MATCHES {
                    found.push(n);
                }
            }
        }
        let (start, end, total) = (self.start, self.end, self.total);
        if count == 0 {
            return format!(
                "[condense: no line in lines {start}-{end} of {total} holds {} (ignoring case)]",
                json_string(needle)
            );
        }
        let note = |shown: usize, cut: bool, next: Option<usize>| {
            let plural = if count == 1 {
                "line holds"
            } else {
                "lines hold"
            };
            let quoted = json_string(needle);
            let part = match (shown < count, cut) {
                (false, _) => String::new(),
                (true, false) => format!(", the first {shown} shown"),
                (true, true) => format!(", the first {shown} shown (cut to fit)"),
            };
            let more = match next {
                Some(n) => format!(". For the rest {}", self.call(n, Some(needle))),
                None => String::new(),
            };
            format!(
                "[condense: in lines {start}-{end} of {total}, {count} {plural} {quoted} (ignoring case){part}; `N:` marks such a line, `N-` the lines around it{more}]"
            )
        };
        // Room for the longest note: `shown` and `next` have no more
        // digits than these.
        let reserve = note(count - 1, true, Some(end)).len() + 1;
        let budget = room.saturating_sub(reserve);
        let shown_at = &found[..found.len().min(MAX_MATCHES)];
        // The lines to show: CONTEXT around each line found, merged.
        let mut windows: Vec<(usize, usize)> = Vec::new();
        for &n in shown_at {
            let (from, to) = (n.saturating_sub(CONTEXT).max(start), (n + CONTEXT).min(end));
            match windows.last_mut() {
                Some(last) if from <= last.1 + 1 => last.1 = to,
                _ => windows.push((from, to)),
            }
        }
        let mut body = String::new();
        let mut shown = 0;
        let mut cut = false;
        let mut previous: Option<usize> = None;
        let mut w = 0;
        for (n, line) in in_span() {
            while w < windows.len() && n > windows[w].1 {
                w += 1;
            }
            let Some(&(from, _)) = windows.get(w) else {
                break;
            };
            if n < from {
                continue;
            }
            let hit = shown_at.get(shown) == Some(&n);
            let gap = if previous.is_some_and(|p| n > p + 1) {
                "--\n"
            } else {
                ""
            };
            let mark = if hit { ':' } else { '-' };
            let at = if hit {
                fold_into(line, &mut folded);
                finder
                    .find(folded.as_bytes())
                    .map(|p| matched(line, &folded[..p], needle_chars))
            } else {
                None
            };
            let fixed = gap.len() + digits(n) + 3;
            let mut shown_line = excerpt(line, at, LONG_LINE);
            if body.len() + fixed + shown_line.len() > budget {
                match (shown, hit) {
                    // Make room for the first line found: drop the lines
                    // before it, and show less of it.
                    (0, false) => continue,
                    (0, true) => {
                        cut = true;
                        let Some(cap) = budget.checked_sub(body.len() + fixed) else {
                            break;
                        };
                        shown_line = excerpt(line, at, cap);
                    }
                    _ => {
                        cut = true;
                        break;
                    }
                }
            }
            let _ = writeln!(body, "{gap}{n}{mark} {shown_line}");
            previous = Some(n);
            if hit {
                shown += 1;
                if cut {
                    break;
                }
            }
        }
        // The first line found that was not shown, if any, and whether
        // the room (not MAX_MATCHES) left it out.
        let next = (shown < count).then(|| found.get(shown).copied()).flatten();
        let by_room = cut && shown < shown_at.len();
        format!("{}\n{body}", note(shown, by_room, next))
    }
}

/// Where the match in `line` is, given the folded line before it (folding
/// keeps one char for one char): its byte range in `line`.
fn matched(line: &str, folded_before: &str, needle_chars: usize) -> (usize, usize) {
    let skip = folded_before.chars().count();
    let mut at = line.char_indices().map(|(i, _)| i).skip(skip);
    let from = at.next().unwrap_or(line.len());
    let to = line[from..]
        .char_indices()
        .nth(needle_chars)
        .map_or(line.len(), |(i, _)| from + i);
    (from, to)
}

/// At most `cap` bytes of `line`: all of it when it fits, else the part
/// from a little before the match `at` (or the head, without one), marked.
fn excerpt(line: &str, at: Option<(usize, usize)>, cap: usize) -> Cow<'_, str> {
    if line.len() <= cap {
        return Cow::Borrowed(line);
    }
    let Some(inner) = cap.checked_sub(2 * ELLIPSIS.len()) else {
        return Cow::Borrowed("");
    };
    let from = match at {
        Some((a, _)) => floor_boundary(line, a.saturating_sub(inner / 3)),
        None => 0,
    };
    let to = floor_boundary(line, from.saturating_add(inner));
    let mut out = String::with_capacity(cap);
    if from > 0 {
        out.push_str(ELLIPSIS);
    }
    out.push_str(&line[from..to]);
    if to < line.len() {
        out.push_str(ELLIPSIS);
    }
    Cow::Owned(out)
}

/// `s` case-folded one char for one char (a char whose lower case is
/// several stays as it is), into `out`.
fn fold_into(s: &str, out: &mut String) {
    out.clear();
    out.extend(s.chars().map(fold));
}

fn fold(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_lowercase();
    }
    let mut lower = c.to_lowercase();
    match (lower.next(), lower.next()) {
        (Some(l), None) => l,
        _ => c,
    }
}

fn digits(n: usize) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn numbered(n: usize) -> String {
        (1..=n).map(|i| format!("line {i} of the log\n")).collect()
    }

    fn range(start: u64, end: Option<u64>) -> Part {
        Part {
            start_line: Some(Ok(start)),
            end_line: end.map(Ok),
            search: None,
        }
    }

    fn search(s: &str) -> Part {
        Part {
            search: Some(Ok(s.into())),
            ..Part::default()
        }
    }

    /// The arguments a result's first line says to read on with.
    fn next_args(result: &str) -> Option<Value> {
        let first = result.lines().next()?;
        let at = first.find(" with {")? + " with ".len();
        let json = &first[at..first.len() - 1];
        Some(serde_json::from_str(json).unwrap())
    }

    fn part_of(args: &Value) -> Part {
        let num = |k: &str| args.get(k).map(|v| Ok(v.as_u64().unwrap()));
        Part {
            start_line: num("start_line"),
            end_line: num("end_line"),
            search: args
                .get("search")
                .map(|s| Ok(s.as_str().unwrap().to_string())),
        }
    }

    #[test]
    fn an_original_that_fits_comes_back_byte_for_byte() {
        let text = "a\r\nb\n\n";
        assert_eq!(read(text, "k", &Part::default(), 1000), text);
        assert_eq!(read("", "k", &Part::default(), 1000), "");
        // An empty search is no search.
        assert_eq!(read(text, "k", &search(""), 1000), text);
    }

    #[test]
    fn one_too_large_gives_a_prefix_of_whole_lines_and_how_to_read_on() {
        let text = numbered(600);
        let out = read(&text, "key-1", &Part::default(), 2000);
        assert!(out.len() <= 2000);
        let (note, body) = out.split_once('\n').unwrap();
        let shown = body.lines().count();
        assert_eq!(
            note,
            format!(
                "[condense: cut to fit: lines 1-{shown} of 600 shown. For the rest call condense_recall with {{\"key\":\"key-1\",\"start_line\":{}}}]",
                shown + 1
            )
        );
        assert!(text.starts_with(body) && body.ends_with('\n'));
        assert!(shown > 50);
    }

    #[test]
    fn a_range_gives_its_lines_numbered() {
        let text = numbered(600);
        let out = read(&text, "k", &range(120, Some(122)), 1000);
        assert_eq!(
            out,
            "[condense: lines 120-122 of 600]\n120: line 120 of the log\n121: line 121 of the log\n122: line 122 of the log\n"
        );
        // An end past the last line reads to it.
        let out = read(&text, "k", &range(599, Some(10_000)), 1000);
        assert!(out.starts_with("[condense: lines 599-600 of 600]\n599: "));
        // A range cut to fit says how to read on, keeping its end.
        let out = read(&text, "k", &range(100, Some(300)), 1000);
        let args = next_args(&out).unwrap();
        assert_eq!(args["end_line"], 300);
        let last: usize = out
            .lines()
            .last()
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(args["start_line"], last + 1);
        assert!(out.starts_with(&format!(
            "[condense: cut to fit: lines 100-{last} of 600 shown."
        )));
    }

    #[test]
    fn a_line_longer_than_the_room_shows_its_head() {
        let text = format!("short\n{}\nafter\n", "x".repeat(5000));
        let out = read(&text, "k", &range(2, None), 1000);
        assert!(out.len() <= 1000);
        assert!(out.starts_with("[condense: cut to fit: line 2 of 3 is 5000 bytes, its first "));
        assert_eq!(next_args(&out).unwrap()["start_line"], 3);
        assert!(out.lines().nth(1).unwrap().starts_with("2: xxx"));
        // Unasked, a one-line original shows its head, verbatim.
        let one = "y".repeat(5000);
        let out = read(&one, "k", &Part::default(), 1000);
        assert!(out.starts_with("[condense: cut to fit: line 1 of 1 is 5000 bytes"));
        assert!(out.lines().nth(1).unwrap().starts_with("yyy"));
    }

    #[test]
    fn a_search_gives_the_lines_holding_it_with_context() {
        let mut text = numbered(100);
        text = text.replace("line 50 of", "line 50 has the Needle of");
        text = text.replace("line 53 of", "line 53 has the NEEDLE of");
        text = text.replace("line 90 of", "line 90 has the needle of");
        let out = read(&text, "k", &search("needle"), 4000);
        assert_eq!(
            out,
            "[condense: in lines 1-100 of 100, 3 lines hold \"needle\" (ignoring case); `N:` marks such a line, `N-` the lines around it]\n\
             48- line 48 of the log\n\
             49- line 49 of the log\n\
             50: line 50 has the Needle of the log\n\
             51- line 51 of the log\n\
             52- line 52 of the log\n\
             53: line 53 has the NEEDLE of the log\n\
             54- line 54 of the log\n\
             55- line 55 of the log\n\
             --\n\
             88- line 88 of the log\n\
             89- line 89 of the log\n\
             90: line 90 has the needle of the log\n\
             91- line 91 of the log\n\
             92- line 92 of the log\n"
        );
        // Within a range.
        let mut within = search("needle");
        within.start_line = Some(Ok(52));
        within.end_line = Some(Ok(60));
        let out = read(&text, "k", &within, 4000);
        assert!(out.starts_with("[condense: in lines 52-60 of 100, 1 line holds \"needle\""));
        assert!(out.contains("\n52- line 52"));
        assert!(!out.contains("\n90:"));
        let none = read(&text, "k", &search("absent"), 4000);
        assert_eq!(
            none,
            "[condense: no line in lines 1-100 of 100 holds \"absent\" (ignoring case)]"
        );
    }

    #[test]
    fn a_search_with_many_matches_says_where_the_next_is() {
        let text = numbered(600);
        let out = read(&text, "k", &search("of the"), 100_000);
        assert!(out.starts_with(
            "[condense: in lines 1-600 of 600, 600 lines hold \"of the\" (ignoring case), the first 20 shown;"
        ));
        let args = next_args(&out).unwrap();
        assert_eq!(
            args,
            serde_json::json!({"key": "k", "start_line": 21, "search": "of the"})
        );
        let out = read(&text, "k", &part_of(&args), 100_000);
        assert!(out.contains("\n21: line 21 of"));
        // Cut by the room, it says so and goes on from the first not shown.
        let out = read(&text, "k", &search("of the"), 500);
        assert!(out.len() <= 500);
        assert!(out.contains("shown (cut to fit)"), "{out}");
        let last_hit = out
            .lines()
            .rev()
            .find_map(|l| l.split_once(": ")?.0.parse::<usize>().ok())
            .unwrap();
        assert_eq!(next_args(&out).unwrap()["start_line"], last_hit + 1);
    }

    #[test]
    fn a_long_line_is_shown_around_the_match() {
        let line = format!("{}MATCH{}", "a".repeat(5000), "b".repeat(5000));
        let text = format!("before\n{line}\nafter\n");
        let out = read(&text, "k", &search("match"), 4000);
        let shown = out.lines().find(|l| l.starts_with("2: ")).unwrap();
        assert!(shown.len() <= LONG_LINE + 3);
        assert!(
            shown.contains("aaaMATCHbbb") && shown.starts_with("2: …a") && shown.ends_with("b…")
        );
        // Multi-byte text before the match keeps the excerpt on it.
        let line = format!("{}Treffer{}", "ä".repeat(3000), "ö".repeat(3000));
        let out = read(&line, "k", &search("TREFFER"), 4000);
        assert!(out.contains("äTrefferö"), "{out}");
    }

    #[test]
    fn arguments_that_cannot_be_answered_say_what_is_wrong() {
        let text = numbered(600);
        let say = |part: Part| read(&text, "k", &part, 1000);
        assert_eq!(
            say(range(20, Some(10))),
            "[condense: end_line 10 is before start_line 20]"
        );
        assert_eq!(
            say(range(700, None)),
            "[condense: start_line 700 is past the end: the original has 600 lines]"
        );
        assert_eq!(
            say(range(0, None)),
            "[condense: start_line must be a whole number from 1 to 600, got 0]"
        );
        let bad = Part {
            end_line: Some(Err("\"abc\"".into())),
            ..Part::default()
        };
        assert_eq!(
            say(bad),
            "[condense: end_line must be a whole number from 1 to 600, got \"abc\"]"
        );
        assert!(say(search(&"x".repeat(100_000))).contains("longer than 200 characters"));
        assert!(say(search("a\nb")).contains("line break"));
        let bad = Part {
            search: Some(Err("an object".into())),
            ..Part::default()
        };
        assert_eq!(say(bad), "[condense: search must be text, got an object]");
        assert_eq!(
            read("", "k", &range(1, None), 1000),
            "[condense: the original under this key is empty]"
        );
    }

    #[test]
    fn a_hostile_search_costs_linear_time() {
        // Two-Way substring search: no backtracking on near-matches.
        let original = format!("{}\n", "a".repeat(1 << 16)).repeat(64);
        let needle = format!("{}b", "a".repeat(MAX_SEARCH_CHARS - 1));
        let started = std::time::Instant::now();
        let out = read(&original, "k", &search(&needle), 5000);
        assert!(out.starts_with("[condense: no line in lines 1-64 of 64 holds"));
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // Every line a match, each longer than the room: each shown in
        // part, and the note says where to go on.
        let out = read(&original, "k", &search("aaa"), 1000);
        assert!(out.len() <= 1000);
        let shown = out
            .lines()
            .filter(|l| {
                l.split_once(": ")
                    .is_some_and(|(n, _)| n.parse::<usize>().is_ok())
            })
            .count();
        assert!(shown >= 1, "{out}");
        assert_eq!(next_args(&out).unwrap()["start_line"], shown + 1);
    }

    /// Checks a numbered result against the original: every line it shows
    /// is the original's line of that number (whole, its head, or for a
    /// search an excerpt), in order. Returns the numbers shown.
    fn check_numbered(original: &str, out: &str) -> Vec<usize> {
        let lines: Vec<&str> = lines(original).collect();
        let mut numbers = Vec::new();
        for shown in out.split('\n').skip(1) {
            if shown.is_empty() || shown == "--" {
                continue;
            }
            let digits_end = shown.find([':', '-']).unwrap();
            let n: usize = shown[..digits_end].parse().unwrap();
            let text = &shown[digits_end + 2..];
            let orig = lines[n - 1];
            let bare = text.trim_start_matches(ELLIPSIS).trim_end_matches(ELLIPSIS);
            assert!(
                orig == text || orig.contains(bare),
                "line {n}: {text:?} is not of {orig:?}"
            );
            if let Some(&p) = numbers.last() {
                assert!(n > p, "{out}");
            }
            numbers.push(n);
        }
        numbers
    }

    fn line_value() -> impl Strategy<Value = Option<Result<u64, String>>> {
        prop_oneof![
            Just(None),
            (0u64..40).prop_map(|n| Some(Ok(n))),
            Just(Some(Ok(u64::MAX))),
            Just(Some(Err("\"x\"".to_string()))),
        ]
    }

    fn any_part() -> impl Strategy<Value = Part> {
        (
            line_value(),
            line_value(),
            prop_oneof![
                Just(None),
                "[aAbB\\n é]{0,3}".prop_map(|s| Some(Ok(s))),
                any::<String>().prop_map(|s| Some(Ok(s))),
            ],
        )
            .prop_map(|(start_line, end_line, search)| Part {
                start_line,
                end_line,
                search,
            })
    }

    proptest! {
        #[test]
        fn any_original_any_arguments_stay_within_the_room_and_number_lines_right(
            original in prop_oneof!["[ab\\né\r]{0,400}", any::<String>()],
            part in any_part(),
            room in 0usize..3000,
        ) {
            let out = read(&original, "k", &part, room);
            prop_assert!(out.len() <= room);
            let whole = part.start_line.is_none()
                && part.end_line.is_none()
                && match &part.search {
                    None => true,
                    Some(Ok(s)) => s.is_empty(),
                    Some(Err(_)) => false,
                };
            let numbered_result = out.starts_with("[condense: lines")
                || out.starts_with("[condense: in lines")
                || out.starts_with("[condense: cut to fit");
            if numbered_result && !whole && room >= 1000 {
                check_numbered(&original, &out);
            }
        }

        #[test]
        fn following_the_note_reads_a_range_exactly(
            original in "([a-zé]{0,60}\n){1,120}",
            start in 1u64..40,
            end in proptest::option::of(1u64..200),
            room in 400usize..2000,
        ) {
            let all: Vec<&str> = lines(&original).collect();
            let mut part = range(start, end);
            if start as usize > all.len() || end.is_some_and(|e| e < start) {
                prop_assert!(read(&original, "k", &part, room).starts_with("[condense: "));
                return Ok(());
            }
            let last = end.map_or(all.len(), |e| (e as usize).min(all.len()));
            let mut got = Vec::new();
            for _ in 0..1000 {
                let out = read(&original, "k", &part, room);
                prop_assert!(out.len() <= room);
                let numbers = check_numbered(&original, &out);
                got.extend(numbers.iter().copied());
                match next_args(&out) {
                    Some(args) => {
                        prop_assert_eq!(args["start_line"].as_u64(), numbers.last().map(|n| *n as u64 + 1));
                        part = part_of(&args);
                    }
                    None => break,
                }
            }
            let want: Vec<usize> = (start as usize..=last).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn reading_on_from_a_whole_recall_gives_every_line_once(
            original in "([a-zé]{0,60}\n){1,120}",
            room in 400usize..2000,
        ) {
            let mut out = read(&original, "k", &Part::default(), room);
            if out == original {
                return Ok(());
            }
            // A verbatim prefix first, then numbered lines.
            let (note, prefix) = out.split_once('\n').unwrap();
            prop_assert!(note.starts_with("[condense: cut to fit: lines 1-"));
            prop_assert!(original.starts_with(prefix));
            let mut got: Vec<String> = prefix.lines().map(str::to_string).collect();
            while let Some(args) = next_args(&out) {
                prop_assert_eq!(args["start_line"].as_u64(), Some(got.len() as u64 + 1));
                out = read(&original, "k", &part_of(&args), room);
                prop_assert!(out.len() <= room);
                check_numbered(&original, &out);
                got.extend(out.lines().skip(1).map(|l| l.split_once(": ").unwrap().1.to_string()));
            }
            let want: Vec<String> = lines(&original).map(str::to_string).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn a_search_finds_every_line_in_order_reading_on(
            original in "([aAbé ]{0,30}\n){0,80}",
            needle in "[aAbé]{1,2}",
            room in 600usize..3000,
        ) {
            let all: Vec<&str> = lines(&original).collect();
            let lower = |s: &str| s.chars().map(fold).collect::<String>();
            let want: Vec<usize> = all
                .iter()
                .enumerate()
                .filter(|(_, l)| lower(l).contains(&lower(&needle)))
                .map(|(i, _)| i + 1)
                .collect();
            let mut part = search(&needle);
            let mut got = Vec::new();
            for _ in 0..1000 {
                let out = read(&original, "k", &part, room);
                prop_assert!(out.len() <= room);
                if all.is_empty() || want.is_empty() {
                    prop_assert!(out.starts_with("[condense: "));
                    prop_assert!(!out.contains('\n'));
                    break;
                }
                check_numbered(&original, &out);
                got.extend(out.split('\n').skip(1).filter_map(|l| {
                    let (n, _) = l.split_once(": ")?;
                    n.parse::<usize>().ok()
                }));
                match next_args(&out) {
                    Some(args) => part = part_of(&args),
                    None => break,
                }
            }
            prop_assert_eq!(got, want);
        }
    }
}
