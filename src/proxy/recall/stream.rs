//! A streamed answer that was offered condense's tools, on its way to the
//! client.
//!
//! [`Proxy::read_stream`] holds a stream back only until it tells whether
//! it starts with one of condense's calls (reasoning is held; text or a
//! call of the client's tools lets it through). Once through, each event
//! goes through the wire's [`Filter`]: a call of condense's tools that
//! comes later is taken out, and the events that end the answer are held.
//! When the round ends with such a call, condense answers it and sends the
//! next round ([`Rounds::next`]); that round's events continue the same
//! answer (the filter numbers them on and gives the end the final round's
//! stop reason and every round's usage). A model writes a sentence before
//! a call more often than not: the turn never ends there because condense
//! was called. When no round may follow (`compaction.max_recalls`), or the
//! follow-up fails, the held end goes out and the answer ends as it came,
//! without condense's calls.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::HeaderMap;

use super::{Again, Offer, Step};
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::proxy::read::BodyStream;
use crate::proxy::respond::Reply;
use crate::upstream::Outgoing;
use crate::wire::Format;
use crate::wire::sse;
use crate::wire::stream::{Decision, Edit, Filter, Gather};
use crate::wire::tap::JsonTap;
use crate::wire::tools::Answer;
use crate::wire::usage::{Sum, Usage};

/// Largest answer read for condense's calls (a larger one is relayed as it
/// comes, and a call of condense's in it taken out).
pub(super) const MAX_ANSWER_BYTES: usize = 8 << 20;
/// Longest a stream is held back before it shows whether it starts with
/// condense's call (a long reasoning phase then reaches the client as it
/// comes, and a call after it is answered as one after text).
const MAX_HOLD: Duration = Duration::from_secs(20);
/// Longest SSE event the filter edits; past it, the rest of the stream is
/// relayed as it is.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// The result a call of the client's tools gets in a follow-up round: the
/// client got the call and runs it.
const PASSED_ON: &str = "[condense: this call went to the client, which runs it; its result comes with the next request.]";

/// The usage of the first round, set when a stream went on after it (the
/// answer's final usage then covers more than the request as prepared).
pub type FirstRound = Arc<OnceLock<Option<Usage>>>;

/// How a stream is read: the usage of earlier rounds, the client's tool
/// names, the idle timeout, and what lets it go on (None on the last
/// round).
pub(super) struct Read<'a> {
    pub extra: &'a Sum,
    pub client_tools: &'a [String],
    pub idle: Duration,
    pub rounds: Option<Box<Rounds>>,
}

/// What lets a stream go on after a round that called condense's tools.
pub(super) struct Rounds {
    pub proxy: Arc<Proxy>,
    pub format: Format,
    pub offer: Arc<Offer>,
    pub again: Again,
    /// The request the round answers.
    pub body: Bytes,
    /// How many more rounds may follow.
    pub left: usize,
    /// Characters of recalled text the prompt has room for.
    pub room: usize,
    /// The usage of every round before the next.
    pub extra: Sum,
    /// Set once the stream goes on, when this is the first round.
    pub first_round: Option<FirstRound>,
}

impl Rounds {
    /// The next round's stream, once `answer`'s calls of condense's tools
    /// are answered; None when it cannot be had (the answer then ends as
    /// it is). `shown_calls`: the client got calls of its own tools, which
    /// stay in the turn.
    async fn next(&mut self, answer: &Answer, shown_calls: bool) -> Option<BodyStream> {
        let ours = answer.ours();
        if ours.is_empty() || self.left == 0 {
            return None;
        }
        let results = self.proxy.results(&ours, &self.offer, &mut self.room).await;
        let next = match shown_calls {
            true => answer.follow_up_shown(&self.body, &results, PASSED_ON),
            false => answer.follow_up(&self.body, &results),
        }?;
        let (upstream, _) = self.proxy.endpoint(self.format.api());
        let sent = upstream
            .send(
                self.again.method.clone(),
                self.again.url.clone(),
                self.again.headers.clone(),
                Outgoing::Whole(next.clone()),
            )
            .await;
        let reply = match sent {
            Ok(r) if r.status().is_success() => Reply::from(r),
            Ok(r) => {
                tracing::warn!(status = %r.status(), "the request carrying condense's tool results failed; the answer ends without them");
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the request carrying condense's tool results failed; the answer ends without them");
                return None;
            }
        };
        if !reply.is_sse() {
            tracing::warn!(
                "the request carrying condense's tool results was not answered as a stream; the answer ends without them"
            );
            return None;
        }
        if let Some(cell) = self.first_round.take() {
            let raw = Bytes::from(answer.value.to_string());
            let _ = cell.set(JsonTap::usage_of_body(self.format.api(), &raw));
        }
        self.extra.add(answer.value.get("usage"));
        self.body = next;
        self.left -= 1;
        Some(reply.body)
    }
}

