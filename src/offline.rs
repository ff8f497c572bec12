//! Offline tools behind `condense compact`: the same measurement (and, as the
//! pipeline grows, the same compaction) the proxy applies, run on a request
//! body from a file, with no upstream and no network.

use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use crate::chat::{ChatRequest, ParseError};
use crate::config::Config;
use crate::metrics::{Metrics, MetricsError};
use crate::tokens::{Assessment, TokenService, WindowSource};

#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error("not a chat completions request: {0}")]
    NotChat(#[from] ParseError),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
}

/// What `condense compact` reports on stderr.
#[derive(Debug, Serialize)]
pub struct CompactReport {
    #[serde(flatten)]
    pub assessment: Assessment,
    pub tokens_before: u64,
    pub tokens_after: u64,
    pub actions: Vec<String>,
}

/// Overrides for the model name and its window.
#[derive(Debug, Default, Clone)]
pub struct CompactOptions {
    pub model: Option<String>,
    pub window: Option<u64>,
}

/// Measures (and, once the pipeline exists, compacts) one request body.
/// Returns the body to send and the report.
pub fn compact(
    config: &Config,
    body: Bytes,
    options: &CompactOptions,
) -> Result<(Bytes, CompactReport), OfflineError> {
    let req = ChatRequest::parse(&body)?;
    let metrics = Metrics::new()?;
    let tokens = TokenService::new(Arc::new(config.clone()), &metrics);
    let model = options
        .model
        .clone()
        .or_else(|| req.model())
        .unwrap_or_default();
    let mut info = tokens.model_info("", &model);
    if let Some(w) = options.window {
        info.window = w;
        info.source = WindowSource::Override;
    }
    let assessment = tokens.assess_as("", &model, info, &req, &body, false);
    let report = CompactReport {
        tokens_before: assessment.tokens,
        tokens_after: assessment.tokens,
        actions: Vec::new(),
        assessment,
    };
    Ok((req.to_bytes(), report))
}
