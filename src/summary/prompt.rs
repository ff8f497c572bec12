//! What condense asks the summarizer, how it shows it the conversation, how
//! it judges the answer, and the checkpoint message built from it.

use serde_json::{Value, json};

use crate::chat::Message;
use crate::compaction::conversation::marker_sentence;
use crate::compaction::text::{MARK, content_text, cut_middle};

/// The checkpoint's sections, in order: (heading, what goes under it).
pub const SECTIONS: &[(&str, &str)] = &[
    (
        "Task intent",
        "What the user asked for, with every constraint they set. Quote the request word for word when it is shorter than about 150 words.",
    ),
    (
        "Files and artifacts",
        "Every file, directory, URL, branch, record or other artifact that was created, read, changed or deleted, and what happened to it.",
    ),
    (
        "Decisions",
        "What was decided and why, approaches tried and given up (and why), and every place where the agent corrected an earlier belief: what it thought first and what replaced it.",
    ),
    (
        "Errors and blockers",
        "Errors met, with the exact message, their cause if it was found, and whether they were resolved.",
    ),
    (
        "Current state",
        "What is done and verified, and what was in progress when these messages end.",
    ),
    (
        "Next steps",
        "What was still to be done when these messages end, in order.",
    ),
    (
        "Critical identifiers",
        "Exact values the agent may need again, copied character for character: paths, function, class and test names, ids, commands, error strings, numbers, versions, URLs.",
    ),
];

fn format_rules(max_words: u64) -> String {
    let mut out = String::from(
        "Write the checkpoint in Markdown with exactly these sections, in this order, each under its own `## ` heading:\n\n",
    );
    for (heading, what) in SECTIONS {
        out.push_str(&format!("## {heading}\n{what}\n\n"));
    }
    out.push_str(&format!(
        "Rules: record facts, not impressions; never invent anything that the messages do not say; write \"none\" under a section with nothing to record; no preamble, no closing remarks; at most {max_words} words in all.\n"
    ));
    out
}

/// The request for a first checkpoint of `transcript`.
pub fn first(transcript: &str, markers: bool, max_words: u64) -> String {
    let mut out = String::from(
        "I am handing a long conversation between a user and an AI agent over to a fresh context. The messages below will be removed, and the checkpoint you write is all the agent will have of them, so it must let the agent carry on the work without asking again for anything they contained.\n\n",
    );
    out.push_str(&format_rules(max_words));
    if markers {
        out.push_str(MARKER_RULE);
    }
    out.push_str("\nThe messages:\n\n<conversation>\n");
    out.push_str(transcript);
    out.push_str("</conversation>\n");
    out
}

/// The request to extend checkpoint `previous` with the messages in
/// `transcript`, which came after the ones it covers.
pub fn update(previous: &str, transcript: &str, markers: bool, max_words: u64) -> String {
    let mut out = String::from(
        "Earlier you wrote the checkpoint below for the start of a long conversation between a user and an AI agent. More messages have since been removed from the agent's context; they follow the checkpoint. Write one updated checkpoint that covers both: keep every fact of the old checkpoint that still matters, add what the new messages did, and change what they changed (a finished step moves from next steps to current state, a fixed error says so). The agent will have nothing but your checkpoint of all these messages.\n\n",
    );
    out.push_str(&format_rules(max_words));
    if markers {
        out.push_str(MARKER_RULE);
    }
    out.push_str("\n<checkpoint>\n");
    out.push_str(previous.trim());
    out.push_str("\n</checkpoint>\n\nThe messages that came after it:\n\n<conversation>\n");
    out.push_str(transcript);
    out.push_str("</conversation>\n");
    out
}

const MARKER_RULE: &str = "In these messages the agent or the user revised what they had said (\"actually\", \"wait\", \"I was wrong\", ...). Under Decisions, name each revision: what was believed before and what replaced it.\n";

/// Characters of a role or tool name the summarizer reads at most.
const NAME_CHARS: usize = 200;

/// One message as the summarizer reads it, bounded whatever it holds: its
/// text in about `max_chars` (head and tail, a notice of condense's own
/// included), its tool calls in about as much again (each call's
/// arguments in half of it; a turn of more calls than fit says how many it
/// leaves out), names in 200 characters.
pub fn render(index: usize, m: &Message, max_chars: usize) -> String {
    let role = cut_middle(m.role().unwrap_or("unknown"), NAME_CHARS);
    let mut out = match (role.as_str(), m.name()) {
        ("tool" | "function", Some(name)) => {
            format!("[{index}] tool result ({}):", cut_middle(name, NAME_CHARS))
        }
        ("tool" | "function", None) => format!("[{index}] tool result:"),
        (r, _) => format!("[{index}] {r}:"),
    };
    let text = match m.content() {
        Some(Value::Null) | None => String::new(),
        Some(c) => content_text(Some(c))
            .map(std::borrow::Cow::into_owned)
            .unwrap_or_else(|| "[non-text content]".to_string()),
    };
    if !text.is_empty() {
        out.push(' ');
        out.push_str(&cut_middle(&text, max_chars));
    }
    let limit = out.len() + max_chars;
    let mut left_out = 0usize;
    for call in m.tool_calls() {
        if out.len() >= limit {
            left_out += 1;
            continue;
        }
        let name = call
            .pointer("/function/name")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let args = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        out.push_str(&format!(
            "\n  -> calls {}({})",
            cut_middle(name, NAME_CHARS),
            cut_middle(args, max_chars / 2)
        ));
    }
    if left_out > 0 {
        out.push_str(&format!("\n  -> and {left_out} more calls"));
    }
    out.push('\n');
    out
}

