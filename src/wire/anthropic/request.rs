//! Anthropic Messages (`/v1/messages`): the body parsed without loss, its
//! conversation shown to the pipeline as a chat-shaped message list, and the
//! pipeline's decisions written back into the body's own blocks.
//!
//! The view: the top-level `system` becomes a system message (counted and
//! protected, never written back); a user message becomes one `tool`
//! message per `tool_result` block, then one user message with its other
//! blocks; an assistant message becomes one assistant message whose text is
//! its text blocks and whose `tool_calls` are its `tool_use` blocks (the
//! input as the arguments string). `thinking` and `redacted_thinking`
//! blocks, and any block condense does not know, are not shown to the
//! stages: they travel with their message, byte for byte, and go only when
//! the whole message goes.
//!
//! Writing back rewrites only the blocks whose view message changed: a
//! masked `tool_result` gets the new text as its `content` (its
//! `tool_use_id`, `is_error` and `cache_control` kept), a shortened
//! `tool_use` gets the shortened arguments as its `input` (still a JSON
//! object), rewritten text replaces the text blocks (a `cache_control` on
//! them moves to the replacement). Dropped messages take their blocks with
//! them; the digest or checkpoint becomes a user text block where the
//! first dropped message stood (or before the one `Fates::replacement_at`
//! names; see `request/write.rs` for where it ends up). Messages of the
//! same role that end up next to each other are merged (`tool_result`
//! blocks first), so roles still alternate. The result is checked against
//! the API's rules before it goes out; a result that breaks one is an
//! error, and the caller forwards the client's request unchanged.

use std::collections::HashSet;

use bytes::Bytes;
use serde_json::{Value, json};

use crate::chat::object::{member_value, write_json_string};
use crate::chat::{ChatRequest, Message, RawObject};
use crate::compaction::Fates;

mod write;

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("body is not a JSON object with a \"messages\" array: {0}")]
    Invalid(#[from] serde_json::Error),
    #[error("body has no \"messages\" array")]
    NoMessages,
    #[error("message {0} is not a user or assistant message with text or blocks")]
    Message(usize),
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("the compacted conversation breaks the Messages API's rules: {0}")]
    Invalid(&'static str),
    #[error("the pipeline's decisions do not match the conversation")]
    Mismatch,
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    User,
    Assistant,
    /// A system message inside `messages` (Claude Code sends one with its
    /// environment): shown to the stages as one, kept or dropped whole, and
    /// left out of the role rules.
    System,
}

/// A Messages request: the top-level fields as the client's bytes, and
/// each message with its blocks.
#[derive(Debug, Clone)]
pub struct MessagesRequest {
    source: Bytes,
    fields: RawObject,
    turns: Vec<Turn>,
}

#[derive(Debug, Clone)]
struct Turn {
    raw: Bytes,
    side: Side,
    /// The message object (its `content` entry stays in place).
    fields: RawObject,
    content: Content,
}

#[derive(Debug, Clone)]
enum Content {
    /// A string: its JSON bytes, decoded when it is read (a message of
    /// megabytes is not held twice).
    Text(Bytes),
    Blocks(Vec<Block>),
}

/// The text of `Content::Text`'s bytes.
fn decoded(raw: &[u8]) -> String {
    serde_json::from_slice(raw).unwrap_or_default()
}

/// A content block: its bytes and its type. Its other fields are read from
/// the bytes when asked for: a turn of 80,000 blocks held parsed was a
/// hundred megabytes of maps.
#[derive(Debug, Clone)]
struct Block {
    raw: Bytes,
    kind: Box<str>,
}

impl Block {
    fn parse(raw: Bytes) -> Option<Block> {
        let kind = member_value::<String>(&raw, "type")?.into_boxed_str();
        Some(Block { raw, kind })
    }

    /// A block condense writes itself.
    fn new(value: Value) -> Block {
        let kind = value.get("type").and_then(Value::as_str).unwrap_or("");
        Block {
            kind: kind.into(),
            raw: Bytes::from(value.to_string()),
        }
    }

    fn kind(&self) -> &str {
        &self.kind
    }

    /// Field `key`, when it is a string.
    fn str(&self, key: &str) -> Option<String> {
        member_value(&self.raw, key)
    }

    /// Field `key`, parsed.
    fn get(&self, key: &str) -> Option<Value> {
        member_value(&self.raw, key)
    }