impl Proxy {
    /// Reads a stream until it tells whether it starts with one of
    /// condense's calls: if not (or on the last round), the client gets it
    /// from the start through the filter; if so, it is read to its end.
    pub(super) async fn read_stream(
        &self,
        format: Format,
        reply: Reply,
        read: Read<'_>,
    ) -> Result<Step, crate::error::ProxyError> {
        let Read {
            extra,
            client_tools,
            idle,
            rounds,
        } = read;
        let Reply {
            status,
            headers,
            mut body,
            ..
        } = reply;
        let last = rounds.is_none();
        let mut rounds = Some(rounds);
        let mut pass = |held: Bytes, body: BodyStream, mut headers: HeaderMap| {
            // The filter may change the length.
            headers.remove(http::header::CONTENT_LENGTH);
            Step::Done(Reply {
                status,
                headers,
                content_length: None,
                body: self.filtered(
                    format,
                    Reply::prefixed(held, body),
                    extra.clone(),
                    client_tools,
                    rounds.take().flatten(),
                ),
            })
        };
        if last {
            return Ok(pass(Bytes::new(), body, headers));
        }
        let mut buf = BytesMut::new();
        let mut scanned = 0;
        let mut gather = Gather::new(format.api()).with_client_tools(client_tools.to_vec());
        let mut decision = Decision::Hold;
        let hold_until = Instant::now() + MAX_HOLD;
        loop {
            // Held back (reasoning) no longer than MAX_HOLD; once it is
            // condense's call, read under the idle timeout alone.
            let wait = match decision {
                Decision::Hold => idle.min(hold_until.saturating_duration_since(Instant::now())),
                _ => idle,
            };
            let next = match tokio::time::timeout(wait, body.next()).await {
                Ok(Some(Ok(chunk))) => chunk,
                // The relay reports a failure or a stall as it does for any
                // stream: what was held goes first.
                Ok(Some(Err(e))) => {
                    let failed = futures_util::stream::once(async move { Err(e) });
                    return Ok(pass(buf.freeze(), Box::pin(failed), headers));
                }
                Err(_) => return Ok(pass(buf.freeze(), body, headers)),
                Ok(None) => break,
            };
            buf.extend_from_slice(&next);
            while let Some(end) = sse::event_end(&buf, scanned) {
                if let Some((_, data)) = sse::event_json(&buf[scanned..end]) {
                    decision = gather.event(&data);
                }
                scanned = end;
                if decision == Decision::Pass {
                    return Ok(pass(buf.freeze(), body, headers));
                }
            }
            if buf.len() > MAX_ANSWER_BYTES {
                return Ok(pass(buf.freeze(), body, headers));
            }
        }
        if let Some((_, data)) = sse::event_json(&buf[scanned..]) {
            decision = gather.event(&data);
        }
        let raw = buf.freeze();
        match (decision, gather.answer()) {
            (Decision::Ours, Some(answer)) if !answer.ours().is_empty() => Ok(Step::Ours {
                answer,
                raw,
                status,
                headers,
                sse: true,
            }),
            _ => Ok(pass(raw, Box::pin(futures_util::stream::empty()), headers)),
        }
    }