/// Why a summarizer answer is not a usable checkpoint.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Unusable {
    #[error("the answer is empty")]
    Empty,
    #[error("the answer was cut off at the token limit")]
    Truncated,
    #[error("the answer lacks the section {0:?}")]
    MissingSection(&'static str),
}

/// Checks a summarizer answer; returns the checkpoint text.
pub fn validate(content: &str, finish_reason: Option<&str>) -> Result<String, Unusable> {
    let text = content.trim();
    if text.is_empty() {
        return Err(Unusable::Empty);
    }
    if finish_reason == Some("length") {
        return Err(Unusable::Truncated);
    }
    let lower = text.to_lowercase();
    for (heading, _) in SECTIONS {
        let found = lower.lines().any(|l| {
            let l = l.trim_start_matches(['#', '*', ' ', '\t', '-', '_']);
            l.starts_with(&heading.to_lowercase())
        });
        if !found {
            return Err(Unusable::MissingSection(heading));
        }
    }
    Ok(text.to_string())
}

/// What every checkpoint says of the messages it replaced (the replay
/// tells a request's stand-in for dropped turns by it).
pub const REPLACED: &str = "messages that stood here were replaced by this summary";

/// The checkpoint message that takes the place of `replaced` messages:
/// the summary, and the revisions (epistemic markers) of the span verbatim.
pub fn checkpoint_message(summary: &str, replaced: usize, revisions: &[String]) -> Vec<u8> {
    let mut text = format!(
        "{MARK} checkpoint. The {replaced} {REPLACED} of them to fit the context window; the conversation continues after it.]\n\n{}",
        summary.trim()
    );
    if !revisions.is_empty() {
        text.push_str("\n\nRevisions made in those messages, verbatim:\n");
        for r in revisions {
            text.push_str(&format!("- \"{r}\"\n"));
        }
    }
    json!({"role": "user", "content": text})
        .to_string()
        .into_bytes()
}

/// The sentences in which messages revise themselves (at most `max`).
pub fn revisions<'a>(messages: impl Iterator<Item = &'a Message>, max: usize) -> Vec<String> {
    messages
        .filter(|m| matches!(m.role(), Some("assistant" | "user")))
        .filter_map(|m| marker_sentence(m, 240))
        .take(max)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn msg(v: Value) -> Message {
        Message::from_bytes(Bytes::from(v.to_string()))
    }

    fn good() -> String {
        SECTIONS
            .iter()
            .map(|(h, _)| format!("## {h}\nsomething\n"))
            .collect()
    }

    #[test]
    fn an_answer_needs_every_section_and_a_natural_end() {
        assert_eq!(
            validate(&good(), Some("stop")),
            Ok(good().trim().to_string())
        );
        assert_eq!(validate("  ", Some("stop")), Err(Unusable::Empty));
        assert_eq!(validate(&good(), Some("length")), Err(Unusable::Truncated));
        let missing = good().replace("## Next steps", "## Later");
        assert_eq!(
            validate(&missing, None),
            Err(Unusable::MissingSection("Next steps"))
        );
        // Bold headings are headings too.
        let bold = good().replace("## ", "**").replace('\n', "**\n");
        assert!(validate(&bold, None).is_ok());
    }

    #[test]
    fn messages_render_with_role_calls_and_bounded_text() {
        let a = msg(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\":\"ls\"}"}}]}));
        assert_eq!(
            render(3, &a, 100),
            "[3] assistant:\n  -> calls run({\"cmd\":\"ls\"})\n"
        );
        let t = msg(json!({"role": "tool", "tool_call_id": "c1", "content": "x".repeat(5000)}));
        let r = render(4, &t, 400);
        assert!(
            r.starts_with("[4] tool result: xxx") && r.len() < 600,
            "{}",
            r.len()
        );
    }

    #[test]
    fn the_checkpoint_names_the_revisions_of_its_span() {
        let ms = [
            msg(
                json!({"role": "assistant", "content": "The bug is in read(). Actually, it is in parse_header."}),
            ),
            msg(json!({"role": "tool", "content": "wait for it"})),
            msg(json!({"role": "assistant", "content": "Done."})),
        ];
        let r = revisions(ms.iter(), 5);
        assert_eq!(r, vec!["Actually, it is in parse_header.".to_string()]);
        let m: Value =
            serde_json::from_slice(&checkpoint_message("## Task intent\nfix", 7, &r)).unwrap();
        let text = m["content"].as_str().unwrap();
        assert_eq!(m["role"], "user");
        assert!(text.starts_with(MARK) && text.contains("The 7 messages"));
        assert!(text.contains("\"Actually, it is in parse_header.\""));
    }
}
