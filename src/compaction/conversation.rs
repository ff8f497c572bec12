//! What the stages need to know about a conversation: roles, which tool
//! result belongs to which call, the atomic units a drop must keep together,
//! which messages are protected, and which carry epistemic markers.
//!
//! Tool results are paired with their call by position: a result belongs to
//! the nearest earlier assistant message that made a call with its id. Real
//! agents reuse ids across turns (the tau-bench trace does), so pairing by id
//! alone would tie a result to the wrong turn.
//!
//! Agents that act in text rather than through function calling
//! (mini-swe-agent, SWE-agent's and OpenHands' text modes, smolagents) end
//! an assistant message with the action (a fenced block, or a tag such as
//! `</function>`) and return its output as the next `user` message. Such a
//! message is an *observation* and is treated as tool output: masked once
//! answered and old, never while it is the last user message.

use std::collections::HashMap;
use std::sync::LazyLock;

use aho_corasick::{AhoCorasick, Input, MatchKind};
use serde_json::Value;

use super::text::{MARK, content_text};
use crate::chat::Message;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
    Other,
}

impl Role {
    fn of(m: &Message) -> Role {
        match m.role() {
            Some("system") => Role::System,
            Some("developer") => Role::Developer,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some("tool") | Some("function") => Role::Tool,
            _ => Role::Other,
        }
    }
}

/// Words and phrases by which a model (or user) revises itself; messages with
/// them are kept verbatim longer.
const MARKERS: &[&str] = &[
    "wait",
    "actually",
    "let me reconsider",
    "i was wrong",
    "hmm",
    "on second thought",
    "double-check",
    "double check",
    "hold on",
];

#[derive(Debug, Clone)]
pub struct Analysis {
    pub roles: Vec<Role>,
    /// Index of the first message after the leading system/developer ones.
    pub base: usize,
    /// User (and system) messages before the first assistant message: the
    /// task and any instructions or context the client put before it.
    pub pinned: Vec<bool>,
    /// The first message after the pinned head (the system messages, then
    /// the pinned ones): where a replaced span may start.
    pub head: usize,
    /// The last user message.
    pub last_user: Option<usize>,
    /// Where the client's last words start: the last user message and the
    /// user messages right before it (the text and image blocks of a
    /// Messages user turn, each a view message of its own; instructions or
    /// an environment block sent as messages before a prompt, which a
    /// Messages client must send as one turn). All of them are protected,
    /// in every format alike.
    pub last_words_from: Option<usize>,
    /// For a tool result, the assistant message that made its call; for an
    /// observation, the assistant message before it.
    pub owner: Vec<Option<usize>>,
    /// Messages that must be dropped together (a call and its results),
    /// ordered by their first message.
    pub units: Vec<Vec<usize>>,
    /// Indices of assistant messages, ascending.
    pub assistants: Vec<usize>,
    /// Which messages carry an epistemic marker (their own text, or for a
    /// tool result, the assistant message that answered it).
    pub marker: Vec<bool>,
    /// Tool results (and observations) answered by a later assistant
    /// message.
    pub consumed: Vec<bool>,
    /// User messages that return the output of the action the assistant
    /// message before them ended with (see the module notes).
    pub observation: Vec<bool>,
}

/// Whether a message is one condense wrote in place of others (a digest
/// or a checkpoint): its text starts with [`MARK`].
fn condense_own(m: &Message) -> bool {
    matches!(m.content(), Some(Value::String(s)) if s.starts_with(MARK))
}

