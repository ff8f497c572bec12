//! Recall: the calls the model makes to condense's own tools
//! (`condense_recall`, `compress_context`) answered inside the client's
//! request. The model's turn and the results are appended to the request
//! and it goes upstream again, at most `compaction.max_recalls` times; the
//! client receives only the final answer, with the usage of every round.
//!
//! A JSON answer is read whole. A stream is held back only until it tells
//! whether it starts with one of condense's calls (reasoning is held,
//! text or a call of the client's tools lets it through); once through, a
//! call of condense's tools that comes later is taken out of what the
//! client sees (counted as `stripped`), since text already went out. When
//! a follow-up request fails, or the limit is reached, the client gets the
//! answer it would have got, without condense's calls.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderMap, Method};

use super::Proxy;
use super::read::BodyStream;
use super::respond::Reply;
use crate::error::ProxyError;
use crate::recall::store::{AgentPoint, Originals};
use crate::upstream::{Outgoing, Upstream, UpstreamResponse};
use crate::wire::Format;
use crate::wire::sse;
use crate::wire::stream::{Decision, Edit, Filter, Gather};
use crate::wire::tap::{JsonTap, SseTap};
use crate::wire::tools::{Answer, COMPRESS_TOOL, Call, RECALL_TOOL};
use crate::wire::usage::{Sum, Usage};

/// Largest answer read for condense's calls (a larger one is relayed as it
/// comes).
const MAX_ANSWER_BYTES: usize = 8 << 20;
/// Longest a stream is held back before it shows whether it starts with
/// condense's call (a long reasoning phase then reaches the client as it
/// comes, and a call after it is taken out).
const MAX_HOLD: Duration = Duration::from_secs(20);
/// Longest SSE event the filter edits; past it, the rest of the stream is
/// relayed as it is.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// What a request was offered, and what answers the offer.
pub struct Offer {
    pub originals: Originals,
    /// Characters of recalled text the prompt has room for.
    pub room_chars: usize,
    /// Where this request's conversation stands, recorded when the model
    /// calls `compress_context`.
    pub point: Option<AgentPoint>,
}

/// Where the follow-up requests go.
pub struct Again {
    pub method: Method,
    pub url: http::Uri,
    pub headers: HeaderMap,
}

/// How a stream is read: the usage of earlier rounds, the client's tool
/// names, whether this is the last round, the idle timeout.
struct Read<'a> {
    extra: &'a Sum,
    client_tools: &'a [String],
    last: bool,
    idle: Duration,
}

/// One upstream answer, read as far as needed.
enum Step {
    /// The answer for the client.
    Done(Reply),
    /// The answer calls condense's tools; `raw` is all of it.
    Ours {
        answer: Answer,
        raw: Bytes,
        status: http::StatusCode,
        headers: HeaderMap,
        sse: bool,
    },
}

/// The answer for the client once condense's calls are answered.
pub struct Answered {
    pub reply: Reply,
    /// Set when the model called condense's tools: the usage of the first
    /// round (what the request as prepared cost), if it could be read.
    /// Calibration must not read the final answer's then.
    pub first_round: Option<Option<Usage>>,
}

