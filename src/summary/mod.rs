//! LLM summarization: when masking cannot keep a conversation under its
//! budget, the oldest span is replaced by one structured checkpoint written
//! by a model, instead of being dropped.
//!
//! Which span is chosen is the compaction plan's business
//! ([`crate::compaction::Replacement::Checkpoint`]): it starts after the
//! leading system/developer messages, ends between units at a boundary that
//! stays put for many turns, and grows in large steps. This module gets the
//! checkpoint for that span:
//!
//! 1. stored: checkpoints are kept in the state store under a hash of the
//!    exact prefix they cover (with upstream and model), so every later turn
//!    of the conversation, on any replica sharing the Redis, reuses it;
//! 2. incremental: when the span has grown since the last checkpoint (the
//!    plan says where it ended before), the summarizer gets that checkpoint
//!    and only the new messages, with an update instruction;
//! 3. from scratch otherwise, in chunks when the span is larger than the
//!    summarizer can read at once (each chunk updates the previous result),
//!    reading at most a bounded transcript of it (`transcript.rs`).
//!
//! Concurrent requests for the same checkpoint share one call
//! (`flight.rs`); across replicas sharing a Redis, a lease lets one write it
//! while the others wait for it to appear in the store. A failed, timed-out or unusable answer never fails the
//! request: the caller drops the span mechanically instead, and the
//! conversation cools down (`backoff.rs`).

pub mod backoff;
pub mod client;
pub mod flight;
pub mod prompt;
pub mod transcript;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderMap;
use xxhash_rust::xxh3::Xxh3;

use crate::chat::Message;
use crate::compaction::{Replacement, Span};
use crate::config::SummaryConfig;
use crate::metrics::Metrics;
use crate::state::StateStore;
use crate::upstream::{Upstream, UpstreamError};
use backoff::Backoff;
use client::Client;
use flight::Flights;

/// How often a replica waiting on another's checkpoint looks for it.
const LEASE_POLL: Duration = Duration::from_millis(100);
/// Earlier span ends looked up for a checkpoint to update, at most.
const MAX_PREVIOUS: usize = 8;
/// Revisions quoted verbatim in a checkpoint at most.
const MAX_REVISIONS: usize = 8;
/// Characters per token assumed when sizing the summarizer's input (low on
/// purpose: code and JSON run at about 3).
const CHARS_PER_TOKEN: u64 = 3;

/// Why no checkpoint came.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    #[error("summarizer failed: {0}")]
    Error(String),
    #[error("summarizer timed out")]
    Timeout,
    #[error("conversation is cooling down after summarizer failures")]
    Cooldown,
}

impl Failure {
    /// The `reason` label of `condense_summary_fallbacks_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::Cooldown => "cooldown",
            _ => "failed",
        }
    }
}

/// What a request needs a checkpoint for.
pub struct Need<'a> {
    /// The upstream the request goes to (part of the key).
    pub upstream: &'a str,
    /// The request's model (part of the key; the summarizer model unless
    /// `summary.model` is set).
    pub model: &'a str,
    pub messages: &'a [Message],
    pub span: &'a Span,
    /// The headers condense sends the upstream (for the client's
    /// credentials, used only on the upstream's own host).
    pub client_headers: Option<&'a HeaderMap>,
    /// `max_tokens` or `max_completion_tokens`, as the client's request uses.
    pub max_field: &'static str,
    /// Most tokens the summary may have.
    pub max_tokens: u64,
    /// Tokens the summarizer can read in one call.
    pub input_tokens: u64,
}

/// A checkpoint message, and what it took.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub message: Bytes,
    /// Found stored, or shared with a concurrent request.
    pub reused: bool,
    pub calls: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// A summary written by this process (or, `reused`, by another replica).
#[derive(Debug, Clone)]
struct Written {
    text: String,
    calls: u32,
    prompt_tokens: u64,
    completion_tokens: u64,
    reused: bool,
}

struct Inner {
    config: SummaryConfig,
    client: Client,
    store: Arc<StateStore>,
    metrics: Option<Arc<Metrics>>,
}

