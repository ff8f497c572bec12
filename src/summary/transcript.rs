//! What the summarizer reads of a span, bounded whatever the span holds.
//!
//! Each message is rendered in at most about two thirds of what one
//! summarizer call reads (`prompt::render`: its text in a quarter, its
//! calls in as much again), and one checkpoint reads at most what
//! [`MAX_CALLS`] calls do: a span larger than that (a turn of 80,000 tool
//! calls, a conversation first seen at ten times its window) keeps its
//! newest messages (three quarters of that) and its oldest, and says how
//! many messages between them it leaves out. Without the bound, one
//! checkpoint of 160,000 small messages took hundreds of summarizer calls,
//! one after the other while the client waited, and held every rendered
//! message at once. With recall on (the default), what is left out stays
//! recallable: the checkpoint carries the recall key of the whole span.

use crate::chat::Message;

use super::prompt;

/// Summarizer calls' worth of transcript one checkpoint reads at most (a
/// checkpoint longer than planned beside each chunk may take a call or two
/// more).
pub const MAX_CALLS: usize = 8;

/// Share of the transcript's limit the newest messages may take.
const NEWEST_SHARE: f64 = 0.75;

/// One piece of the transcript, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// `messages[k]`, rendered.
    Message(usize),
    /// A line in place of the messages left out.
    Omitted(String),
}

impl Piece {
    /// Its text as the summarizer reads it.
    pub fn text(&self, messages: &[(usize, Message)], per_message: usize) -> String {
        match self {
            Piece::Message(k) => {
                let (i, m) = &messages[*k];
                prompt::render(*i, m, per_message)
            }
            Piece::Omitted(line) => line.clone(),
        }
    }
}

/// The pieces the summarizer reads of `messages` (positions and messages
/// of the span), each rendered within `per_message` characters, in about
/// `limit` characters in all. Linear in the span; holds one rendered
/// message at a time.
pub fn pieces(messages: &[(usize, Message)], per_message: usize, limit: usize) -> Vec<Piece> {
    let lens: Vec<usize> = messages
        .iter()
        .map(|(i, m)| prompt::render(*i, m, per_message).len())
        .collect();
    let n = lens.len();
    if lens.iter().sum::<usize>() <= limit {
        return (0..n).map(Piece::Message).collect();
    }
    // The newest messages first: they say where the work stands.
    let newest = (limit as f64 * NEWEST_SHARE) as usize;
    let mut taken = 0;
    let mut tail = n;
    while tail > 0 && taken + lens[tail - 1] <= newest {
        taken += lens[tail - 1];
        tail -= 1;
    }
    let mut head = 0;
    while head < tail && taken + lens[head] <= limit {
        taken += lens[head];
        head += 1;
    }
    let mut out: Vec<Piece> = (0..head).map(Piece::Message).collect();
    if head < tail {
        out.push(Piece::Omitted(omitted(&messages[head..tail])));
    }
    out.extend((tail..n).map(Piece::Message));
    out
}

/// The line that stands for `left_out`: which messages, and what they
/// were.
fn omitted(left_out: &[(usize, Message)]) -> String {
    let (mut user, mut agent, mut calls, mut results) = (0, 0, 0, 0);
    for (_, m) in left_out {
        match m.role() {
            Some("user") => user += 1,
            Some("assistant") => {
                agent += 1;
                calls += m.tool_calls().count();
            }
            Some("tool" | "function") => results += 1,
            _ => {}
        }
    }
    let first = left_out.first().map_or(0, |(i, _)| *i);
    let last = left_out.last().map_or(0, |(i, _)| *i);
    format!(
        "[{first}-{last}] {} messages left out, too many to read for this checkpoint: {user} from the user, {agent} from the agent with {calls} tool calls, {results} tool results.\n",
        left_out.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use serde_json::json;

    fn span(n: usize) -> Vec<(usize, Message)> {
        (0..n)
            .map(|i| {
                let v = match i % 2 {
                    0 => json!({"role": "assistant", "content": null, "tool_calls": [
                        {"id": format!("c{i}"), "type": "function",
                         "function": {"name": "run", "arguments": format!("{{\"n\":{i}}}")}}]}),
                    _ => json!({"role": "tool", "tool_call_id": format!("c{}", i - 1),
                                "content": format!("result {i}")}),
                };
                (i + 3, Message::from_bytes(Bytes::from(v.to_string())))
            })
            .collect()
    }

    fn read(ms: &[(usize, Message)], ps: &[Piece]) -> String {
        ps.iter().map(|p| p.text(ms, 400)).collect()
    }

    #[test]
    fn a_span_within_the_limit_is_read_whole() {
        let ms = span(40);
        let ps = pieces(&ms, 400, 100_000);
        assert_eq!(ps, (0..40).map(Piece::Message).collect::<Vec<_>>());
    }

    #[test]
    fn a_larger_span_keeps_its_newest_and_oldest_messages_and_counts_the_rest() {
        let ms = span(10_000);
        let ps = pieces(&ms, 400, 20_000);
        let text = read(&ms, &ps);
        assert!(text.len() <= 20_000 + 200, "{}", text.len());
        // The last message and the first are read; one line stands for the
        // messages between.
        assert!(text.starts_with("[3] assistant:"), "{}", &text[..80]);
        assert!(text.ends_with("[10002] tool result: result 9999\n"));
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("left out")).collect();
        assert_eq!(lines.len(), 1);
        let left_out = ps.iter().filter(|p| matches!(p, Piece::Omitted(_))).count();
        assert_eq!(left_out, 1);
        let read_count = ps.len() - 1;
        let line = lines[0];
        assert!(
            line.contains(&format!("{} messages left out", 10_000 - read_count)),
            "{line}"
        );
        // Three quarters of what is read are the newest messages.
        let tail = ps
            .iter()
            .rev()
            .take_while(|p| matches!(p, Piece::Message(_)))
            .count();
        assert!(tail > read_count / 2, "{tail} of {read_count}");
    }

    #[test]
    fn a_turn_of_many_calls_renders_within_its_bound() {
        let calls: Vec<_> = (0..5_000)
            .map(|i| {
                json!({"id": format!("c{i}"), "type": "function",
                            "function": {"name": "run", "arguments": "{\"cmd\":\"stat\"}"}})
            })
            .collect();
        let m = Message::from_bytes(Bytes::from(
            json!({"role": "assistant", "content": "Checking.", "tool_calls": calls}).to_string(),
        ));
        let r = prompt::render(7, &m, 2_000);
        assert!(r.len() < 2_200, "{}", r.len());
        assert!(r.starts_with("[7] assistant: Checking.\n  -> calls run("));
        let shown = r.matches("-> calls run(").count();
        // Long text, long arguments, a long name: the text in about 2,000
        // characters, the calls in about as much again.
        let big = json!({"id": "c", "type": "function", "function": {
            "name": "n".repeat(50_000), "arguments": "a".repeat(50_000)}});
        let long = Message::from_bytes(Bytes::from(
            json!({"role": "assistant", "content": "t".repeat(50_000),
                   "tool_calls": vec![big; 10]})
            .to_string(),
        ));
        let l = prompt::render(7, &long, 2_000);
        assert!(l.len() < 5_500, "{}", l.len());
        assert!(l.ends_with("more calls\n"), "{l}");
        assert!(
            r.ends_with(&format!("-> and {} more calls\n", 5_000 - shown)),
            "{}",
            &r[r.len() - 60..]
        );
    }
}
