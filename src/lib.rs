//! condense: an OpenAI-compatible proxy that keeps long agent conversations
//! inside the model's context window.
//!
//! The crate is a library with a thin binary (`src/main.rs`): the server,
//! the lossless chat model and the proxy are all usable in-process, which is
//! how the integration tests drive them.

pub mod cache;
pub mod chat;
pub mod compaction;
pub mod config;
pub mod error;
pub mod ids;
pub mod logging;
pub mod metrics;
pub mod offline;
pub mod overflow;
pub mod pipeline;
pub mod proxy;
pub mod recall;
pub mod replay;
pub mod server;
pub mod simulate;
pub mod state;
pub mod summary;
pub mod tokens;
pub mod upstream;
pub mod wire;