pub struct Summarizer {
    inner: Arc<Inner>,
    upstream_base: String,
    flights: Flights<Result<Written, Failure>>,
    backoff: Backoff,
}

impl Summarizer {
    /// A summarizer for requests that go to `upstream`, speaking `api` at
    /// `summary.base_url` or else at the upstream itself (the proxy gives a
    /// configured summarizer chat completions), on the upstream's client.
    pub fn new(
        api: &'static dyn crate::wire::Api,
        config: &SummaryConfig,
        upstream: &Upstream,
        store: Arc<StateStore>,
        metrics: Option<Arc<Metrics>>,
    ) -> Result<Summarizer, UpstreamError> {
        let http = match &config.base_url {
            // A summarizer of its own is on the network, even when the
            // upstream is answered in process (`condense replay`).
            Some(base) => upstream.elsewhere(base)?,
            None => upstream.rebased(upstream.base_url())?,
        };
        Ok(Summarizer {
            inner: Arc::new(Inner {
                config: config.clone(),
                client: Client::new(api, http, config.api_key.as_ref()),
                store,
                metrics,
            }),
            upstream_base: upstream.base_url().to_string(),
            flights: Flights::new(),
            backoff: Backoff::new(
                Duration::from_secs_f64(config.cooldown_seconds),
                Duration::from_secs_f64(config.max_cooldown_seconds),
            ),
        })
    }

    /// The summarizer model for a request for `model`.
    pub fn model<'a>(&'a self, model: &'a str) -> &'a str {
        self.inner.config.model.as_deref().unwrap_or(model)
    }

    /// What the compaction plan should replace old turns with.
    pub fn replacement(&self) -> Replacement {
        Replacement::Checkpoint {
            trigger: self.inner.config.trigger,
            max_tokens: self.inner.config.max_tokens,
            message: None,
        }
    }

    /// The checkpoint message for `need.span`: stored, updated from a
    /// shorter one, or written from scratch.
    pub async fn checkpoint(&self, need: &Need<'_>) -> Result<Checkpoint, Failure> {
        let span = need.span;
        let conversation = conversation_key(need);
        if self.backoff.cooling(conversation) {
            self.count_fallback(&Failure::Cooldown);
            return Err(Failure::Cooldown);
        }
        let key = prefix_key(need, span.end);
        let store_key = format!("checkpoint:{key:032x}");
        let in_span = |i: &usize| span.kept != Some(*i);
        let revisions = prompt::revisions(
            (span.start..span.end)
                .filter(in_span)
                .map(|i| &need.messages[i]),
            MAX_REVISIONS,
        );
        let replaced = (span.start..span.end).filter(in_span).count();
        let build =
            |text: &str| Bytes::from(prompt::checkpoint_message(text, replaced, &revisions));

        if let Some(text) = self.inner.store.get(&store_key).await {
            self.count_call("reused");
            self.backoff.succeeded(conversation);
            return Ok(Checkpoint {
                message: build(&text),
                reused: true,
                calls: 0,
                prompt_tokens: 0,
                completion_tokens: 0,
            });
        }

        // The work, owned, so that it runs to the end as its own task.
        let previous_keys = span
            .previous_ends
            .iter()
            .filter(|&&p| p > span.start && p < span.end)
            .take(MAX_PREVIOUS)
            .map(|&p| (p, format!("checkpoint:{:032x}", prefix_key(need, p))))
            .collect();
        let job = Job {
            inner: self.inner.clone(),
            model: self.model(need.model).to_string(),
            headers: self.inner.client.headers(
                need.client_headers,
                self.inner.client.same_origin(&self.upstream_base),
            ),
            max_field: need.max_field,
            max_tokens: need.max_tokens,
            messages: (span.start..span.end)
                .map(|i| (i, need.messages[i].clone()))
                .collect(),
            previous_keys,
            store_key: store_key.clone(),
            input_chars: need.input_tokens.saturating_mul(CHARS_PER_TOKEN),
        };
        let (result, shared) = self
            .flights
            .run(
                key,
                job.run(),
                Err(Failure::Error("summarizer task failed".into())),
            )
            .await;
        match result {
            Ok(w) => {
                self.backoff.succeeded(conversation);
                let reused = shared || w.reused;
                if reused {
                    self.count_call("reused");
                }
                Ok(Checkpoint {
                    message: build(&w.text),
                    reused,
                    calls: if reused { 0 } else { w.calls },
                    prompt_tokens: if reused { 0 } else { w.prompt_tokens },
                    completion_tokens: if reused { 0 } else { w.completion_tokens },
                })
            }
            Err(f) => {
                self.backoff.failed(conversation);
                self.count_fallback(&f);
                Err(f)
            }
        }
    }