impl Analysis {
    pub fn of(messages: &[Message]) -> Analysis {
        let n = messages.len();
        let roles: Vec<Role> = messages.iter().map(Role::of).collect();
        let base = roles
            .iter()
            .position(|r| !matches!(r, Role::System | Role::Developer))
            .unwrap_or(n);
        let first_assistant = roles
            .iter()
            .position(|r| *r == Role::Assistant)
            .unwrap_or(n);
        // System and developer messages between the task and the first
        // step are context the client set up too (Claude Code's
        // environment).
        let pinned: Vec<bool> = (0..n)
            .map(|i| {
                i < first_assistant
                    && matches!(roles[i], Role::User | Role::System | Role::Developer)
            })
            .collect();
        let head = (base..n).find(|&i| !pinned[i]).unwrap_or(n);
        // condense's own digest is a user message, and may stand after the
        // client's last words (`after_what_was_said`, `emergency`'s last
        // resort): those words are still the client's, in a second pass too.
        let last_user = (0..n)
            .rev()
            .filter(|&i| roles[i] == Role::User)
            .find(|&i| !condense_own(&messages[i]))
            .or_else(|| roles.iter().rposition(|r| *r == Role::User));
        let assistants: Vec<usize> = (0..n).filter(|&i| roles[i] == Role::Assistant).collect();

        let call_ids: Vec<Vec<String>> = messages.iter().map(Message::tool_call_ids).collect();
        let observation: Vec<bool> = (0..n)
            .map(|i| {
                i > first_assistant
                    && roles[i] == Role::User
                    && roles[i - 1] == Role::Assistant
                    && action_start(&messages[i - 1]).is_some()
            })
            .collect();
        // One pass: each call id to the latest assistant message so far
        // that made a call with it (a search back from every result, over
        // every id of every call, was quadratic: 80,000 calls in one turn
        // took seconds).
        let mut owner = vec![None; n];
        let mut latest: HashMap<&str, usize> = HashMap::new();
        for i in 0..n {
            if observation[i] {
                owner[i] = Some(i - 1);
                continue;
            }
            match roles[i] {
                Role::Assistant => {
                    for id in &call_ids[i] {
                        latest.insert(id, i);
                    }
                }
                Role::Tool => {
                    owner[i] = messages[i]
                        .tool_call_id()
                        .and_then(|id| latest.get(id).copied());
                }
                _ => {}
            }
        }

        // Units: each message alone, except a call with its results.
        let mut unit_of: Vec<usize> = (0..n).collect();
        for i in 0..n {
            if let Some(o) = owner[i] {
                unit_of[i] = o;
            }
        }
        let mut units: Vec<Vec<usize>> = Vec::new();
        let mut index_of_unit = HashMap::new();
        for i in 0..n {
            let u = unit_of[i];
            let slot = *index_of_unit.entry(u).or_insert_with(|| {
                units.push(Vec::new());
                units.len() - 1
            });
            units[slot].push(i);
        }

        let own_marker: Vec<bool> = (0..n)
            .map(|i| matches!(roles[i], Role::Assistant | Role::User) && has_marker(&messages[i]))
            .collect();
        let mut marker = own_marker.clone();
        let mut consumed = vec![false; n];
        for i in 0..n {
            if roles[i] != Role::Tool && !observation[i] {
                continue;
            }
            // The first assistant message after a result answers it.
            if let Some(&next) = assistants.get(assistants.partition_point(|&a| a <= i)) {
                consumed[i] = true;
                marker[i] = own_marker[next];
            }
        }
        let last_words_from = last_user.map(|u| {
            let mut from = u;
            while !observation[u]
                && from > base
                && roles[from - 1] == Role::User
                && !observation[from - 1]
            {
                from -= 1;
            }
            from
        });
        Analysis {
            roles,
            base,
            pinned,
            head,
            last_user,
            last_words_from,
            owner,
            units,
            assistants,
            marker,
            consumed,
            observation,
        }
    }

    /// Whether message `i` is the output of an action: a tool result or an
    /// observation.
    pub fn output(&self, i: usize) -> bool {
        self.roles[i] == Role::Tool || self.observation[i]
    }

    /// Whether message `i` is one the user wrote: a user message that is
    /// not a tool's output (an observation).
    pub fn said(&self, i: usize) -> bool {
        self.roles[i] == Role::User && !self.output(i)
    }

    /// Whether message `i` is part of the client's last words (see
    /// [`Analysis::last_words_from`]).
    pub fn last_words(&self, i: usize) -> bool {
        matches!((self.last_words_from, self.last_user), (Some(from), Some(to)) if (from..=to).contains(&i))
    }

