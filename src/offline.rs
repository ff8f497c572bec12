//! Offline tools behind `condense compact`: the same measurement and
//! compaction the proxy applies, run on a request body from a file, with no
//! upstream and no network.

use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use crate::chat::{ChatRequest, ParseError};
use crate::compaction::{Replacement, StageReport};
use crate::config::Config;
use crate::metrics::{Metrics, MetricsError};
use crate::pipeline;
use crate::tokens::{Assessment, ModelInfo, TokenService, WindowSource};
use crate::wire::{Format, NotUnderstood, Parsed};

#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error("not a chat completions request: {0}")]
    NotChat(#[from] ParseError),
    #[error("not a chat completions or Anthropic Messages request: {0}")]
    NotUnderstood(#[from] NotUnderstood),
    #[error(transparent)]
    Write(#[from] crate::wire::WriteError),
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
    pub pressure_after: f64,
    pub fits: bool,
    pub actions: Vec<&'static str>,
    pub stages: Vec<StageReport>,
}

/// Overrides for the model name and its window.
#[derive(Debug, Default, Clone)]
pub struct CompactOptions {
    pub model: Option<String>,
    pub window: Option<u64>,
}

/// A token service for offline use (fresh cache, no calibration).
pub fn token_service(config: &Config) -> Result<TokenService, OfflineError> {
    let metrics = Metrics::new()?;
    Ok(TokenService::new(Arc::new(config.clone()), &metrics))
}

/// The model name and window to use for a request under `options`.
pub fn model_and_info(
    tokens: &TokenService,
    req: &ChatRequest,
    options: &CompactOptions,
) -> (String, ModelInfo) {
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
    (model, info)
}

/// The proxy's pipeline run offline: no upstream, and always measured (no
/// cheap path), so reports carry real counts.
pub fn process(
    tokens: &TokenService,
    config: &Config,
    model: &str,
    info: ModelInfo,
    req: ChatRequest,
    body: &Bytes,
    replacement: &Replacement,
) -> pipeline::Processed {
    let subject = pipeline::Subject {
        upstream: "",
        model,
        info,
        due: None,
        history: None,
    };
    pipeline::process(
        tokens,
        &config.compaction,
        subject,
        req,
        body,
        false,
        replacement,
    )
}

/// Measures and compacts one request body (chat completions, or Anthropic
/// Messages, told apart by their fields). Returns the body to send and the
/// report.
pub fn compact(
    config: &Config,
    body: Bytes,
    options: &CompactOptions,
) -> Result<(Bytes, CompactReport), OfflineError> {
    let Parsed {
        conversation: req,
        writer,
    } = Format::detect(&body).api().parse(&body)?;
    let tokens = token_service(config)?;
    let (model, info) = model_and_info(&tokens, &req, options);
    let p = process(
        &tokens,
        config,
        &model,
        info,
        req,
        &body,
        &Replacement::Digest,
    );
    let stages = p
        .outcome
        .as_ref()
        .map(|o| o.stages.clone())
        .unwrap_or_default();
    let report = CompactReport {
        tokens_before: p.assessment.tokens,
        tokens_after: p.tokens_after,
        pressure_after: p.assessment.budget.pressure(p.tokens_after),
        fits: p.tokens_after <= p.assessment.budget.prompt_budget,
        actions: stages.iter().map(|s| s.stage).collect(),
        stages,
        assessment: p.assessment,
    };
    let fates = p.outcome.as_ref().and_then(|o| o.fates.as_ref());
    Ok((writer.body(&p.request, fates)?, report))
}
