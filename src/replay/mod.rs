//! `condense replay`: a recorded conversation fed through the pipeline turn
//! by turn, as the agent sent it (each prefix that ends before an assistant
//! message is one request, then the whole conversation), with two common
//! strategies run in the same pass for comparison:
//!
//! - `drop_oldest`: drop the oldest messages (a call with its results) until
//!   the request fits;
//! - `last_10_results`: above the trigger, replace every tool result but the
//!   last ten with a short placeholder (sliding observation masking).
//!
//! Reported per turn and in total: tokens sent, stages applied, prefix
//! stability (the token-weighted share of a turn's request that is a
//! byte-identical prefix of the previous turn's), uncached tokens (the rest,
//! which a provider bills at full price), the stability ceiling (what
//! stability would have been had nothing sent before been rewritten, see
//! `measure.rs`), probe retention (the share of
//! known facts from earlier messages still present verbatim; recoverable:
//! present or given back by a recall key the request holds), the same over
//! the facts the agent used again (a probe quoted in a later assistant
//! message or tool call: what it needs to do its job), and whether each
//! turn fit its budget. Several conversations make a [`Suite`]: each
//! one's totals and the means over all of them.

use bytes::Bytes;

use std::sync::Arc;

use crate::chat::{ChatRequest, Message};
use crate::compaction::text::message_text;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::offline::{self, CompactOptions, OfflineError};
use crate::pipeline::CachedCounter;
use crate::proxy::Proxy;
use crate::simulate::{CountRule, OverflowStyle, Simulator};
use crate::tokens::Budget;
use crate::upstream::Upstream;
use crate::wire::Format;

mod baselines;
mod error;
mod measure;
mod report;
mod turns;

use baselines::{drop_oldest, last_10_results};
pub use error::ReplayError;
use measure::{Growth, Here, Track, haystack, recallable, reused};
pub use report::*;
use turns::Source;

/// The provider a replay sends its turns to: it counts prompt tokens by
/// its own rule and enforces its window with its own overflow errors.
#[derive(Debug, Clone)]
pub struct Provider {
    pub count: CountRule,
    /// The window it enforces; None: the window condense applies.
    pub window: Option<u64>,
    pub overflow: OverflowStyle,
    /// Whether its `/models` listing names the window.
    pub lists_window: bool,
}

impl Default for Provider {
    fn default() -> Provider {
        Provider {
            count: CountRule::O200k,
            window: None,
            overflow: OverflowStyle::OpenAi,
            lists_window: false,
        }
    }
}

/// Replays `body` (a chat request whose messages are the whole
/// conversation) against a provider that counts like o200k, dropping old
/// turns mechanically when they must go.
pub fn replay(
    config: &Config,
    body: &Bytes,
    options: &CompactOptions,
    probes: &[Probe],
) -> Result<Report, ReplayError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ReplayError::Runtime)?;
    runtime.block_on(replay_with(
        config,
        body,
        options,
        probes,
        &Provider::default(),
        None,
    ))
}

/// The URL the replayed proxy is configured with for the simulated
/// provider (never contacted: requests are answered in process).
const PROVIDER_URL: &str = "http://provider.simulated/v1";

/// [`replay`] against `provider`, with old turns summarized by the
/// OpenAI-compatible API at `summarizer` when given (configured by
/// `config.summary`; the key falls back to `upstream.api_key`).
///
/// Every turn goes through condense's own proxy, in process: measured,
/// compacted, sent to the provider, recovered from its overflow errors,
/// and calibrated from its usage, exactly as a client's request would be.
/// What the provider accepted is what the report measures.
pub async fn replay_with(
    config: &Config,
    body: &Bytes,
    options: &CompactOptions,
    probes: &[Probe],
    provider: &Provider,
    summarizer: Option<&str>,
) -> Result<Report, ReplayError> {
    let (report, _) = replay_all(config, body, options, probes, provider, summarizer).await?;
    Ok(report)
}

/// [`replay_all`] without probes or a summarizer.
pub async fn replay_received(
    config: &Config,
    body: &Bytes,
    options: &CompactOptions,
    provider: &Provider,
) -> Result<(Report, Vec<(Bytes, bool)>), ReplayError> {
    replay_all(config, body, options, &[], provider, None).await
}

/// [`replay_with`], and every request body the provider received, in
/// order, with whether it accepted it (what `condense replay --dump`
/// writes).
pub async fn replay_all(
    config: &Config,
    body: &Bytes,
    options: &CompactOptions,
    probes: &[Probe],
    provider: &Provider,
    summarizer: Option<&str>,
) -> Result<(Report, Vec<(Bytes, bool)>), ReplayError> {
    let (report, simulator) = run(config, body, options, probes, provider, summarizer).await?;
    Ok((report, simulator.received()))
}