    fn count_call(&self, outcome: &str) {
        if let Some(m) = &self.inner.metrics {
            m.summarizer_calls_total.with_label_values(&[outcome]).inc();
        }
    }

    /// Counts a request that falls back to mechanical drops.
    pub fn count_fallback(&self, f: &Failure) {
        if let Some(m) = &self.inner.metrics {
            m.summary_fallbacks_total
                .with_label_values(&[f.reason()])
                .inc();
        }
    }
}

/// One checkpoint to write.
struct Job {
    inner: Arc<Inner>,
    model: String,
    headers: HeaderMap,
    max_field: &'static str,
    max_tokens: u64,
    /// The span's messages with their positions.
    messages: Vec<(usize, Message)>,
    /// Where checkpoints of shorter spans would be stored, longest first.
    previous_keys: Vec<(usize, String)>,
    store_key: String,
    input_chars: u64,
}

impl Job {
    async fn run(self) -> Result<Written, Failure> {
        // Replicas sharing a Redis: one writes, the others wait for it.
        let timeout = Duration::from_secs_f64(self.inner.config.timeout_seconds);
        if !self.inner.store.lease(&self.store_key, timeout).await {
            let deadline = Instant::now() + timeout;
            while Instant::now() < deadline {
                tokio::time::sleep(LEASE_POLL).await;
                if let Some(text) = self.inner.store.get(&self.store_key).await {
                    return Ok(Written {
                        text,
                        calls: 0,
                        prompt_tokens: 0,
                        completion_tokens: 0,
                        reused: true,
                    });
                }
            }
            // The other replica did not deliver: write it here.
        }
        let written = self.write().await;
        if written.is_err() {
            self.inner.store.release(&self.store_key).await;
        }
        written
    }

    /// Writes the checkpoint: from the newest stored shorter one, or from
    /// scratch, in chunks; stores it.
    async fn write(&self) -> Result<Written, Failure> {
        let mut previous = None;
        let mut from = 0;
        for (end, key) in &self.previous_keys {
            if let Some(text) = self.inner.store.get(key).await {
                previous = Some(text);
                from = self.messages.partition_point(|(i, _)| i < end);
                break;
            }
        }
        let max_tokens = self.max_tokens;
        let max_words = max_tokens * 3 / 5;
        // Room for the transcript: what the summarizer reads, minus the
        // instructions and the previous checkpoint.
        let room = (self.input_chars as usize)
            .saturating_sub(4_000 + (max_tokens * CHARS_PER_TOKEN) as usize)
            .max(8_000);
        let per_message = (room / 4).max(2_000);
        let rest = &self.messages[from..];
        // What one call reads of the transcript beside a previous
        // checkpoint of `max_tokens`.
        let per_call = room
            .saturating_sub((max_tokens * CHARS_PER_TOKEN) as usize)
            .max(room / 4);
        let limit = transcript::MAX_CALLS.saturating_mul(per_call);
        let pieces = transcript::pieces(rest, per_message, limit);
        let mut written = Written {
            text: String::new(),
            calls: 0,
            prompt_tokens: 0,
            completion_tokens: 0,
            reused: false,
        };
        let mut chunk = String::new();
        let mut markers = false;
        let mut next = pieces.first().map(|p| p.text(rest, per_message));
        for (k, piece) in pieces.iter().enumerate() {
            let Some(text) = next.take() else { break };
            chunk.push_str(&text);
            if let transcript::Piece::Message(j) = piece {
                markers |= !prompt::revisions(std::iter::once(&rest[*j].1), 1).is_empty();
            }
            next = pieces.get(k + 1).map(|p| p.text(rest, per_message));
            let full = next.as_ref().is_none_or(|next| {
                chunk.len() + next.len() + previous.as_ref().map_or(0, String::len) > room
            });
            if !full {
                continue;
            }
            let ask = match &previous {
                None => prompt::first(&chunk, markers, max_words),
                Some(p) => prompt::update(p, &chunk, markers, max_words),
            };
            let (text, p_tokens, c_tokens) = self.call(&ask).await?;
            written.calls += 1;
            written.prompt_tokens += p_tokens;
            written.completion_tokens += c_tokens;
            previous = Some(text);
            chunk.clear();
            markers = false;
        }
        written.text = previous.ok_or_else(|| Failure::Error("nothing to summarize".into()))?;
        self.inner.store.put(&self.store_key, &written.text).await;
        Ok(written)
    }