    /// The whole block, parsed.
    fn value(&self) -> Value {
        serde_json::from_slice(&self.raw).unwrap_or_default()
    }

    fn cache_control(&self) -> Option<Value> {
        self.get("cache_control")
    }

    /// The block with `key` set to `value`; its other fields keep their
    /// bytes and the client's order.
    fn with(&self, key: &str, value: Value) -> Block {
        let value = Bytes::from(value.to_string());
        match crate::compaction::text::with_raw_field(&self.raw, key, value) {
            Some(raw) => Block {
                raw,
                kind: self.kind.clone(),
            },
            None => self.clone(),
        }
    }
}

/// What a block is to the pipeline.
fn is_text(b: &Block) -> bool {
    b.kind() == "text"
}

/// Where a view message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    System,
    /// A user message whose content is a string.
    User(usize),
    /// A block of a user message, not a tool result: message, block.
    UserBlock(usize, usize),
    /// A `tool_result` block: message, block.
    ToolResult(usize, usize),
    Assistant(usize),
    /// A system message inside `messages`.
    Inner(usize),
}

impl Origin {
    /// The index in `messages` of the message it came from; None for the
    /// top-level system prompt.
    fn message(self) -> Option<usize> {
        match self {
            Origin::System => None,
            Origin::User(t)
            | Origin::UserBlock(t, _)
            | Origin::ToolResult(t, _)
            | Origin::Assistant(t)
            | Origin::Inner(t) => Some(t),
        }
    }
}

/// Where each message of the pipeline's view came from, for writing its
/// decisions back.
#[derive(Debug, Clone)]
pub struct Origins(Vec<Origin>);