async fn run(
    config: &Config,
    body: &Bytes,
    options: &CompactOptions,
    probes: &[Probe],
    provider: &Provider,
    summarizer: Option<&str>,
) -> Result<(Report, Arc<Simulator>), ReplayError> {
    let format = Format::detect(body);
    let source = Source::parse(format, body)?;
    let full = source.conversation();
    let tokens = offline::token_service(config)?;
    let (model, info) = offline::model_and_info(&tokens, &full, options);
    let counter = CachedCounter::new(&tokens, info.encoding);
    let proxied = proxy_config(config, &model, options, summarizer);
    proxied.validate().map_err(ReplayError::Config)?;
    let mut simulator = Simulator::new(
        provider.count,
        provider.window.unwrap_or(info.window),
        provider.overflow,
    );
    simulator.lists_window = provider.lists_window;
    let simulator = Arc::new(simulator);
    let metrics = Arc::new(Metrics::new().map_err(OfflineError::from)?);
    let upstream = Upstream::in_process(&proxied.upstream, simulator.clone())?;
    let proxy = Arc::new(Proxy::with_upstream(
        Arc::new(proxied),
        metrics.clone(),
        upstream,
    )?);

    let budget = Budget::new(
        info.window,
        full.max_completion_tokens(),
        config.tokens.default_completion_tokens,
        config.tokens.reserve_ratio,
    );
    let completion = full.max_completion_tokens().unwrap_or(0);
    let accepts = |messages: &[Message]| {
        let mut req = full.clone();
        req.set_messages(messages.to_vec());
        simulator
            .count(&req.to_bytes())
            .is_some_and(|n| simulator.accepts(format.path(), n, completion))
    };
    let fixed = tokens.count(&full, info.encoding).tools + crate::tokens::count::REPLY_PRIMING;
    let reused = {
        let texts: Vec<String> = full.messages().iter().map(message_text).collect();
        let assistant: Vec<bool> = full
            .messages()
            .iter()
            .map(|m| m.role() == Some("assistant"))
            .collect();
        reused(&texts, &assistant, probes)
    };
    let (mut ours, mut drop, mut sliding) = (Track::default(), Track::default(), Track::default());
    let mut growth = Growth::default();
    let mut turns = Vec::new();
    let mut rejections = 0;
    for (t, &end) in source.turn_ends().iter().enumerate() {
        let turn_body = source.prefix(end, options.model.as_deref());
        let prefix_view = source.prefix_view(end, &turn_body);
        let prefix = &prefix_view[..];
        // A probe counts from the first turn whose request, as the client
        // sent it, holds it. Not by `first_message_index`: that indexes the
        // list it was written for (the chat form of a converted trace, the
        // body's own `messages` or `input` of a native one), and a view's
        // index is neither (a Messages view has a message per tool result,
        // a Responses view one per assistant run), so a native Claude Code
        // turn was measured on facts its agent had not seen yet.
        let end = prefix.len();
        let client_hay = haystack(prefix);
        let (before, added) = growth.turn(prefix, fixed, &counter);
        let probes_here = Here {
            all: present(probes, &client_hay, |_| true),
            reused: present(probes, &client_hay, |i| reused[i]),
            added,
        };

        let seen = simulator.received().len();
        let (status, actions, estimate) = send_turn(&proxy, format, turn_body.clone()).await;
        let received = simulator.received();
        let new = &received[seen.min(received.len())..];
        rejections += new.iter().filter(|(_, ok)| !ok).count();
        // What the provider accepted (or, when the turn failed, the last
        // thing it was sent; or the turn as the client sent it).
        let sent = new
            .iter()
            .rev()
            .find(|(_, ok)| *ok)
            .or(new.last())
            .map_or(turn_body, |(b, _)| b.clone());
        let forwarded = source.conversation_of(&sent)?;
        let hay = haystack(forwarded.messages());
        let recalled = recallable(&proxy, &hay).await;
        let condense = ours.turn(
            forwarded.messages(),
            fixed,
            &counter,
            &probes_here,
            (200..300).contains(&status),
            &recalled,
        );
        let d = drop_oldest(prefix, fixed, budget.prompt_budget, &counter);
        let drop_s = drop.turn(&d, fixed, &counter, &probes_here, accepts(&d), "");
        let s = last_10_results(prefix, before, info.trigger * budget.prompt_budget as f64);
        let sliding_s = sliding.turn(&s, fixed, &counter, &probes_here, accepts(&s), "");
        let lost: Vec<String> = probes_here
            .all
            .iter()
            .filter(|pr| !hay.contains(&pr.text))
            .map(|pr| pr.text.clone())
            .collect();
        let unrecoverable = lost
            .iter()
            .filter(|text| !recalled.contains(text.as_str()))
            .cloned()
            .collect();
        turns.push(Turn {
            turn: t + 1,
            messages: end,
            tokens_before: before,
            estimate,
            status,
            actions,
            lost,
            unrecoverable,
            condense,
            drop_oldest: drop_s,
            last_10_results: sliding_s,
        });
    }
    let m = &metrics;
    let stats = summarizer.map(|_| SummaryStats {
        calls: m.summarizer_calls_total.with_label_values(&["ok"]).get() as u32,
        reused: m
            .summarizer_calls_total
            .with_label_values(&["reused"])
            .get() as u32,
        fallbacks: ["failed", "cooldown"]
            .iter()
            .map(|r| m.summary_fallbacks_total.with_label_values(&[r]).get() as u32)
            .sum(),
        prompt_tokens: m.summarizer_prompt_tokens_total.get(),
        completion_tokens: m.summary_tokens.get_sample_sum() as u64,
    });
    let report = Report {
        model,
        window: info.window,
        prompt_budget: budget.prompt_budget,
        provider: ProviderReport {
            count: provider.count.to_string(),
            window: simulator.window,
            rejections,
            calibration_ratio: proxy.tokens.calibration.ratio(
                PROVIDER_URL.trim_end_matches('/'),
                &served_model(&full, options),
            ),
        },
        turns,
        condense: ours.finish(),
        drop_oldest: drop.finish(),
        last_10_results: sliding.finish(),
        summarizer: stats,
    };
    Ok((report, simulator))
}