    /// `body` with each event edited by a [`Filter`]; with `rounds`, a
    /// round that ends calling condense's tools goes on with the next.
    pub(super) fn filtered(
        &self,
        format: Format,
        body: BodyStream,
        extra: Sum,
        client_tools: &[String],
        rounds: Option<Box<Rounds>>,
    ) -> BodyStream {
        let mut filter = Filter::new(format.api(), extra).with_client_tools(client_tools.to_vec());
        filter.continuable = rounds.is_some();
        let state = Edited {
            body,
            events: sse::Reader::default(),
            gather: rounds
                .is_some()
                .then(|| Gather::new(format.api()).with_client_tools(client_tools.to_vec())),
            gathered: 0,
            filter,
            held: Vec::new(),
            raw: false,
            done: false,
            metrics: self.metrics.clone(),
            outcome: match rounds.is_some() {
                true => "stripped",
                false => "limit_reached",
            },
            rounds,
            client_tools: client_tools.to_vec(),
            format,
        };
        Box::pin(futures_util::stream::unfold(state, |mut st| async move {
            if st.done {
                return None;
            }
            loop {
                match st.body.next().await {
                    Some(Ok(chunk)) if st.raw => return Some((Ok(chunk), st)),
                    Some(Ok(chunk)) => {
                        st.events.push(&chunk);
                        let mut out = Vec::new();
                        while let Some(event) = st.events.next_event() {
                            st.edit(&event, &mut out);
                        }
                        if st.events.pending() > MAX_EVENT_BYTES {
                            st.raw();
                            out.extend_from_slice(&st.events.take_rest());
                        }
                        if !out.is_empty() {
                            return Some((Ok(Bytes::from(out)), st));
                        }
                    }
                    Some(Err(e)) => {
                        st.done = true;
                        return Some((Err(e), st));
                    }
                    None => {
                        let mut out = Vec::new();
                        let rest = st.events.take_rest();
                        if !rest.is_empty() {
                            st.edit(&rest, &mut out);
                        }
                        if st.go_on().await {
                            if !out.is_empty() {
                                return Some((Ok(Bytes::from(out)), st));
                            }
                            continue;
                        }
                        st.done = true;
                        if st.filter.stripped > 0 {
                            st.metrics
                                .recalls_total
                                .with_label_values(&[st.outcome])
                                .inc_by(st.filter.stripped as u64);
                        }
                        out.append(&mut st.held);
                        return (!out.is_empty()).then(|| (Ok(Bytes::from(out)), st));
                    }
                }
            }
        }))
    }
}

/// A stream on its way through the [`Filter`].
struct Edited {
    body: BodyStream,
    /// The stream's events so far, the unfinished one held.
    events: sse::Reader,
    filter: Filter,
    /// The round's answer, gathered while another round may follow.
    gather: Option<Gather>,
    /// Bytes of events gathered this round.
    gathered: usize,
    /// The events that end the round, held until it is known whether
    /// another round follows.
    held: Vec<u8>,
    /// An event past MAX_EVENT_BYTES came: the rest goes as it is.
    raw: bool,
    done: bool,
    metrics: Arc<Metrics>,
    /// The outcome the calls taken out are counted under.
    outcome: &'static str,
    rounds: Option<Box<Rounds>>,
    client_tools: Vec<String>,
    format: Format,
}

impl Edited {
    /// One event through the filter (and into the gathered answer), into
    /// `out` or, when it ends the answer, the held events.
    fn edit(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let Some((text, mut data)) = sse::event_json(event) else {
            // Chat's `[DONE]` ends the answer too.
            match self.filter.continuable && sse::data_of(event).as_deref() == Some(b"[DONE]") {
                true => self.held.extend_from_slice(event),
                false => out.extend_from_slice(event),
            }
            return;
        };
        if let Some(gather) = self.gather.as_mut() {
            self.gathered += event.len();
            match self.gathered > MAX_ANSWER_BYTES {
                true => self.gather = None,
                false => {
                    gather.event(&data);
                }
            }
        }
        match self.filter.event(&mut data) {
            Edit::Keep => out.extend_from_slice(event),
            Edit::Drop => {}
            Edit::Changed => {
                out.extend_from_slice(&sse::rebuild_event(text, data.to_string().as_bytes()))
            }
            Edit::Hold => self
                .held
                .extend_from_slice(&sse::rebuild_event(text, data.to_string().as_bytes())),
        }
    }

    /// Past an event too long to edit, the rest goes as it is: no round
    /// follows.
    fn raw(&mut self) {
        self.raw = true;
        self.gather = None;
        self.rounds = None;
        self.filter.continuable = false;
    }

    /// At the end of a round: whether the answer goes on with the next
    /// (the held end then goes, and the next round's events come).
    async fn go_on(&mut self) -> bool {
        if self.filter.stripped == 0 || self.held.is_empty() {
            return false;
        }
        let Some(mut rounds) = self.rounds.take() else {
            return false;
        };
        let Some(answer) = self.gather.take().and_then(Gather::answer) else {
            return false;
        };
        let Some(next) = rounds.next(&answer, self.filter.client_calls()).await else {
            self.outcome = "failed";
            return false;
        };
        self.body = next;
        self.events = sse::Reader::default();
        self.held.clear();
        self.gathered = 0;
        self.filter.next_round(rounds.extra.clone());
        let more = rounds.left > 0;
        self.filter.continuable = more;
        self.outcome = if more { "stripped" } else { "limit_reached" };
        if more {
            self.gather =
                Some(Gather::new(self.format.api()).with_client_tools(self.client_tools.clone()));
            self.rounds = Some(rounds);
        }
        true
    }
}
