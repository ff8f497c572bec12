//! The one trait the request path calls for what differs between the
//! APIs ([`Api`]), gathered from the traits of the parts that use it: the
//! usage tap (`TapRead`, errors included), condense's tools in answers and
//! streams (`StreamEdit`, `OwnTools`), summaries (`Summarize`); and the
//! body parsed into the pipeline's view, with how its decisions go back.

use bytes::Bytes;

use super::stream::StreamEdit;
use super::summarize::Summarize;
use super::tap::TapRead;
use crate::chat::ChatRequest;
use crate::compaction::Fates;

/// An API condense reads.
pub trait Api: TapRead + StreamEdit + Summarize {
    /// The body parsed in this API: the pipeline's view and how its
    /// decisions are written back.
    fn parse(&self, body: &Bytes) -> Result<Parsed, NotUnderstood>;

    /// Who serves it: where it goes, whose key it carries, what the
    /// provider's model listing tells.
    fn provider(&self) -> Provider;

    /// Whether a body is parsed item by item into a view of its own (a
    /// large one is then work for the blocking pool); chat's view is the
    /// body itself.
    fn parses_into_a_view(&self) -> bool;
}

/// Who serves an API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// An OpenAI-compatible upstream (`upstream.base_url`): chat
    /// completions and Responses share it, its keys and its listing.
    OpenAi,
    /// Anthropic's (`upstream.anthropic_base_url`).
    Anthropic,
}

/// Why a body is not a conversation condense works on (it goes upstream
/// unchanged).
#[derive(Debug, thiserror::Error)]
pub enum NotUnderstood {
    /// Not a request of its API.
    #[error(transparent)]
    Parse(Box<dyn std::error::Error + Send + Sync>),
    #[error("the conversation does not keep its API's pairing rules")]
    IllFormed,
    /// The server holds the history (`previous_response_id`,
    /// `conversation`).
    #[error("the history is on the server ({0})")]
    Stateful(&'static str),
}

impl NotUnderstood {
    pub fn parse(e: impl std::error::Error + Send + Sync + 'static) -> NotUnderstood {
        NotUnderstood::Parse(Box::new(e))
    }
}

/// A request body parsed in its API: the conversation the pipeline works
/// on, and how its decisions go back into the body.
pub struct Parsed {
    pub conversation: ChatRequest,
    pub writer: Writer,
}

/// How the pipeline's result becomes the body sent upstream.
pub type Writer = Box<dyn WriteBack>;

/// A parsed body's own way back.
pub trait WriteBack: Send + Sync {
    /// The API it writes.
    fn api(&self) -> &'static dyn Api;

    /// `stream: true`, read from the body (`conversation` is its view).
    fn is_stream(&self, conversation: &ChatRequest) -> bool;

    /// The body to send: the request with `fates` written back (its own
    /// bytes when nothing changed); for chat, `conversation` itself.
    fn body(&self, conversation: &ChatRequest, fates: Option<&Fates>) -> Result<Bytes, WriteError>;
}

/// A body read into a view (Messages, Responses) that can write the view's
/// decisions back into itself.
pub trait Rewritable: Send + Sync + 'static {
    /// Where each message of the view came from in the body.
    type Origins: Send + Sync + 'static;
    type Error: std::error::Error + Send + Sync + 'static;

    fn is_stream(&self) -> bool;

    /// The body as it came.
    fn source(&self) -> &Bytes;

    fn write_back(&self, origins: &Self::Origins, fates: &Fates) -> Result<Bytes, Self::Error>;
}

/// The way back of a body read into a view: its parts rewritten where the
/// view changed, its own bytes when nothing did.
pub struct Rewrite<R: Rewritable> {
    pub api: &'static dyn Api,
    pub req: R,
    pub origins: R::Origins,
}

impl<R: Rewritable> WriteBack for Rewrite<R> {
    fn api(&self) -> &'static dyn Api {
        self.api
    }

    fn is_stream(&self, _: &ChatRequest) -> bool {
        self.req.is_stream()
    }

    fn body(&self, _: &ChatRequest, fates: Option<&Fates>) -> Result<Bytes, WriteError> {
        match fates {
            Some(f) => self
                .req
                .write_back(&self.origins, f)
                .map_err(|e| WriteError(Box::new(e))),
            None => Ok(self.req.source().clone()),
        }
    }
}

/// A format's decisions could not be written back.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct WriteError(pub Box<dyn std::error::Error + Send + Sync>);

impl Parsed {
    /// The requested model, when it is a string.
    pub fn model(&self) -> Option<String> {
        self.conversation.model()
    }

    /// `stream: true`.
    pub fn is_stream(&self) -> bool {
        self.writer.is_stream(&self.conversation)
    }

    /// `max_tokens` (or chat's `max_completion_tokens`).
    pub fn max_completion_tokens(&self) -> Option<u64> {
        self.conversation.max_completion_tokens()
    }
}