    /// Whether message `i` must come out byte-identical: system/developer
    /// messages, the client's last words, and unconsumed tool results (and
    /// observations).
    pub fn protected(&self, i: usize) -> bool {
        matches!(self.roles[i], Role::System | Role::Developer)
            || self.last_words(i)
            || (self.output(i) && !self.consumed[i])
    }
}

/// Where the action an assistant message's text ends with starts, if it
/// ends with one: a closed fenced block (```` ``` ````) or a tag
/// (`</function>`, `</execute_bash>`, `<end_code>`). An answer for a person
/// rarely ends exactly there; an agent's turn does, as its output comes
/// next. Only a message without tool calls, with text content, has one.
pub fn action_start(m: &Message) -> Option<usize> {
    if m.has_tool_calls() {
        return None;
    }
    match m.content()? {
        Value::String(text) => text_action_start(text.trim_end()),
        _ => None,
    }
}

fn text_action_start(t: &str) -> Option<usize> {
    if let Some(body) = t.strip_suffix("```") {
        // The opening fence; a lone closing one is an action with no body.
        return Some(body.rfind("```").unwrap_or(body.len()));
    }
    let body = t.strip_suffix('>')?;
    let open = body.rfind('<')?;
    let (closing, name) = match body[open + 1..].strip_prefix('/') {
        Some(name) => (true, name),
        None => (false, &body[open + 1..]),
    };
    let mut chars = name.chars();
    let is_name = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | ':' | '.'));
    if !is_name {
        return None;
    }
    let before = &t[..open];
    let start = if closing {
        // The matching opening tag: `<name>`, `<name=...>` or `<name attr>`.
        let tag = format!("<{name}");
        let opens: Vec<usize> = before.match_indices(tag.as_str()).map(|(i, _)| i).collect();
        opens.into_iter().rev().find(|&i| {
            let next = before[i + tag.len()..].chars().next();
            next.is_some_and(|c| matches!(c, '>' | '=' | ' ' | '\n'))
        })
    } else {
        // A marker after the action (`<end_code>`): the action before it.
        text_action_start(before.trim_end())
    };
    Some(start.unwrap_or(open))
}

fn has_marker(m: &Message) -> bool {
    content_text(m.content()).is_some_and(|t| marker_at(&t).is_some())
}

/// The markers, found in one pass, ASCII case ignored. None if it cannot
/// be built (it can; `marker_at` then searches marker by marker).
static MARKER_FINDER: LazyLock<Option<AhoCorasick>> = LazyLock::new(|| {
    AhoCorasick::builder()
        .ascii_case_insensitive(true)
        .match_kind(MatchKind::LeftmostFirst)
        .build(MARKERS)
        .ok()
});

/// Where the first epistemic marker in `text` starts (ASCII case ignored,
/// no letter or digit directly around it).
fn marker_at(text: &str) -> Option<usize> {
    let Some(finder) = &*MARKER_FINDER else {
        return marker_at_each(text);
    };
    // The leftmost occurrence of any marker; when it is inside a word, the
    // search goes on from just after its start. No marker is a prefix of
    // another, so no other marker starts where one does.
    let mut from = 0;
    while let Some(m) = finder.find(Input::new(text).span(from..text.len())) {
        if is_word(text, m.start(), m.end()) {
            return Some(m.start());
        }
        from = m.start() + 1;
    }
    None
}

/// `marker_at` marker by marker.
fn marker_at_each(text: &str) -> Option<usize> {
    let lower = text.to_ascii_lowercase();
    MARKERS.iter().filter_map(|k| word_at(&lower, k)).min()
}

/// The sentence of a message's text in which it first revises itself, at
/// most `max` bytes.
pub fn marker_sentence(m: &Message, max: usize) -> Option<String> {
    let text = content_text(m.content())?;
    let at = marker_at(&text)?;
    let is_end = |c: char| matches!(c, '.' | '!' | '?' | '\n');
    let start = text[..at].rfind(is_end).map_or(0, |i| i + 1);
    let end = text[at..].find(is_end).map_or(text.len(), |i| at + i + 1);
    let sentence = text[start..end].trim();
    let cut = super::text::floor_boundary(sentence, max);
    Some(sentence[..cut].to_string())
}

