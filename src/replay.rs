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
//! which a provider bills at full price), probe retention (the share of
//! known facts from earlier messages still present verbatim), and whether
//! each turn fit its budget. Several conversations make a [`Suite`]: each
//! one's totals and the means over all of them.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::chat::{ChatRequest, Message, ParseError};
use crate::compaction::Counter;
use crate::compaction::conversation::Analysis;
use crate::compaction::text::{message_text, with_string_field};
use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;
use crate::offline::{self, CompactOptions, OfflineError};
use crate::pipeline::CachedCounter;
use crate::proxy::{Proxy, SetupError};
use crate::recall::store::Originals;
use crate::simulate::{CountRule, OverflowStyle, Simulator};
use crate::tokens::Budget;
use crate::upstream::{Upstream, UpstreamError};
use crate::wire::Format;
use crate::wire::anthropic::MessagesRequest;
use crate::wire::responses::ResponsesRequest;

/// A fact an agent needs later: its exact text and where it first appears.
#[derive(Debug, Clone, Deserialize)]
pub struct Probe {
    pub text: String,
    pub first_message_index: usize,
    #[serde(default)]
    pub kind: Option<String>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Strategy {
    pub tokens: u64,
    pub stability: f64,
    pub uncached: u64,
    pub retention: Option<f64>,
    /// Probes present, or in an original a recall key in the prompt gives
    /// back (the baselines have no keys: their retention).
    pub recoverable: Option<f64>,
    pub fits: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Turn {
    pub turn: usize,
    pub messages: usize,
    pub tokens_before: u64,
    /// The status the client got.
    pub status: u16,
    pub actions: String,
    /// Probes condense lost on this turn (present in the uncompacted turn).
    pub lost: Vec<String>,
    pub condense: Strategy,
    pub drop_oldest: Strategy,
    pub last_10_results: Strategy,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Totals {
    pub tokens_sent: u64,
    pub uncached_tokens: u64,
    /// Token-weighted over all turns.
    pub prefix_stability: f64,
    /// Mean over turns that had probes.
    pub probe_retention: Option<f64>,
    /// The same, counting probes a recall key in the prompt gives back.
    pub recoverable_retention: Option<f64>,
    pub turns_not_fit: usize,
}

/// What the summarizer did over a replay (`--upstream`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct SummaryStats {
    /// Summarizer calls made.
    pub calls: u32,
    /// Turns that reused a stored checkpoint.
    pub reused: u32,
    /// Turns that needed a checkpoint and fell back to mechanical drops.
    pub fallbacks: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// The simulated provider of a replay, and what it saw.
#[derive(Debug, Clone, Serialize)]
pub struct ProviderReport {
    /// Its counting rule (`o200k`, `chars:3.6`, ...).
    pub count: String,
    /// The window it enforced.
    pub window: u64,
    /// Requests it rejected for their length.
    pub rejections: usize,
    /// The calibration ratio condense had learned at the end.
    pub calibration_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub window: u64,
    pub prompt_budget: u64,
    pub provider: ProviderReport,
    pub turns: Vec<Turn>,
    pub condense: Totals,
    pub drop_oldest: Totals,
    pub last_10_results: Totals,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summarizer: Option<SummaryStats>,
}

/// One conversation's totals, in a replay of several.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    pub conversation: String,
    pub model: String,
    pub window: u64,
    pub prompt_budget: u64,
    pub turns: usize,
    pub provider: ProviderReport,
    pub condense: Totals,
    pub drop_oldest: Totals,
    pub last_10_results: Totals,
}

impl Overview {
    pub fn of(conversation: String, r: Report) -> Overview {
        Overview {
            conversation,
            model: r.model,
            window: r.window,
            prompt_budget: r.prompt_budget,
            turns: r.turns.len(),
            provider: r.provider,
            condense: r.condense,
            drop_oldest: r.drop_oldest,
            last_10_results: r.last_10_results,
        }
    }
}

/// Each strategy over all the conversations of a [`Suite`].
#[derive(Debug, Clone, Serialize)]
pub struct Overall {
    pub condense: Totals,
    pub drop_oldest: Totals,
    pub last_10_results: Totals,
}

/// Several conversations replayed with the same settings: each one's
/// totals, and over all of them tokens and turns summed, prefix stability
/// and probe retention averaged (each conversation counts once, whatever
/// its length, so one long conversation cannot hide the others).
#[derive(Debug, Clone, Serialize)]
pub struct Suite {
    pub conversations: Vec<Overview>,
    pub all: Overall,
}

impl Suite {
    pub fn of(conversations: Vec<Overview>) -> Suite {
        let all = Overall {
            condense: mean(conversations.iter().map(|c| &c.condense)),
            drop_oldest: mean(conversations.iter().map(|c| &c.drop_oldest)),
            last_10_results: mean(conversations.iter().map(|c| &c.last_10_results)),
        };
        Suite { conversations, all }
    }
}

/// Tokens and turns summed, stability and retention averaged.
fn mean<'a>(totals: impl Iterator<Item = &'a Totals>) -> Totals {
    let (mut out, mut n, mut kept, mut with_probes) = (Totals::default(), 0, 0.0, 0);
    let mut recoverable = 0.0;
    for t in totals {
        out.tokens_sent += t.tokens_sent;
        out.uncached_tokens += t.uncached_tokens;
        out.turns_not_fit += t.turns_not_fit;
        out.prefix_stability += t.prefix_stability;
        n += 1;
        if let Some(r) = t.probe_retention {
            kept += r;
            recoverable += t.recoverable_retention.unwrap_or(r);
            with_probes += 1;
        }
    }
    if n > 0 {
        out.prefix_stability /= n as f64;
    }
    out.probe_retention = (with_probes > 0).then(|| kept / with_probes as f64);
    out.recoverable_retention = (with_probes > 0).then(|| recoverable / with_probes as f64);
    out
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Offline(#[from] OfflineError),
    #[error("not a chat completions request: {0}")]
    NotChat(#[from] ParseError),
    #[error(transparent)]
    NotUnderstood(crate::wire::NotUnderstood),
    #[error("not an Anthropic Messages request: {0}")]
    NotMessages(#[from] crate::wire::anthropic::ParseError),
    #[error("not a stateless Responses request: {0}")]
    NotResponses(#[from] crate::wire::responses::ParseError),
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Config(ConfigError),
    #[error("cannot set up the proxy: {0}")]
    Setup(#[from] SetupError),
    #[error("cannot set up the simulated provider: {0}")]
    Upstream(#[from] UpstreamError),
}

/// One strategy's running state across turns.
#[derive(Default)]
struct Track {
    previous: Option<Vec<Bytes>>,
    totals: Totals,
    stable_tokens: u64,
    retention_sum: f64,
    recoverable_sum: f64,
    retention_turns: usize,
}

impl Track {
    /// Records one turn's request; `fits`: whether the provider took it;
    /// `recallable`: the originals its recall keys give back.
    fn turn(
        &mut self,
        messages: &[Message],
        fixed: u64,
        counter: &dyn Counter,
        probes: &[&Probe],
        fits: bool,
        recallable: &str,
    ) -> Strategy {
        let costs: Vec<u64> = messages.iter().map(|m| counter.message(m.raw())).collect();
        let tokens = fixed + costs.iter().sum::<u64>();
        let raws: Vec<Bytes> = messages
            .iter()
            .map(|m| Bytes::copy_from_slice(m.raw()))
            .collect();
        let stable = match &self.previous {
            Some(prev) => {
                let common = prev.iter().zip(&raws).take_while(|(a, b)| a == b).count();
                fixed + costs[..common].iter().sum::<u64>()
            }
            None => 0,
        };
        self.previous = Some(raws);
        let hay = haystack(messages);
        let (retention, recoverable) = (
            share_kept(&hay, probes, ""),
            share_kept(&hay, probes, recallable),
        );
        self.totals.tokens_sent += tokens;
        self.totals.uncached_tokens += tokens - stable;
        self.stable_tokens += stable;
        if let (Some(r), Some(rr)) = (retention, recoverable) {
            self.retention_sum += r;
            self.recoverable_sum += rr;
            self.retention_turns += 1;
        }
        if !fits {
            self.totals.turns_not_fit += 1;
        }
        Strategy {
            tokens,
            stability: if tokens == 0 {
                1.0
            } else {
                stable as f64 / tokens as f64
            },
            uncached: tokens - stable,
            retention,
            recoverable,
            fits,
        }
    }

    fn finish(mut self) -> Totals {
        self.totals.prefix_stability = if self.totals.tokens_sent == 0 {
            1.0
        } else {
            self.stable_tokens as f64 / self.totals.tokens_sent as f64
        };
        let turns = self.retention_turns as f64;
        self.totals.probe_retention =
            (self.retention_turns > 0).then(|| self.retention_sum / turns);
        self.totals.recoverable_retention =
            (self.retention_turns > 0).then(|| self.recoverable_sum / turns);
        self.totals
    }
}

/// The share of `probes` whose text is still present in `hay` (a
/// request's [`haystack`]), or in `recallable`.
fn share_kept(hay: &str, probes: &[&Probe], recallable: &str) -> Option<f64> {
    if probes.is_empty() {
        return None;
    }
    let kept = probes
        .iter()
        .filter(|p| hay.contains(&p.text) || recallable.contains(&p.text))
        .count();
    Some(kept as f64 / probes.len() as f64)
}

/// The originals the recall keys in `hay` give back, as the proxy would
/// answer them (from its state store), one after another.
async fn recallable(proxy: &Proxy, hay: &str) -> String {
    let originals = Originals {
        scope: crate::recall::store::scope(&http::HeaderMap::new()),
        own: Default::default(),
    };
    let mut keys: Vec<&str> = crate::compaction::keys::keys_in(hay).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut out = String::new();
    for k in keys {
        if let Some(text) = originals.get(&proxy.recall_state, k).await {
            out.push_str(&text);
            out.push('\n');
        }
    }
    out
}

/// The text a probe is looked for in: message contents and tool-call
/// arguments.
fn haystack(messages: &[Message]) -> String {
    messages
        .iter()
        .map(message_text)
        .collect::<Vec<_>>()
        .join("\n")
}

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
    let (report, _) = run(config, body, options, probes, provider, summarizer).await?;
    Ok(report)
}

/// [`replay_with`], and every chat request body the provider received, in
/// order, with whether it accepted it.
pub async fn replay_received(
    config: &Config,
    body: &Bytes,
    options: &CompactOptions,
    provider: &Provider,
) -> Result<(Report, Vec<(Bytes, bool)>), ReplayError> {
    let (report, simulator) = run(config, body, options, &[], provider, None).await?;
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
    let (mut ours, mut drop, mut sliding) = (Track::default(), Track::default(), Track::default());
    let mut turns = Vec::new();
    let mut rejections = 0;
    for (t, &end) in source.turn_ends().iter().enumerate() {
        let turn_body = source.prefix(end, options.model.as_deref());
        let prefix_view = source.prefix_view(end, &turn_body);
        let prefix = &prefix_view[..];
        // Probes are placed by the chat form's message index, which the
        // view keeps.
        let end = prefix.len();
        let probes_here: Vec<&Probe> = probes
            .iter()
            .filter(|p| p.first_message_index < end)
            .collect();
        let before = fixed + prefix.iter().map(|m| counter.message(m.raw())).sum::<u64>();

        let seen = simulator.received().len();
        let (status, actions) = send_turn(&proxy, format, turn_body.clone()).await;
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
        let lost = probes_here
            .iter()
            .filter(|pr| !hay.contains(&pr.text))
            .map(|pr| pr.text.clone())
            .collect();
        turns.push(Turn {
            turn: t + 1,
            messages: end,
            tokens_before: before,
            status,
            actions,
            lost,
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

/// The conversation replayed, in its wire format.
use crate::wire::Request as Source;

impl From<crate::wire::NotUnderstood> for ReplayError {
    /// A body that is not its API's request, said as it always was.
    fn from(e: crate::wire::NotUnderstood) -> ReplayError {
        use crate::wire::NotUnderstood;
        match e {
            NotUnderstood::Chat(e) => ReplayError::NotChat(e),
            NotUnderstood::Messages(e) => ReplayError::NotMessages(e),
            NotUnderstood::Responses(e) => ReplayError::NotResponses(e),
            other => ReplayError::NotUnderstood(other),
        }
    }
}

impl Source {
    /// The whole conversation as the pipeline sees it.
    fn conversation(&self) -> ChatRequest {
        match self {
            Source::Chat(c) => c.clone(),
            Source::Messages(m) => m.view().0,
            Source::Responses(r) => r.view().0,
        }
    }

    /// Where each turn's request ends: before every assistant message
    /// (but a leading one), and the whole conversation.
    fn turn_ends(&self) -> Vec<usize> {
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
    fn prefix(&self, end: usize, model: Option<&str>) -> Bytes {
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
    fn prefix_view(&self, end: usize, body: &Bytes) -> Vec<Message> {
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
    fn conversation_of(&self, body: &Bytes) -> Result<ChatRequest, ReplayError> {
        Ok(match self {
            Source::Chat(_) => ChatRequest::parse(body)?,
            Source::Messages(_) => MessagesRequest::parse(body)?.view().0,
            Source::Responses(_) => ResponsesRequest::parse(body)?.view().0,
        })
    }
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
/// when usage is taken); returns the status the client got and the actions
/// condense reported.
async fn send_turn(proxy: &Arc<Proxy>, format: Format, body: Bytes) -> (u16, String) {
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format.path())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(body));
    let Ok(request) = request else {
        return (0, "none".to_string());
    };
    let response = proxy.clone().conversation(format, request).await;
    let status = response.status().as_u16();
    let actions = response
        .headers()
        .get(crate::proxy::X_ACTIONS)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_string();
    let _ = axum::body::to_bytes(response.into_body(), usize::MAX).await;
    proxy.settled().await;
    (status, actions)
}

/// Baseline: drop the oldest units (a call with its results) after the
/// system messages until the request fits; the last user message stays.
fn drop_oldest(
    messages: &[Message],
    fixed: u64,
    budget: u64,
    counter: &dyn Counter,
) -> Vec<Message> {
    let a = Analysis::of(messages);
    let costs: Vec<u64> = messages.iter().map(|m| counter.message(m.raw())).collect();
    let mut total = fixed + costs.iter().sum::<u64>();
    let mut dropped = vec![false; messages.len()];
    for unit in &a.units {
        if total <= budget {
            break;
        }
        if unit.iter().any(|&i| i < a.base || a.last_user == Some(i)) {
            continue;
        }
        for &i in unit {
            dropped[i] = true;
            total -= costs[i];
        }
    }
    messages
        .iter()
        .zip(&dropped)
        .filter(|(_, d)| !**d)
        .map(|(m, _)| m.clone())
        .collect()
}

/// Baseline: above the trigger, every tool result (or observation) but the
/// last ten becomes a fixed placeholder.
fn last_10_results(messages: &[Message], tokens: u64, trigger: f64) -> Vec<Message> {
    if (tokens as f64) < trigger {
        return messages.to_vec();
    }
    let a = Analysis::of(messages);
    let results: Vec<usize> = (0..messages.len()).filter(|&i| a.output(i)).collect();
    let keep_from = results.len().saturating_sub(10);
    let mut out = messages.to_vec();
    for &i in &results[..keep_from] {
        if let Some(b) = with_string_field(messages[i].raw(), "content", "[tool output elided]") {
            out[i] = Message::from_bytes(b);
        }
    }
    out
}

/// The report as a table for people.
pub fn render(r: &Report) -> String {
    let mut s = format!(
        "model {}  window {}  prompt budget {}\n\n",
        r.model, r.window, r.prompt_budget
    );
    s.push_str("turn  msgs   before  condense  stab  keep  fit | drop_old  stab  keep  fit | last_10  stab  keep  fit | actions\n");
    let pct = |x: Option<f64>| x.map_or("   -".to_string(), |v| format!("{:>4.0}%", v * 100.0));
    let yn = |b: bool| if b { "yes" } else { " NO" };
    for t in &r.turns {
        s.push_str(&format!(
            "{:>4} {:>5} {:>8} {:>9} {:>5.2} {} {} | {:>8} {:>5.2} {} {} | {:>7} {:>5.2} {} {} | {}\n",
            t.turn,
            t.messages,
            t.tokens_before,
            t.condense.tokens,
            t.condense.stability,
            pct(t.condense.retention),
            yn(t.condense.fits),
            t.drop_oldest.tokens,
            t.drop_oldest.stability,
            pct(t.drop_oldest.retention),
            yn(t.drop_oldest.fits),
            t.last_10_results.tokens,
            t.last_10_results.stability,
            pct(t.last_10_results.retention),
            yn(t.last_10_results.fits),
            t.actions
        ));
    }
    s.push('\n');
    strategies(&mut s, &r.condense, &r.drop_oldest, &r.last_10_results);
    s.push_str(&provider_line(&r.provider));
    if let Some(st) = &r.summarizer {
        s.push_str(&format!(
            "\nsummarizer: {} calls ({} prompt + {} completion tokens), {} turns reused a stored checkpoint, {} fell back to drops\n",
            st.calls, st.prompt_tokens, st.completion_tokens, st.reused, st.fallbacks
        ));
    }
    s
}

/// One line on the provider.
fn provider_line(p: &ProviderReport) -> String {
    format!(
        "provider: counts {}, window {}; {} requests rejected for their length; calibration ratio learned {:.3}\n",
        p.count, p.window, p.rejections, p.calibration_ratio
    )
}

/// The strategies' totals as a table.
fn strategies(s: &mut String, condense: &Totals, drop_oldest: &Totals, last_10: &Totals) {
    s.push_str(
        "strategy          tokens sent  uncached  prefix stability  probe retention  recoverable  turns not fit\n",
    );
    for (name, t) in [
        ("condense", condense),
        ("drop_oldest", drop_oldest),
        ("last_10_results", last_10),
    ] {
        s.push_str(&format!(
            "{:<17} {:>11} {:>9} {:>17.3} {:>16} {:>12} {:>14}\n",
            name,
            t.tokens_sent,
            t.uncached_tokens,
            t.prefix_stability,
            t.probe_retention
                .map_or("-".to_string(), |v| format!("{v:.3}")),
            t.recoverable_retention
                .map_or("-".to_string(), |v| format!("{v:.3}")),
            t.turns_not_fit
        ));
    }
}

/// A replay of several conversations as text: each one's totals, then all.
pub fn render_suite(suite: &Suite) -> String {
    let mut s = String::new();
    for c in &suite.conversations {
        s.push_str(&format!(
            "{}  (model {}, window {}, prompt budget {}, {} turns)\n",
            c.conversation, c.model, c.window, c.prompt_budget, c.turns
        ));
        strategies(&mut s, &c.condense, &c.drop_oldest, &c.last_10_results);
        s.push_str(&provider_line(&c.provider));
        s.push('\n');
    }
    s.push_str(&format!(
        "all {} conversations (tokens and turns summed; stability and retention averaged, each conversation once)\n",
        suite.conversations.len()
    ));
    let a = &suite.all;
    strategies(&mut s, &a.condense, &a.drop_oldest, &a.last_10_results);
    s
}
