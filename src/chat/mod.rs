//! The lossless OpenAI chat-completions request and message model.

pub mod message;
pub mod object;
pub mod request;

pub use message::Message;
pub use object::RawObject;
pub use request::{ChatRequest, ParseError};