/// The probes (with their index in `probes`) that `hay` holds and `keep`
/// takes.
fn present<'a>(probes: &'a [Probe], hay: &str, keep: impl Fn(usize) -> bool) -> Vec<&'a Probe> {
    probes
        .iter()
        .enumerate()
        .filter(|(i, p)| keep(*i) && hay.contains(&p.text))
        .map(|(_, p)| p)
        .collect()
}

/// The model name the replayed requests carry.
fn served_model(full: &ChatRequest, options: &CompactOptions) -> String {
    options
        .model
        .clone()
        .or_else(|| full.model())
        .unwrap_or_default()
}

/// The configuration the replayed proxy runs with: `config`, pointed at the
/// simulated provider, with `--window` as a profile for the model, the
/// summarizer at `summarizer` (or none), and its state in process.
fn proxy_config(
    config: &Config,
    model: &str,
    options: &CompactOptions,
    summarizer: Option<&str>,
) -> Config {
    let mut c = config.clone();
    c.upstream.base_url = PROVIDER_URL.to_string();
    c.upstream.anthropic_base_url = PROVIDER_URL.to_string();
    // A replay keeps its state to itself: never a shared Redis, whose
    // checkpoints and windows would leak into (and out of) production.
    c.state.redis_url = None;
    if let Some(window) = options.window {
        // A profile that is the model's exact name is the most specific.
        c.models.push(crate::config::ModelProfile {
            pattern: model.to_string(),
            context_window: window,
            encoding: None,
            trigger: None,
            target: None,
        });
    }
    match summarizer {
        Some(url) => {
            c.summary.enabled = true;
            c.summary.base_url = Some(url.to_string());
            if c.summary.api_key.is_none() {
                c.summary.api_key = config.upstream.api_key.clone();
            }
        }
        None => c.summary.enabled = false,
    }
    c
}

/// Sends one turn through the proxy and reads the whole answer (which is
/// when usage is taken); returns the status the client got, the actions
/// condense reported and its calibrated estimate of the turn.
async fn send_turn(proxy: &Arc<Proxy>, format: Format, body: Bytes) -> (u16, String, Option<u64>) {
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format.path())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(body));
    let Ok(request) = request else {
        return (0, "none".to_string(), None);
    };
    let response = proxy.clone().conversation(format, request).await;
    let status = response.status().as_u16();
    let actions = response
        .headers()
        .get(crate::proxy::X_ACTIONS)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_string();
    let estimate = response
        .headers()
        .get(crate::proxy::X_TOKENS_BEFORE)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let _ = axum::body::to_bytes(response.into_body(), usize::MAX).await;
    proxy.settled().await;
    (status, actions, estimate)
}

#[cfg(test)]
mod tests;