impl Proxy {
    /// The answer for the client, with condense's calls answered.
    pub(super) async fn answer_tools(
        &self,
        format: Format,
        offer: Offer,
        sent: Bytes,
        resp: UpstreamResponse,
        again: Again,
        upstream: &Upstream,
    ) -> Result<Answered, ProxyError> {
        let max = self.compaction.max_recalls;
        // Told apart from condense's when a name is streamed in pieces.
        let client_tools = crate::wire::tools::client_tool_names(&sent);
        let mut extra = Sum::default();
        let mut first_round = None;
        let mut body = sent;
        let mut reply = Reply::from(resp);
        let mut room = offer.room_chars;
        let mut round = 0;
        loop {
            let last = round >= max;
            round += 1;
            let step = match reply.is_sse() {
                true => {
                    let read = Read {
                        extra: &extra,
                        client_tools: &client_tools,
                        last,
                        idle: upstream.idle_timeout(),
                    };
                    self.read_stream(format, reply, read).await
                }
                false => read_json(format, reply, &extra, upstream.idle_timeout()).await,
            };
            let (answer, raw, status, headers, sse) = match step? {
                Step::Done(reply) => return Ok(Answered { reply, first_round }),
                Step::Ours {
                    answer,
                    raw,
                    status,
                    headers,
                    sse,
                } => (answer, raw, status, headers, sse),
            };
            if round == 1 {
                first_round = Some(usage_of(format, &raw, sse));
            }
            // What the client gets if this round is the last.
            // (A stream's filter counts the calls it takes out itself.)
            let fallback = |outcome: &'static str, extra: &Sum| {
                if !sse {
                    self.metrics
                        .recalls_total
                        .with_label_values(&[outcome])
                        .inc_by(answer.ours().len() as u64);
                }
                match sse {
                    true => Reply {
                        status,
                        headers: {
                            let mut h = headers.clone();
                            h.remove(http::header::CONTENT_LENGTH);
                            h
                        },
                        content_length: None,
                        body: self.filtered(
                            format,
                            Reply::prefixed(raw.clone(), Box::pin(futures_util::stream::empty())),
                            extra.clone(),
                            &client_tools,
                            outcome,
                        ),
                    },
                    false => {
                        Reply::whole(status, headers.clone(), answer.clone().for_client(extra))
                    }
                }
            };
            if last {
                return Ok(Answered {
                    reply: fallback("limit_reached", &extra),
                    first_round,
                });
            }
            let results = self.results(&answer.ours(), &offer, &mut room).await;
            let Some(next) = answer.follow_up(&body, &results) else {
                return Ok(Answered {
                    reply: fallback("failed", &extra),
                    first_round,
                });
            };
            let sent = upstream
                .send(
                    again.method.clone(),
                    again.url.clone(),
                    again.headers.clone(),
                    Outgoing::Whole(next.clone()),
                )
                .await;
            match sent {
                Ok(r) if r.status().is_success() => {
                    extra.add(answer.value.get("usage"));
                    reply = Reply::from(r);
                    body = next;
                }
                Ok(r) => {
                    tracing::warn!(status = %r.status(), "the request carrying condense's tool results failed; answering without them");
                    return Ok(Answered {
                        reply: fallback("failed", &extra),
                        first_round,
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the request carrying condense's tool results failed; answering without them");
                    return Ok(Answered {
                        reply: fallback("failed", &extra),
                        first_round,
                    });
                }
            }
        }
    }

    /// The result of each of condense's calls, the recalled texts sharing
    /// the room left (which shrinks by what they take).
    async fn results(
        &self,
        calls: &[Call],
        offer: &Offer,
        room: &mut usize,
    ) -> Vec<(String, String)> {
        let mut out = Vec::with_capacity(calls.len());
        let share = (*room / calls.len().max(1)).max(1000);
        for call in calls {
            let text = match call.name.as_str() {
                RECALL_TOOL => {
                    let key = call.argument.as_deref().unwrap_or("").trim();
                    match offer.originals.get(&self.recall_state, key).await {
                        Some(original) => {
                            let text = crate::recall::read::read(&original, key, &call.part, share);
                            *room = room.saturating_sub(text.len());
                            self.metrics
                                .recalls_total
                                .with_label_values(&["answered"])
                                .inc();
                            self.metrics.recalled_bytes_total.inc_by(text.len() as u64);
                            text
                        }
                        None => {
                            self.metrics
                                .recalls_total
                                .with_label_values(&["unknown_key"])
                                .inc();
                            format!(
                                "[condense: nothing is stored under recall key {key:?}: it is not a key condense gave, or it expired. Go on without it.]"
                            )
                        }
                    }
                }
                COMPRESS_TOOL => {
                    if let Some(point) = &offer.point {
                        point.record(&self.recall_state).await;
                    }
                    self.metrics
                        .agent_compactions_total
                        .with_label_values(&["requested"])
                        .inc();
                    "[condense: noted; the conversation up to here will be compacted from the next request on.]".to_string()
                }
                _ => continue,
            };
            out.push((call.id.clone(), text));
        }
        out
    }

    /// Reads a stream until it tells whether it starts with one of
    /// condense's calls: if not (or on the last round), the client gets it
    /// from the start through the filter; if so, it is read to its end.
    async fn read_stream(
        &self,
        format: Format,
        reply: Reply,
        read: Read<'_>,
    ) -> Result<Step, ProxyError> {
        let Read {
            extra,
            client_tools,
            last,
            idle,
        } = read;
        let Reply {
            status,
            headers,
            mut body,
            ..
        } = reply;
        let pass = |held: Bytes, body: BodyStream, mut headers: HeaderMap| {
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
                    if last { "limit_reached" } else { "stripped" },
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

    /// `body` with each event edited by a [`Filter`]; the calls it takes
    /// out are counted under `outcome`.
    fn filtered(
        &self,
        format: Format,
        body: BodyStream,
        extra: Sum,
        client_tools: &[String],
        outcome: &'static str,
    ) -> BodyStream {
        let state = Edited {
            body,
            events: sse::Reader::default(),
            filter: Filter::new(format.api(), extra).with_client_tools(client_tools.to_vec()),
            raw: false,
            done: false,
            metrics: self.metrics.clone(),
            outcome,
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
                            edit(&event, &mut st.filter, &mut out);
                        }
                        if st.events.pending() > MAX_EVENT_BYTES {
                            st.raw = true;
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
                        st.done = true;
                        let mut out = Vec::new();
                        let rest = st.events.take_rest();
                        if !rest.is_empty() {
                            edit(&rest, &mut st.filter, &mut out);
                        }
                        if st.filter.stripped > 0 {
                            st.metrics
                                .recalls_total
                                .with_label_values(&[st.outcome])
                                .inc_by(st.filter.stripped as u64);
                        }
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
    /// An event past MAX_EVENT_BYTES came: the rest goes as it is.
    raw: bool,
    done: bool,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// The outcome the calls taken out are counted under.
    outcome: &'static str,
}

/// Reads a JSON answer whole (one too large, or that stalls longer than
/// `idle` between chunks, goes to the client as it is, under the relay's
/// own idle timeout).
async fn read_json(
    format: Format,
    reply: Reply,
    extra: &Sum,
    idle: Duration,
) -> Result<Step, ProxyError> {
    let Reply {
        status,
        headers,
        mut body,
        content_length,
    } = reply;
    let mut buf = BytesMut::new();
    // What was read goes first, then the rest (or the failure) as it comes.
    let pass = |held: BytesMut, rest: BodyStream| {
        Ok(Step::Done(Reply {
            status,
            headers: headers.clone(),
            content_length,
            body: Reply::prefixed(held.freeze(), rest),
        }))
    };
    loop {
        match tokio::time::timeout(idle, body.next()).await {
            Ok(Some(Ok(chunk))) => buf.extend_from_slice(&chunk),
            Ok(Some(Err(e))) => {
                return pass(
                    buf,
                    Box::pin(futures_util::stream::once(async move { Err(e) })),
                );
            }
            Ok(None) => break,
            Err(_) => return pass(buf, body),
        }
        if buf.len() > MAX_ANSWER_BYTES {
            return pass(buf, body);
        }
    }
    let raw = buf.freeze();
    let answer = Answer::parse(format.api(), &raw);
    match answer {
        Some(answer) if !answer.ours().is_empty() => Ok(Step::Ours {
            answer,
            raw,
            status,
            headers,
            sse: false,
        }),
        Some(answer) if !extra.is_empty() => Ok(Step::Done(Reply::whole(
            status,
            headers,
            answer.for_client(extra),
        ))),
        _ => Ok(Step::Done(Reply::whole(status, headers, raw))),
    }
}

/// The usage an answer reports, as the calibration reads it.
fn usage_of(format: Format, raw: &Bytes, sse: bool) -> Option<Usage> {
    if sse {
        SseTap::usage_of_stream(format.api(), raw)
    } else {
        JsonTap::usage_of_body(format.api(), raw)
    }
}

/// One event through the filter, into `out`.
fn edit(event: &[u8], filter: &mut Filter, out: &mut Vec<u8>) {
    let Some((text, mut data)) = sse::event_json(event) else {
        out.extend_from_slice(event);
        return;
    };
    match filter.event(&mut data) {
        Edit::Keep => out.extend_from_slice(event),
        Edit::Drop => {}
        Edit::Changed => {
            out.extend_from_slice(&sse::rebuild_event(text, data.to_string().as_bytes()))
        }
    }
}
