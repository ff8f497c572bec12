//! What stops a replay.

use crate::chat::ParseError;
use crate::config::ConfigError;
use crate::offline::OfflineError;
use crate::proxy::SetupError;
use crate::upstream::UpstreamError;
use crate::wire::RequestError;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Offline(#[from] OfflineError),
    /// Not a request of its API ("not a chat completions request: ...").
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Config(ConfigError),
    #[error("cannot set up the proxy: {0}")]
    Setup(#[from] SetupError),
    #[error("cannot set up the simulated provider: {0}")]
    Upstream(#[from] UpstreamError),
}

impl From<ParseError> for ReplayError {
    fn from(e: ParseError) -> ReplayError {
        ReplayError::Request(RequestError::Chat(e))
    }
}

impl From<crate::wire::anthropic::ParseError> for ReplayError {
    fn from(e: crate::wire::anthropic::ParseError) -> ReplayError {
        ReplayError::Request(RequestError::Messages(e))
    }
}

impl From<crate::wire::responses::ParseError> for ReplayError {
    fn from(e: crate::wire::responses::ParseError) -> ReplayError {
        ReplayError::Request(RequestError::Responses(e))
    }
}