    /// One summarizer call, judged and counted.
    async fn call(&self, ask: &str) -> Result<(String, u64, u64), Failure> {
        let config = &self.inner.config;
        let started = Instant::now();
        let call = self.inner.client.call(
            self.headers.clone(),
            &self.model,
            ask,
            self.max_tokens,
            self.max_field,
        );
        let timeout = Duration::from_secs_f64(config.timeout_seconds);
        let result = match tokio::time::timeout(timeout, call).await {
            Err(_) => Err(Failure::Timeout),
            Ok(Err(e)) => Err(Failure::Error(e.to_string())),
            Ok(Ok(answer)) => {
                match prompt::validate(&answer.content, answer.finish_reason.as_deref()) {
                    Ok(text) => {
                        let tokens = answer
                            .completion_tokens
                            .unwrap_or(text.len() as u64 / CHARS_PER_TOKEN);
                        let prompt_tokens = answer
                            .prompt_tokens
                            .unwrap_or(ask.len() as u64 / CHARS_PER_TOKEN);
                        Ok((text, prompt_tokens, tokens))
                    }
                    Err(e) => Err(Failure::Error(e.to_string())),
                }
            }
        };
        let outcome = match &result {
            Ok(_) => "ok",
            Err(Failure::Timeout) => "timeout",
            Err(_) => "error",
        };
        if let Some(m) = &self.inner.metrics {
            m.summarizer_seconds
                .observe(started.elapsed().as_secs_f64());
            m.summarizer_calls_total.with_label_values(&[outcome]).inc();
            if let Ok((_, prompt_tokens, tokens)) = &result {
                m.summary_tokens.observe(*tokens as f64);
                m.summarizer_prompt_tokens_total.inc_by(*prompt_tokens);
            }
        }
        if let Err(e) = &result {
            tracing::warn!(
                model = crate::logging::clip(&self.model),
                error = %e,
                "summarizer call failed"
            );
        }
        result
    }
}

/// A hash of the upstream, the model and the first `n` messages' exact
/// bytes.
fn key_of(need: &Need<'_>, n: usize) -> u128 {
    let mut h = Xxh3::new();
    h.update(need.upstream.as_bytes());
    h.update(&[0]);
    h.update(need.model.as_bytes());
    h.update(&[0]);
    for m in &need.messages[..n.min(need.messages.len())] {
        h.update(&(m.raw().len() as u64).to_le_bytes());
        h.update(m.raw());
    }
    h.digest128()
}

/// The key of the checkpoint covering `messages[..end]`.
fn prefix_key(need: &Need<'_>, end: usize) -> u128 {
    key_of(need, end)
}

/// Which conversation a request belongs to: its system/developer messages
/// and first message after them.
fn conversation_key(need: &Need<'_>) -> u128 {
    key_of(need, need.span.start + 1)
}
