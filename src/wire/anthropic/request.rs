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
//! them; the digest or checkpoint becomes a user text block. Messages of the
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

    /// The block with `key` set to `value`; its other fields kept.
    fn with(&self, key: &str, value: Value) -> Block {
        let mut v = self.value();
        if let Some(obj) = v.as_object_mut() {
            obj.insert(key.to_string(), value);
        }
        Block::new(v)
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
        let list = crate::wire::raw_list(self.turns.iter().take(end).map(|t| &t.raw));
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
        let bytes = |v: Value| crate::wire::view_bytes(&v);
        if let Some(text) = self.system_text() {
            push(
                bytes(json!({"role": "system", "content": text})),
                Origin::System,
            );
        }
        for (t, turn) in self.turns.iter().enumerate() {
            match (&turn.side, &turn.content) {
                (Side::User, Content::Text(s)) => {
                    push(crate::wire::chat_text("user", &decoded(s)), Origin::User(t));
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

    /// The request with the pipeline's decisions on `view` applied.
    pub fn write_back(&self, origins: &Origins, fates: &Fates) -> Result<Bytes, WriteError> {
        let origins = &origins.0;
        let n = origins.len();
        if fates.dropped.len() != n || fates.rewritten.len() != n {
            return Err(WriteError::Mismatch);
        }
        // Per message: the view messages that came from it.
        let mut parts: Vec<Vec<usize>> = vec![Vec::new(); self.turns.len()];
        for (j, o) in origins.iter().enumerate() {
            match *o {
                Origin::System => {
                    if fates.dropped[j] || fates.rewritten[j].is_some() {
                        return Err(WriteError::Invalid("the system prompt changed"));
                    }
                }
                Origin::User(t)
                | Origin::UserBlock(t, _)
                | Origin::ToolResult(t, _)
                | Origin::Assistant(t)
                | Origin::Inner(t) => parts[t].push(j),
            }
        }
        let digest_at = fates
            .replacement
            .as_ref()
            .and_then(|_| (0..n).find(|&j| fates.dropped[j]))
            .map(|j| match origins[j] {
                Origin::User(t)
                | Origin::UserBlock(t, _)
                | Origin::ToolResult(t, _)
                | Origin::Assistant(t)
                | Origin::Inner(t) => t,
                Origin::System => 0,
            });
        let mut out: Vec<Out> = Vec::with_capacity(self.turns.len() + 1);
        let mut digest_out = None;
        for (t, turn) in self.turns.iter().enumerate() {
            if digest_at == Some(t)
                && let Some(d) = &fates.replacement
            {
                let text = json!({"type": "text", "text": view_text(d)});
                digest_out = Some(out.len());
                out.push(Out::built(Side::User, vec![Block::new(text)]));
            }
            let js = &parts[t];
            if js
                .iter()
                .all(|&j| !fates.dropped[j] && fates.rewritten[j].is_none())
            {
                out.push(Out::Kept(t));
                continue;
            }
            if js.iter().all(|&j| fates.dropped[j]) {
                continue;
            }
            let blocks = self.rebuilt(turn, js, origins, fates)?;
            if !blocks.is_empty() {
                out.push(Out::built(turn.side, blocks));
            }
        }
        if let Some(d) = digest_out {
            self.place_digest(&mut out, d);
        }
        let merged = self.merged(out);
        let shape: Vec<(Side, Vec<&Block>)> = merged
            .iter()
            .map(|o| (o.side(self), o.blocks(self)))
            .collect();
        check(&shape)?;
        let cache_points = |blocks: &mut dyn Iterator<Item = &Block>| {
            blocks.filter(|b| b.cache_control().is_some()).count()
        };
        let before: usize = self
            .turns
            .iter()
            .map(|t| match &t.content {
                Content::Blocks(b) => cache_points(&mut b.iter()),
                Content::Text(_) => 0,
            })
            .sum();
        let after: usize = shape
            .iter()
            .map(|(_, b)| cache_points(&mut b.iter().copied()))
            .sum();
        if after > before.max(4) {
            return Err(WriteError::Invalid("more than 4 cache_control breakpoints"));
        }
        Ok(self.serialize(&merged))
    }

    /// A message's blocks after the fates of its view messages `js` (some
    /// of them dropped or rewritten).
    fn rebuilt(
        &self,
        turn: &Turn,
        js: &[usize],
        origins: &[Origin],
        fates: &Fates,
    ) -> Result<Vec<Block>, WriteError> {
        let new_view = |j: usize| -> Option<Value> {
            serde_json::from_slice(fates.rewritten[j].as_ref()?).ok()
        };
        match (&turn.side, &turn.content) {
            (Side::User, Content::Text(_)) => {
                let &j = js.first().ok_or(WriteError::Mismatch)?;
                let text = new_view(j)
                    .map(|v| crate::wire::text_of(&v))
                    .unwrap_or_default();
                Ok(vec![Block::new(json!({"type": "text", "text": text}))])
            }
            (Side::User, Content::Blocks(blocks)) => {
                let mut out = Vec::with_capacity(blocks.len());
                for &j in js {
                    let b = match origins[j] {
                        Origin::ToolResult(_, b) | Origin::UserBlock(_, b) => b,
                        _ => return Err(WriteError::Mismatch),
                    };
                    let block = blocks.get(b).ok_or(WriteError::Mismatch)?;
                    if fates.dropped[j] {
                        continue;
                    }
                    let Some(v) = new_view(j) else {
                        out.push(block.clone());
                        continue;
                    };
                    let text = crate::wire::text_of(&v);
                    if block.kind() == "tool_result" {
                        out.push(block.with("content", json!(text)));
                    } else if block.kind() == "text" {
                        out.push(block.with("text", json!(text)));
                    } else if !text.is_empty() {
                        // Another block (an image, a document) cut to text;
                        // its cache breakpoint stays on the replacement.
                        let mut v = json!({"type": "text", "text": text});
                        if let Some(cc) = block.cache_control() {
                            v["cache_control"] = cc;
                        }
                        out.push(Block::new(v));
                    }
                }
                Ok(out)
            }
            // Never rewritten (the stages keep system messages verbatim).
            (Side::System, _) => Err(WriteError::Invalid("a system message changed")),
            (Side::Assistant, content) => {
                let &j = js.first().ok_or(WriteError::Mismatch)?;
                let Some(v) = fates.rewritten[j].clone() else {
                    return Err(WriteError::Mismatch);
                };
                Ok(assistant_rebuilt(content, &Message::from_bytes(v)))
            }
        }
    }

    /// Moves the digest (at `d`) into the first user message after the
    /// dropped turns, behind its tool results, when that message is not the
    /// newest: the messages before the drop, the task among them, then keep
    /// their bytes (and the provider's cache of them) as they would in a
    /// chat request, where the digest is a message of its own. Otherwise it
    /// stays, and joins the user message before it.
    fn place_digest(&self, out: &mut Vec<Out>, d: usize) {
        let next_user = (d + 1..out.len()).find(|&i| out[i].side(self) == Side::User);
        if let Some(u) = next_user.filter(|&u| u + 1 < out.len()) {
            let digest = out.remove(d);
            // `u` moved down by one with the removal.
            out.insert(u, digest);
        }
    }

    /// Neighbouring messages of the same role joined into one. Each is
    /// joined in place and its blocks ordered once at the end (ordering
    /// after every join gave the same order, tool results first, in time
    /// quadratic in a run of joins).
    fn merged(&self, out: Vec<Out>) -> Vec<Out> {
        let mut merged: Vec<Out> = Vec::with_capacity(out.len());
        // The last message that is not a system message inside `messages`
        // (those stand outside the alternation: a message merges across
        // them), and the messages that took others in.
        let mut last: Option<usize> = None;
        let mut joined: Vec<usize> = Vec::new();
        for o in out {
            let side = o.side(self);
            match last {
                Some(l) if side != Side::System && merged[l].side(self) == side => {
                    let more = o.owned_blocks(self);
                    let into = &mut merged[l];
                    if let Out::Built { blocks, .. } = into {
                        blocks.extend(more);
                    } else {
                        let fields = into.fields(self);
                        let mut blocks = into.owned_blocks(self);
                        blocks.extend(more);
                        *into = Out::Built {
                            side,
                            fields,
                            blocks,
                        };
                    }
                    if joined.last() != Some(&l) {
                        joined.push(l);
                    }
                }
                _ => {
                    if side != Side::System {
                        last = Some(merged.len());
                    }
                    merged.push(o);
                }
            }
        }
        for l in joined {
            if let Out::Built {
                side: Side::User,
                blocks,
                ..
            } = &mut merged[l]
            {
                // Tool results come first in a user message.
                blocks.sort_by_key(|b| b.kind() != "tool_result");
            }
        }
        merged
    }

    fn serialize(&self, out: &[Out]) -> Bytes {
        // Sized by what is written (after compaction, usually far less
        // than the client's body).
        let size: usize = out
            .iter()
            .map(|o| match o {
                Out::Kept(t) => self.turns[*t].raw.len() + 1,
                Out::Built { blocks, .. } => {
                    blocks.iter().map(|b| b.raw.len() + 1).sum::<usize>() + 64
                }
            })
            .sum();
        let mut list = Vec::with_capacity(size + 2);
        list.push(b'[');
        for (i, o) in out.iter().enumerate() {
            if i > 0 {
                list.push(b',');
            }
            match o {
                Out::Kept(t) => list.extend_from_slice(&self.turns[*t].raw),
                Out::Built { fields, blocks, .. } => {
                    let mut f = fields.clone();
                    f.set(
                        "content",
                        crate::wire::raw_list(blocks.iter().map(|b| &b.raw)),
                    );
                    list.extend_from_slice(&f.to_vec());
                }
            }
        }
        list.push(b']');
        let mut fields = self.fields.clone();
        fields.set("messages", Bytes::from(list));
        Bytes::from(fields.to_vec())
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

/// A message of the written-back conversation.
enum Out {
    /// Message `t`, unchanged.
    Kept(usize),
    Built {
        side: Side,
        fields: RawObject,
        blocks: Vec<Block>,
    },
}

impl Out {
    fn built(side: Side, blocks: Vec<Block>) -> Out {
        let mut fields = RawObject::default();
        let role = match side {
            Side::User => "\"user\"",
            Side::Assistant => "\"assistant\"",
            Side::System => "\"system\"",
        };
        fields.set("role", Bytes::from_static(role.as_bytes()));
        fields.set("content", Bytes::from_static(b"[]"));
        Out::Built {
            side,
            fields,
            blocks,
        }
    }

    fn side(&self, r: &MessagesRequest) -> Side {
        match self {
            Out::Kept(t) => r.turns[*t].side,
            Out::Built { side, .. } => *side,
        }
    }

    fn fields(&self, r: &MessagesRequest) -> RawObject {
        match self {
            Out::Kept(t) => r.turns[*t].fields.clone(),
            Out::Built { fields, .. } => fields.clone(),
        }
    }

    /// The message's blocks, text content as a text block.
    fn owned_blocks(&self, r: &MessagesRequest) -> Vec<Block> {
        match self {
            Out::Kept(t) => match &r.turns[*t].content {
                Content::Blocks(b) => b.clone(),
                Content::Text(s) => {
                    vec![Block::new(json!({"type": "text", "text": decoded(s)}))]
                }
            },
            Out::Built { blocks, .. } => blocks.clone(),
        }
    }

    /// The message's blocks (none for text content).
    fn blocks<'a>(&'a self, r: &'a MessagesRequest) -> Vec<&'a Block> {
        match self {
            Out::Kept(t) => match &r.turns[*t].content {
                Content::Blocks(b) => b.iter().collect(),
                Content::Text(_) => Vec::new(),
            },
            Out::Built { blocks, .. } => blocks.iter().collect(),
        }
    }
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
        Content::Text(s) => return crate::wire::chat_text("assistant", &decoded(s)),
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
    crate::wire::write_tool_calls(
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
    crate::wire::exact(out)
}

fn joined_text(blocks: &[Block]) -> String {
    blocks
        .iter()
        .filter(|b| is_text(b))
        .filter_map(|b| b.str("text"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// An assistant message's blocks after a stage rewrote its view `v`: text
/// blocks replaced by the new text when it changed (a breakpoint moves with
/// it), each `tool_use` whose arguments changed given them as its input;
/// thinking and other blocks untouched.
fn assistant_rebuilt(content: &Content, v: &Message) -> Vec<Block> {
    let new_text = crate::wire::text_of(v.content().unwrap_or(&Value::Null));
    let blocks = match content {
        Content::Text(_) => {
            return vec![Block::new(json!({"type": "text", "text": new_text}))];
        }
        Content::Blocks(b) => b,
    };
    let text_changed = new_text != joined_text(blocks);
    let carried = blocks
        .iter()
        .filter(|b| is_text(b))
        .find_map(|b| b.cache_control());
    // The view's calls, one for each tool_use in order, each parsed when
    // its block is reached.
    let mut calls = v.tool_calls();
    let mut out = Vec::with_capacity(blocks.len());
    let mut placed = false;
    for b in blocks {
        if is_text(b) && text_changed {
            if !placed && !new_text.is_empty() {
                let mut t = b.value();
                t["text"] = json!(new_text);
                if let Some(cc) = &carried {
                    t["cache_control"] = cc.clone();
                }
                out.push(Block::new(t));
            }
            placed = true;
        } else if b.kind() == "tool_use" {
            let call = calls.next();
            let args = call
                .as_ref()
                .and_then(|c| c.pointer("/function/arguments"))
                .and_then(Value::as_str);
            let original = b.get("input").map(|i| i.to_string());
            match args {
                Some(a) if Some(a) != original.as_deref() => {
                    match serde_json::from_str::<Value>(a) {
                        Ok(input @ Value::Object(_)) => out.push(b.with("input", input)),
                        _ => out.push(b.clone()),
                    }
                }
                _ => out.push(b.clone()),
            }
        } else {
            out.push(b.clone());
        }
    }
    out
}

/// The text of a digest or checkpoint message (a chat message).
fn view_text(raw: &Bytes) -> String {
    serde_json::from_slice::<Value>(raw)
        .map(|v| crate::wire::text_of(&v))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The assistant view as it was built before: one value, serialized.
    fn assistant_view_as_a_value(content: &Content) -> Bytes {
        let blocks = match content {
            Content::Text(s) => {
                return Bytes::from(
                    json!({"role": "assistant", "content": decoded(s)}).to_string(),
                );
            }
            Content::Blocks(b) => b,
        };
        let text = joined_text(blocks);
        let calls: Vec<Value> = blocks
            .iter()
            .filter(|b| b.kind() == "tool_use")
            .map(|b| {
                json!({"id": b.str("id").unwrap_or_default(), "type": "function", "function": {
                    "name": b.str("name").unwrap_or_default(),
                    "arguments": b.value().get("input").map(Value::to_string).unwrap_or_default(),
                }})
            })
            .collect();
        let thinking: String = blocks
            .iter()
            .filter_map(|b| b.str("thinking"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut v = json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) }});
        if !calls.is_empty() {
            v["tool_calls"] = json!(calls);
        }
        if !thinking.is_empty() {
            v["thinking"] = json!(thinking);
        }
        Bytes::from(v.to_string())
    }

    #[test]
    fn the_assistant_view_is_written_as_the_value_was() {
        let odd = json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "plain \"text\" é"},
            {"role": "user", "content": "on"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "a", "name": "n", "input": {"z": 1, "a": [true, null]}},
                {"type": "tool_use", "id": "b", "input": "not an object"},
                {"type": "tool_use", "name": "x"}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "a", "content": "1"},
                {"type": "tool_result", "tool_use_id": "b", "content": "2"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "thinking", "thinking": "ok"},
                {"type": "text", "text": "done"}]},
            {"role": "assistant", "content": []}]});
        for body in [session(3), odd] {
            let req = MessagesRequest::parse(&Bytes::from(body.to_string())).unwrap();
            for turn in req.turns.iter().filter(|t| t.side == Side::Assistant) {
                assert_eq!(
                    assistant_view(&turn.content),
                    assistant_view_as_a_value(&turn.content),
                    "{:?}",
                    turn.raw
                );
            }
        }
    }

    /// An agent session in Messages form: a task, then `turns` rounds of a
    /// thinking block, text and a tool call answered by a long result (with
    /// a cache breakpoint on the newest one).
    fn session(turns: usize) -> Value {
        let mut messages =
            vec![json!({"role": "user", "content": "Fix the failing test in parser.py"})];
        for t in 0..turns {
            messages.push(json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": format!("I should look at file {t}."), "signature": format!("sig{t}")},
                {"type": "text", "text": format!("Reading file {t}.")},
                {"type": "tool_use", "id": format!("toolu_{t}"), "name": "read", "input": {"path": format!("src/f{t}.py")}}
            ]}));
            let mut result = json!({"type": "tool_result", "tool_use_id": format!("toolu_{t}"),
                "content": format!("def f_{t}():\n{}", "    x = compute(value) + 1\n".repeat(120))});
            if t + 1 == turns {
                result["cache_control"] = json!({"type": "ephemeral"});
            }
            messages.push(json!({"role": "user", "content": [result]}));
        }
        json!({"model": "claude-sonnet-4-5", "max_tokens": 1024, "system": "You are a coding agent.",
               "tools": [{"name": "read", "input_schema": {"type": "object"}}],
               "messages": messages, "x_unknown": {"kept": true}})
    }

    fn compacted(body: &Value, window: u64) -> (Bytes, Value) {
        let bytes = Bytes::from(body.to_string());
        let req = MessagesRequest::parse(&bytes).unwrap();
        assert!(req.well_formed());
        let (view, origins) = req.view();
        let fates = crate::wire::decide(view, &bytes, "claude-sonnet-4-5", window);
        let out = req.write_back(&origins, &fates).unwrap();
        let v = serde_json::from_slice(&out).unwrap();
        (out, v)
    }

    fn blocks_of<'a>(v: &'a Value, kind: &'a str) -> impl Iterator<Item = &'a Value> {
        v["messages"].as_array().unwrap().iter().flat_map(move |m| {
            m["content"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(move |b| b["type"] == kind)
        })
    }

    #[test]
    fn the_view_is_the_conversation_as_chat() {
        let bytes = Bytes::from(session(2).to_string());
        let (view, _) = MessagesRequest::parse(&bytes).unwrap().view();
        let roles: Vec<_> = view
            .messages()
            .iter()
            .map(|m| m.role().unwrap().to_string())
            .collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "assistant", "tool"]
        );
        let a = &view.messages()[2];
        assert_eq!(
            a.tool_calls().next().unwrap()["function"]["arguments"],
            r#"{"path":"src/f0.py"}"#
        );
        assert_eq!(view.messages()[3].tool_call_id(), Some("toolu_0"));
        assert!(view.field("tools").is_some());
    }

    #[test]
    fn masked_results_keep_their_pairing_thinking_and_breakpoints() {
        let body = session(12);
        let (_, out) = compacted(&body, 16_000);
        // Untouched: everything outside `messages`.
        for key in ["system", "tools", "x_unknown", "max_tokens", "model"] {
            assert_eq!(out[key], body[key], "{key}");
        }
        // Every thinking block is one of the client's, byte for byte.
        let thinking: Vec<_> = blocks_of(&body, "thinking").collect();
        assert!(blocks_of(&out, "thinking").all(|b| thinking.contains(&b)));
        // Some results were masked, and the breakpoint on the last is kept.
        let before: usize = blocks_of(&body, "tool_result")
            .map(|b| b.to_string().len())
            .sum();
        let after: usize = blocks_of(&out, "tool_result")
            .map(|b| b.to_string().len())
            .sum();
        assert!(after < before / 2, "{after} vs {before}");
        let last = blocks_of(&out, "tool_result").last().unwrap();
        assert_eq!(last["cache_control"], json!({"type": "ephemeral"}));
        assert_eq!(last, blocks_of(&body, "tool_result").last().unwrap());
        assert_valid(&out);
    }

    #[test]
    fn dropped_turns_leave_alternating_roles_and_a_digest() {
        let body = session(40);
        let (_, out) = compacted(&body, 4_000);
        let messages = out["messages"].as_array().unwrap();
        assert!(messages.len() < body["messages"].as_array().unwrap().len());
        // The task keeps its bytes; the digest follows the tool results of
        // the first turn kept.
        assert_eq!(messages[0], body["messages"][0]);
        let after = messages[2]["content"].as_array().unwrap();
        assert_eq!(after[0]["type"], "tool_result");
        let digest = after[1]["text"].as_str().unwrap();
        assert!(digest.contains("earlier messages were removed"), "{digest}");
        assert_valid(&out);
        // The newest turn is the client's.
        assert_eq!(messages.last(), body["messages"].as_array().unwrap().last());
    }

    #[test]
    fn a_system_message_inside_messages_stays_where_it_was() {
        // Claude Code sends its environment as a system message after the
        // task.
        let mut body = session(40);
        let env = json!({"role": "system", "content": "<env>cwd: /repo</env>"});
        body["messages"]
            .as_array_mut()
            .unwrap()
            .insert(1, env.clone());
        let (_, out) = compacted(&body, 4_000);
        let messages = out["messages"].as_array().unwrap();
        assert_eq!(messages[1], env);
        assert!(messages.len() < body["messages"].as_array().unwrap().len());
        assert_valid(&out);
    }

    /// The Messages API's rules, checked on the JSON.
    fn assert_valid(v: &Value) {
        let messages: Vec<&Value> = v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] != "system")
            .collect();
        assert_eq!(messages[0]["role"], "user");
        for w in messages.windows(2) {
            assert_ne!(w[0]["role"], w[1]["role"]);
            let uses: Vec<_> = w[0]["content"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|b| b["type"] == "tool_use")
                .map(|b| b["id"].clone())
                .collect();
            let results: Vec<_> = w[1]["content"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|b| b["type"] == "tool_result")
                .map(|b| b["tool_use_id"].clone())
                .collect();
            assert_eq!(uses, results);
            for b in w[0]["content"].as_array().into_iter().flatten() {
                if b["type"] == "tool_use" {
                    assert!(b["input"].is_object());
                }
            }
        }
        let points = messages
            .iter()
            .flat_map(|m| m["content"].as_array().into_iter().flatten())
            .filter(|b| b.get("cache_control").is_some())
            .count();
        assert!(points <= 4);
    }

    #[test]
    fn bodies_condense_does_not_understand_are_refused() {
        for bad in [
            r#"{"model":"m"}"#,
            r#"{"messages":[{"role":"tool","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":7}]}"#,
            r#"{"messages":[{"role":"user","content":[{"no_type":1}]}]}"#,
            "not json",
        ] {
            assert!(MessagesRequest::parse(&Bytes::from(bad)).is_err(), "{bad}");
        }
        // Parsed, but breaking the rules: forwarded as it came, not compacted.
        let orphan = r#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"x","content":"a"}]}]}"#;
        assert!(
            !MessagesRequest::parse(&Bytes::from(orphan))
                .unwrap()
                .well_formed()
        );
        let two_users =
            r#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#;
        assert!(
            !MessagesRequest::parse(&Bytes::from(two_users))
                .unwrap()
                .well_formed()
        );
    }
}
