//! Writing the pipeline's decisions back into a Messages body: only the
//! blocks whose view message changed are rewritten; same-role neighbours
//! are merged, and the result is checked against the API's rules.

use super::*;

impl MessagesRequest {
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
            match o.message() {
                None => {
                    if fates.dropped[j] || fates.rewritten[j].is_some() {
                        return Err(WriteError::Invalid("the system prompt changed"));
                    }
                }
                Some(t) => parts[t].push(j),
            }
        }
        let digest_at = fates
            .replacement
            .as_ref()
            .and_then(|_| {
                fates
                    .replacement_at
                    .filter(|&j| j < n)
                    .or_else(|| (0..n).find(|&j| fates.dropped[j]))
            })
            .map(|j| origins[j].message().unwrap_or(0));
        // The turn holding the client's last words (its last user text).
        let last_words = origins.iter().rev().find_map(|o| match *o {
            Origin::User(t) | Origin::UserBlock(t, _) => Some(t),
            _ => None,
        });
        let mut out: Vec<Out> = Vec::with_capacity(self.turns.len() + 1);
        let mut digest_out = None;
        let mut last_words_out = None;
        for (t, turn) in self.turns.iter().enumerate() {
            if last_words == Some(t) {
                last_words_out = Some(out.len());
            }
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
            // Placed right after the client's last words: by the last
            // resort, or past a long prompt (see `Fates::replacement_at`).
            let after_last_words =
                fates.replacement_at.is_some() && last_words_out.is_some_and(|w| w + 1 == d);
            self.place_digest(&mut out, d, after_last_words);
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
                    .map(|v| crate::wire::view::text_of(&v))
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
                    let text = crate::wire::view::text_of(&v);
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

    /// Where the digest (at `d`) joins a user message. Behind the tool
    /// results of the message before it, when that holds tool results
    /// alone: where a chat request has it (a drop rewrites from there in
    /// any form), and the first turn kept after the drop keeps its bytes.
    /// Joined to that turn's results instead, the digest went out again
    /// whenever they were masked, often on the next turn: on the shared
    /// traces at 16k (chars:3.6) the Messages form of an OpenHands session
    /// kept 0.847 of its prefix where its chat form kept 0.858 (0.850 so),
    /// and no replay lost stability.
    ///
    /// Else into the first user message after the dropped turns, behind
    /// its tool results: the messages before the drop, the task among
    /// them, then keep their bytes (and the provider's cache of them) as
    /// they would in a chat request. The newest message too: joined
    /// to the task's message instead, the digest changed the request's
    /// first message, and moved on the next turn (a replayed SWE-agent
    /// session in Messages form lost its cached prefix twice so). But not
    /// when the last resort put the digest right after the client's last
    /// words (`after_last_words`; its key changes as turns go): that
    /// message keeps its bytes, the prefix up to it stays cached, and the
    /// digest goes into the assistant message after it, behind that
    /// message's thinking (which must come first). With no user message
    /// after it, the digest stays and joins the user message before it.
    fn place_digest(&self, out: &mut Vec<Out>, d: usize, after_last_words: bool) {
        if !after_last_words && d > 0 && self.results_only(&out[d - 1]) {
            return;
        }
        let next_user = (d + 1..out.len()).find(|&i| out[i].side(self) == Side::User);
        if let Some(u) = next_user.filter(|&u| u + 1 < out.len() || !after_last_words) {
            let digest = out.remove(d);
            // `u` moved down by one with the removal.
            out.insert(u, digest);
            return;
        }
        let next = d + 1;
        if !after_last_words || out.get(next).map(|o| o.side(self)) != Some(Side::Assistant) {
            return;
        }
        let digest = out.remove(d).owned_blocks(self);
        let into = &mut out[d];
        let fields = into.fields(self);
        let mut blocks = into.owned_blocks(self);
        let at = blocks
            .iter()
            .take_while(|b| matches!(b.kind(), "thinking" | "redacted_thinking"))
            .count();
        blocks.splice(at..at, digest);
        *into = Out::Built {
            side: Side::Assistant,
            fields,
            blocks,
        };
    }

    /// Whether `o` is a user message of tool results alone.
    fn results_only(&self, o: &Out) -> bool {
        let blocks = o.blocks(self);
        o.side(self) == Side::User
            && !blocks.is_empty()
            && blocks.iter().all(|b| b.kind() == "tool_result")
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
                        crate::wire::view::raw_list(blocks.iter().map(|b| &b.raw)),
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

/// An assistant message's blocks after a stage rewrote its view `v`: text
/// blocks replaced by the new text when it changed (a breakpoint moves with
/// it), each `tool_use` whose arguments changed given them as its input;
/// thinking and other blocks untouched.
fn assistant_rebuilt(content: &Content, v: &Message) -> Vec<Block> {
    let new_text = crate::wire::view::text_of(v.content().unwrap_or(&Value::Null));
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
        .map(|v| crate::wire::view::text_of(&v))
        .unwrap_or_default()
}
