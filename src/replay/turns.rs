//! A recorded conversation in its wire format, cut into the requests its
//! agent sent (each prefix that ends before an assistant message).

use bytes::Bytes;

use super::error::ReplayError;
use crate::chat::{ChatRequest, Message};
use crate::wire::anthropic::MessagesRequest;
use crate::wire::responses::ResponsesRequest;

/// The conversation replayed, in its wire format.
pub(super) use crate::wire::Request as Source;

impl Source {
    /// The whole conversation as the pipeline sees it.
    pub(super) fn conversation(&self) -> ChatRequest {
        match self {
            Source::Chat(c) => c.clone(),
            Source::Messages(m) => m.view().0,
            Source::Responses(r) => r.view().0,
        }
    }

    /// Where each turn's request ends: before every assistant message
    /// (but a leading one), and the whole conversation.
    pub(super) fn turn_ends(&self) -> Vec<usize> {
        let (assistants, len) = match self {
            Source::Chat(c) => (
                (0..c.messages().len())
                    .filter(|&i| c.messages()[i].role() == Some("assistant"))
                    .collect::<Vec<_>>(),
                c.messages().len(),
            ),
            Source::Messages(m) => (m.assistant_turns(), m.len()),
            Source::Responses(r) => (r.assistant_turns(), r.len()),
        };
        let mut ends: Vec<usize> = assistants.into_iter().filter(|&i| i > 0).collect();
        ends.push(len);
        ends.dedup();
        ends
    }

    /// The request the client sent for the turn ending at `end`.
    pub(super) fn prefix(&self, end: usize, model: Option<&str>) -> Bytes {
        match self {
            Source::Chat(c) => {
                let mut req = c.clone();
                req.set_messages(c.messages()[..end].to_vec());
                if let Some(m) = model {
                    req.set_field(
                        "model",
                        Bytes::from(serde_json::to_vec(m).unwrap_or_default()),
                    );
                }
                req.to_bytes()
            }
            Source::Messages(m) => m.prefix(end, model),
            Source::Responses(r) => r.prefix(end, model),
        }
    }

    /// That turn's conversation as the pipeline sees it.
    pub(super) fn prefix_view(&self, end: usize, body: &Bytes) -> Vec<Message> {
        match self {
            Source::Chat(c) => c.messages()[..end].to_vec(),
            Source::Messages(_) => MessagesRequest::parse(body)
                .map(|m| m.view().0.messages().to_vec())
                .unwrap_or_default(),
            Source::Responses(_) => ResponsesRequest::parse(body)
                .map(|r| r.view().0.messages().to_vec())
                .unwrap_or_default(),
        }
    }

    /// The conversation of a body the provider received.
    pub(super) fn conversation_of(&self, body: &Bytes) -> Result<ChatRequest, ReplayError> {
        Ok(match self {
            Source::Chat(_) => ChatRequest::parse(body)?,
            Source::Messages(_) => MessagesRequest::parse(body)?.view().0,
            Source::Responses(_) => ResponsesRequest::parse(body)?.view().0,
        })
    }
}
