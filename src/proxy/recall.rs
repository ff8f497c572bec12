//! Recall: the calls the model makes to condense's own tools
//! (`condense_recall`, `compress_context`) answered inside the client's
//! request. The model's turn and the results are appended to the request
//! and it goes upstream again, at most `compaction.max_recalls` times; the
//! client receives one answer, with the usage of every round.
//!
//! A JSON answer is read whole; the text of a round that called condense's
//! tools comes before the final round's, as one message. A stream is held
//! back only until it tells whether it starts with one of condense's calls;
//! once through, a later call goes on in the same stream (`stream.rs`).
//! When a follow-up request fails, or the limit is reached, the client gets
//! the answer it would have got, without condense's calls.

mod stream;

pub use stream::FirstRound;
use stream::{MAX_ANSWER_BYTES, Read, Rounds};

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderMap, Method};

use super::Proxy;
use super::read::BodyStream;
use super::respond::Reply;
use crate::error::ProxyError;
use crate::recall::store::{AgentPoint, Originals};
use crate::upstream::{Outgoing, UpstreamResponse};
use crate::wire::Format;
use crate::wire::tap::{JsonTap, SseTap};
use crate::wire::tools::{Answer, COMPRESS_TOOL, Call, RECALL_TOOL};
use crate::wire::usage::{Sum, Usage};

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
#[derive(Clone)]
pub struct Again {
    pub method: Method,
    pub url: http::Uri,
    pub headers: HeaderMap,
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
    /// Set when a stream that went out may go on after its first round:
    /// then that round's usage, once it did.
    pub continued: Option<FirstRound>,
}

impl Proxy {
    /// The answer for the client, with condense's calls answered.
    pub(super) async fn answer_tools(
        self: &Arc<Self>,
        format: Format,
        offer: Offer,
        sent: Bytes,
        resp: UpstreamResponse,
        again: Again,
    ) -> Result<Answered, ProxyError> {
        let (upstream, _) = self.endpoint(format.api());
        let max = self.compaction.max_recalls;
        // Told apart from condense's when a name is streamed in pieces.
        let client_tools = crate::wire::tools::client_tool_names(&sent);
        let offer = Arc::new(offer);
        let mut extra = Sum::default();
        let mut first_round = None;
        let mut continued = None;
        // JSON rounds answered, whose text comes before the final one's.
        let mut earlier: Vec<Answer> = Vec::new();
        let mut body = sent;
        let mut reply = Reply::from(resp);
        let mut room = offer.room_chars;
        let mut round = 0;
        loop {
            let last = round >= max;
            round += 1;
            let step = match reply.is_sse() {
                true => {
                    // What lets the stream go on after text went out.
                    let rounds = (!last).then(|| {
                        let cell = (round == 1).then(FirstRound::default);
                        continued.clone_from(&cell);
                        Box::new(Rounds {
                            proxy: self.clone(),
                            format,
                            offer: offer.clone(),
                            again: again.clone(),
                            body: body.clone(),
                            left: (max - round + 1) as usize,
                            room,
                            extra: extra.clone(),
                            first_round: cell,
                        })
                    });
                    let read = Read {
                        extra: &extra,
                        client_tools: &client_tools,
                        idle: upstream.idle_timeout(),
                        rounds,
                    };
                    self.read_stream(format, reply, read).await
                }
                false => {
                    let read = (&extra, earlier.as_slice());
                    read_json(format, reply, read, upstream.idle_timeout()).await
                }
            };
            let (answer, raw, status, headers, sse) = match step? {
                Step::Done(reply) => {
                    return Ok(Answered {
                        reply,
                        first_round,
                        continued,
                    });
                }
                Step::Ours {
                    answer,
                    raw,
                    status,
                    headers,
                    sse,
                } => (answer, raw, status, headers, sse),
            };
            // A stream that did not go out does not go on.
            continued = None;
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
                            None,
                        ),
                    },
                    false => Reply::whole(
                        status,
                        headers.clone(),
                        answer.clone().after(&earlier).for_client(extra),
                    ),
                }
            };
            if last {
                return Ok(Answered {
                    reply: fallback("limit_reached", &extra),
                    first_round,
                    continued,
                });
            }
            let results = self.results(&answer.ours(), &offer, &mut room).await;
            let Some(next) = answer.follow_up(&body, &results) else {
                return Ok(Answered {
                    reply: fallback("failed", &extra),
                    first_round,
                    continued,
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
                    if !sse {
                        earlier.push(answer);
                    }
                }
                Ok(r) => {
                    tracing::warn!(status = %r.status(), "the request carrying condense's tool results failed; answering without them");
                    return Ok(Answered {
                        reply: fallback("failed", &extra),
                        first_round,
                        continued,
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the request carrying condense's tool results failed; answering without them");
                    return Ok(Answered {
                        reply: fallback("failed", &extra),
                        first_round,
                        continued,
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
}

/// Reads a JSON answer whole (one too large, or that stalls longer than
/// `idle` between chunks, goes to the client as it is, under the relay's
/// own idle timeout).
/// `read`: the usage of the rounds before, and the JSON answers whose text
/// the client is to see before this one's.
async fn read_json(
    format: Format,
    reply: Reply,
    read: (&Sum, &[Answer]),
    idle: Duration,
) -> Result<Step, ProxyError> {
    let (extra, earlier) = read;
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
        Some(answer) if !extra.is_empty() || !earlier.is_empty() => Ok(Step::Done(Reply::whole(
            status,
            headers,
            answer.after(earlier).for_client(extra),
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