impl MessagesRequest {
    /// Parses a request body. A body that is not a Messages request condense
    /// understands is the caller's to forward unchanged.
    pub fn parse(body: &Bytes) -> Result<MessagesRequest, ParseError> {
        let (fields, list) = RawObject::parse_splitting(body, Some("messages"))?;
        let list = list.ok_or(ParseError::NoMessages)?;
        let turns = list
            .into_iter()
            .enumerate()
            .map(|(i, raw)| Turn::parse(raw).ok_or(ParseError::Message(i)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MessagesRequest {
            source: body.clone(),
            fields,
            turns,
        })
    }

    /// The requested model, when it is a string.
    pub fn model(&self) -> Option<String> {
        serde_json::from_slice::<String>(self.fields.get("model")?).ok()
    }

    pub fn is_stream(&self) -> bool {
        self.fields.get("stream") == Some(b"true")
    }

    /// Indices of the assistant messages.
    pub fn assistant_turns(&self) -> Vec<usize> {
        (0..self.turns.len())
            .filter(|&t| self.turns[t].side == Side::Assistant)
            .collect()
    }

    pub fn len(&self) -> usize {
        self.turns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    /// The request with its first `end` messages only (and `model`, when
    /// given): a turn of the conversation as the client sent it then.
    pub fn prefix(&self, end: usize, model: Option<&str>) -> Bytes {
        let list = crate::wire::view::raw_list(self.turns.iter().take(end).map(|t| &t.raw));
        let mut fields = self.fields.clone();
        fields.set("messages", list);
        if let Some(m) = model {
            fields.set("model", Bytes::from(json!(m).to_string()));
        }
        Bytes::from(fields.to_vec())
    }

    /// The client's bytes.
    pub fn source(&self) -> &Bytes {
        &self.source
    }

    /// The text of `system` (a string or text blocks).
    fn system_text(&self) -> Option<String> {
        let v: Value = serde_json::from_slice(self.fields.get("system")?).ok()?;
        match v {
            Value::String(s) => Some(s),
            Value::Array(blocks) => Some(
                blocks
                    .iter()
                    .filter_map(|b| b.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            _ => None,
        }
    }

    /// The conversation as chat messages, with `model`, `max_tokens` and
    /// `tools` (which count toward the prompt) beside them.
    pub fn view(&self) -> (ChatRequest, Origins) {
        // One view message per turn, but one per block of a user turn
        // with blocks, and the system prompt.
        let size = 1 + self
            .turns
            .iter()
            .map(|t| match (&t.side, &t.content) {
                (Side::User, Content::Blocks(b)) => b.len(),
                _ => 1,
            })
            .sum::<usize>();
        let mut messages = Vec::with_capacity(size);
        let mut origins = Vec::with_capacity(size);
        let mut push = |v: Bytes, o: Origin| {
            messages.push(Message::from_bytes(v));
            origins.push(o);
        };
        let bytes = |v: Value| crate::wire::view::view_bytes(&v);
        if let Some(text) = self.system_text() {
            push(
                bytes(json!({"role": "system", "content": text})),
                Origin::System,
            );
        }
        for (t, turn) in self.turns.iter().enumerate() {
            match (&turn.side, &turn.content) {
                (Side::User, Content::Text(s)) => {
                    push(
                        crate::wire::view::chat_text("user", &decoded(s)),
                        Origin::User(t),
                    );
                }
                // One view message per block, in order: a tool result, or
                // what the client wrote (a text as chat's user message).
                (Side::User, Content::Blocks(blocks)) => {
                    for (b, block) in blocks.iter().enumerate() {
                        if block.kind() == "tool_result" {
                            let id = block.str("tool_use_id").unwrap_or_default();
                            push(
                                bytes(
                                    json!({"role": "tool", "tool_call_id": id, "content": result_text(block)}),
                                ),
                                Origin::ToolResult(t, b),
                            );
                        } else {
                            push(bytes(user_view(block)), Origin::UserBlock(t, b));
                        }
                    }
                }
                (Side::Assistant, content) => {
                    push(assistant_view(content), Origin::Assistant(t));
                }
                (Side::System, content) => {
                    let text = match content {
                        Content::Text(s) => decoded(s),
                        Content::Blocks(b) => joined_text(b),
                    };
                    push(
                        bytes(json!({"role": "system", "content": text})),
                        Origin::Inner(t),
                    );
                }
            }
        }
        let mut fields = RawObject::default();
        for key in ["model", "max_tokens", "tools", "tool_choice"] {
            if let Some(v) = self.fields.get(key) {
                fields.set(key, Bytes::copy_from_slice(v));
            }
        }
        (ChatRequest::assembled(fields, messages), Origins(origins))
    }

    /// Whether the conversation keeps the API's rules (roles alternate from
    /// a user message, each `tool_use` answered by the next message, each
    /// `tool_result` answering the message before). condense compacts only
    /// such a conversation; another goes upstream as it came.
    pub fn well_formed(&self) -> bool {
        let turns: Vec<(Side, Vec<&Block>)> = self
            .turns
            .iter()
            .map(|t| {
                let blocks = match &t.content {
                    Content::Blocks(b) => b.iter().collect(),
                    Content::Text(_) => Vec::new(),
                };
                (t.side, blocks)
            })
            .collect();
        check(&turns).is_ok()
    }
}

/// `part` as a slice of `whole` when it lies inside it, else a copy.
fn part_of(whole: &Bytes, part: &[u8]) -> Bytes {
    let start = (part.as_ptr() as usize).wrapping_sub(whole.as_ptr() as usize);
    if start <= whole.len() && part.len() <= whole.len() - start {
        whole.slice(start..start + part.len())
    } else {
        Bytes::copy_from_slice(part)
    }
}

impl Turn {
    fn parse(raw: Bytes) -> Option<Turn> {
        let (fields, blocks) = match RawObject::parse_splitting(&raw, Some("content")) {
            Ok((fields, Some(list))) => (fields, Some(list)),
            Ok((_, None)) => return None,
            // `content` is not an array: a string, or not a message at all.
            Err(_) => (RawObject::parse(&raw).ok()?, None),
        };
        let side = match fields.get("role")? {
            b"\"user\"" => Side::User,
            b"\"assistant\"" => Side::Assistant,
            b"\"system\"" => Side::System,
            _ => return None,
        };
        let content = match blocks {
            Some(list) => {
                let mut blocks = Vec::with_capacity(list.len());
                for raw in list {
                    blocks.push(Block::parse(raw)?);
                }
                Content::Blocks(blocks)
            }
            // A string (the body was valid JSON: a value that starts with
            // a quote is one).
            None => {
                let text = fields.get("content").filter(|c| c.first() == Some(&b'"'))?;
                Content::Text(part_of(&raw, text))
            }
        };
        Some(Turn {
            raw,
            side,
            fields,
            content,
        })
    }
}

/// The text of a tool result's `content` (a string, or blocks).
fn result_text(block: &Block) -> String {
    match block.get("content") {
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match p.get("type").and_then(Value::as_str) {
                Some("text") => p
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                Some(kind) => format!("[{kind}]"),
                None => String::new(),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A user block that is not a tool result as a chat user message: a text
/// as its content, an image as an image part, another block as its JSON.
fn user_view(block: &Block) -> Value {
    match block.kind() {
        "text" => json!({"role": "user", "content": block.str("text").unwrap_or_default()}),
        "image" => {
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]})
        }
        _ => json!({"role": "user", "content": block.value().to_string()}),
    }
}

/// The chat view of an assistant message, as JSON bytes: its text, its
/// `tool_use` blocks as `tool_calls`, its thinking. Written call by call
/// (80,000 calls built as one value were a hundred megabytes), in the
/// bytes `serde_json` gives the same message built as a value: keys in
/// order, no spaces.
fn assistant_view(content: &Content) -> Bytes {
    let blocks = match content {
        Content::Text(s) => return crate::wire::view::chat_text("assistant", &decoded(s)),
        Content::Blocks(b) => b,
    };
    let text = joined_text(blocks);
    // Thinking is counted (it may count toward the window) but no stage
    // sees it as text it may change.
    let thinking: String = blocks
        .iter()
        .filter_map(|b| b.str("thinking"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::with_capacity(text.len() + thinking.len() + 64);
    out.extend_from_slice(b"{\"content\":");
    match text.is_empty() {
        true => out.extend_from_slice(b"null"),
        false => write_json_string(&mut out, &text),
    }
    out.extend_from_slice(b",\"role\":\"assistant\"");
    if !thinking.is_empty() {
        out.extend_from_slice(b",\"thinking\":");
        write_json_string(&mut out, &thinking);
    }
    crate::wire::view::write_tool_calls(
        &mut out,
        blocks.iter().filter(|b| b.kind() == "tool_use").map(|b| {
            (
                b.str("id").unwrap_or_default(),
                b.str("name").unwrap_or_default(),
                b.get("input").map(|i| i.to_string()).unwrap_or_default(),
            )
        }),
    );
    out.push(b'}');
    crate::wire::view::exact(out)
}

fn joined_text(blocks: &[Block]) -> String {
    blocks
        .iter()
        .filter(|b| is_text(b))
        .filter_map(|b| b.str("text"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Checks the API's structural rules on a conversation: it starts with a
/// user message, roles alternate, and tool uses and results pair up between
/// neighbours.
fn check(turns: &[(Side, Vec<&Block>)]) -> Result<(), WriteError> {
    let turns: Vec<&(Side, Vec<&Block>)> = turns.iter().filter(|t| t.0 != Side::System).collect();
    if turns.first().is_some_and(|(s, _)| *s != Side::User) {
        return Err(WriteError::Invalid(
            "the first message is not a user message",
        ));
    }
    for w in turns.windows(2) {
        if w[0].0 == w[1].0 {
            return Err(WriteError::Invalid(
                "two messages of the same role in a row",
            ));
        }
    }
    let ids = |blocks: &[&Block], kind: &str, key: &str| -> Vec<String> {
        blocks
            .iter()
            .filter(|b| b.kind() == kind)
            .filter_map(|b| b.str(key))
            .collect()
    };
    // Sets of ids: a turn of many calls is checked in linear time.
    let set = |blocks: &[&Block], kind: &str, key: &str| -> HashSet<String> {
        ids(blocks, kind, key).into_iter().collect()
    };
    for (i, (side, blocks)) in turns.iter().map(|t| (&t.0, &t.1)).enumerate() {
        match side {
            Side::Assistant => {
                if let Some((_, next)) = turns.get(i + 1) {
                    let answered = set(next, "tool_result", "tool_use_id");
                    let uses = ids(blocks, "tool_use", "id");
                    if uses.iter().any(|u| !answered.contains(u)) {
                        return Err(WriteError::Invalid("a tool_use is not answered"));
                    }
                }
            }
            Side::User => {
                let results = ids(blocks, "tool_result", "tool_use_id");
                if results.is_empty() {
                    continue;
                }
                let asked = match i.checked_sub(1).map(|p| turns[p]) {
                    Some((Side::Assistant, prev)) => set(prev, "tool_use", "id"),
                    _ => HashSet::new(),
                };
                if results.iter().any(|r| !asked.contains(r)) {
                    return Err(WriteError::Invalid("a tool_result answers no tool_use"));
                }
            }
            Side::System => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