/// Where `needle` first occurs in `hay` with no letter or digit directly
/// around it.
fn word_at(hay: &str, needle: &str) -> Option<usize> {
    hay.match_indices(needle)
        .find(|&(i, _)| is_word(hay, i, i + needle.len()))
        .map(|(i, _)| i)
}

/// Whether `hay[start..end]` has no letter or digit directly around it.
fn is_word(hay: &str, start: usize, end: usize) -> bool {
    let before = hay[..start].chars().next_back();
    let after = hay[end..].chars().next();
    !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn the_last_words_are_the_user_messages_in_a_row_ending_the_last_one() {
        let m = |s: &str| Message::from_bytes(Bytes::copy_from_slice(s.as_bytes()));
        // Chat: instructions and a task in a row, which the Messages form of
        // the same conversation holds as one user turn: both are the last
        // words, in every format alike.
        let chat = [
            m(r#"{"role":"system","content":"s"}"#),
            m(r#"{"role":"user","content":"<instructions>never push</instructions>"}"#),
            m(r#"{"role":"user","content":"Fix the build."}"#),
        ];
        let a = Analysis::of(&chat);
        assert!(a.last_words(1) && a.last_words(2) && a.protected(1));
        // A user message an answer came between is not.
        let later = [
            m(r#"{"role":"system","content":"s"}"#),
            m(r#"{"role":"user","content":"Fix the build."}"#),
            m(r#"{"role":"assistant","content":"Done."}"#),
            m(r#"{"role":"user","content":"Now the docs."}"#),
        ];
        let a = Analysis::of(&later);
        assert!(!a.last_words(1) && a.last_words(3));
        // condense's digest after them is not the client's.
        let digest = [
            m(r#"{"role":"system","content":"s"}"#),
            m(r#"{"role":"user","content":"Fix the build."}"#),
            m(r#"{"role":"assistant","content":"Done."}"#),
            m(r#"{"role":"user","content":"[condense: 3 earlier messages were removed]"}"#),
        ];
        let a = Analysis::of(&digest);
        assert!(a.last_words(1) && !a.last_words(3) && a.protected(1));
    }

    proptest::proptest! {
        #[test]
        fn markers_are_found_where_a_search_marker_by_marker_finds_them(
            parts in proptest::collection::vec(proptest::sample::select(vec![
                "wait", "WAIT", "Actually", "hmm", "hmmm", "hold on", "hold", " on second thought",
                "double-check", "Double Check", "let me reconsider", "I was wrong", "x", "é", "7",
                " ", ".", "-", "await", "on", "second", "\n",
            ]), 0..12)
        ) {
            let text = parts.concat();
            proptest::prop_assert_eq!(marker_at(&text), marker_at_each(&text), "{:?}", text);
        }
    }

    #[test]
    fn a_marker_inside_a_word_does_not_hide_one_it_overlaps() {
        assert_eq!(marker_at("xhold on second thought"), Some(6));
        assert_eq!(marker_at("Await, Hmm."), Some(7));
        assert_eq!(marker_at("awaiting"), None);
    }

    fn msgs(list: &[&str]) -> Vec<Message> {
        list.iter()
            .map(|s| Message::from_bytes(Bytes::copy_from_slice(s.as_bytes())))
            .collect()
    }

    #[test]
    fn pairs_repeated_ids_by_position() {
        let m = msgs(&[
            r#"{"role":"system","content":"s"}"#,
            r#"{"role":"user","content":"task"}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"x","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"x","content":"one"}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"x","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"x","content":"two"}"#,
        ]);
        let a = Analysis::of(&m);
        assert_eq!(a.owner[3], Some(2));
        assert_eq!(a.owner[5], Some(4));
        assert_eq!(a.units, vec![vec![0], vec![1], vec![2, 3], vec![4, 5]]);
        assert!(a.consumed[3] && !a.consumed[5]);
        assert!(a.protected(0) && a.protected(1) && a.protected(5) && !a.protected(3));
        assert_eq!(a.base, 1);
        assert!(a.pinned[1]);
    }

    #[test]
    fn a_result_pairs_with_the_latest_call_of_its_id_before_it() {
        let m = msgs(&[
            r#"{"role":"user","content":"task"}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"x","type":"function","function":{"name":"f","arguments":"{}"}},{"id":"y","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"y","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
            r#"{"role":"tool","tool_call_id":"x","content":"one"}"#,
            r#"{"role":"tool","tool_call_id":"y","content":"two"}"#,
            r#"{"role":"tool","tool_call_id":"z","content":"nobody's"}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"z","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
            r#"{"role":"assistant","content":"done"}"#,
        ]);
        let a = Analysis::of(&m);
        assert_eq!(a.owner[3], Some(1));
        assert_eq!(a.owner[4], Some(2));
        // A call made after a result does not own it.
        assert_eq!(a.owner[5], None);
        // Answered by the first assistant message after them.
        assert!(a.consumed[3] && a.consumed[4] && a.consumed[5]);
        assert_eq!(
            a.units,
            vec![vec![0], vec![1, 3], vec![2, 4], vec![5], vec![6], vec![7]]
        );
    }

    #[test]
    fn an_action_ends_an_agent_turn_not_an_answer() {
        let start = |text: &str| {
            let m = msgs(&[&serde_json::json!({"role": "assistant", "content": text}).to_string()]);
            action_start(&m[0])
        };
        assert_eq!(start("THOUGHT: look.\n\n```bash\nls\n```\n"), Some(16));
        assert_eq!(
            start(
                "Listing it.\n<function=execute_bash>\n<parameter=command>ls</parameter>\n</function>"
            ),
            Some(12)
        );
        assert_eq!(start("Code:\n```py\nprint(1)\n```<end_code>"), Some(6));
        assert_eq!(start("<execute_bash>ls</execute_bash>"), Some(0));
        assert_eq!(
            start("Here is the fix:\n```py\nx = 1\n```\nIt sets x."),
            None
        );
        assert_eq!(start("The answer is 3 > 2"), None);
        assert_eq!(start("a < b and c <= d>"), None);
        let call = msgs(&[
            r#"{"role":"assistant","content":"```bash\nls\n```","tool_calls":[{"id":"x","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
        ]);
        assert_eq!(action_start(&call[0]), None);
    }

    #[test]
    fn an_output_after_an_action_pairs_with_it() {
        let m = msgs(&[
            r#"{"role":"user","content":"task"}"#,
            r#"{"role":"assistant","content":"```bash\nls\n```"}"#,
            r#"{"role":"user","content":"a.py"}"#,
            r#"{"role":"assistant","content":"Done. Anything else?"}"#,
            r#"{"role":"user","content":"thanks"}"#,
            r#"{"role":"assistant","content":"```bash\npytest\n```"}"#,
            r#"{"role":"user","content":"1 passed"}"#,
        ]);
        let a = Analysis::of(&m);
        assert_eq!(
            a.observation,
            vec![false, false, true, false, false, false, true]
        );
        assert_eq!(a.owner[2], Some(1));
        assert!(a.consumed[2] && !a.consumed[6]);
        assert!(a.units.contains(&vec![1, 2]) && a.units.contains(&vec![4]));
        assert!(!a.protected(2) && a.protected(6));
    }

    #[test]
    fn markers_are_words() {
        let m = msgs(&[
            r#"{"role":"assistant","content":"Wait, the test expects None."}"#,
            r#"{"role":"assistant","content":"I will await the result while waiting."}"#,
            r#"{"role":"assistant","content":"Hmm. On second thought, no."}"#,
        ]);
        let a = Analysis::of(&m);
        assert_eq!(a.marker, vec![true, false, true]);
    }
}
