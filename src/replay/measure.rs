//! The figures of one turn: tokens, prefix stability, uncached tokens,
//! probe retention (present, or recallable by a key the request holds).

use bytes::Bytes;

use super::report::{Probe, Strategy, Totals};
use crate::chat::Message;
use crate::compaction::Counter;
use crate::compaction::text::message_text;
use crate::proxy::Proxy;
use crate::recall::store::Originals;

/// One strategy's running state across turns.
#[derive(Default)]
pub(super) struct Track {
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
    pub(super) fn turn(
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

    pub(super) fn finish(mut self) -> Totals {
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
pub(super) fn share_kept(hay: &str, probes: &[&Probe], recallable: &str) -> Option<f64> {
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
pub(super) async fn recallable(proxy: &Proxy, hay: &str) -> String {
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
pub(super) fn haystack(messages: &[Message]) -> String {
    messages
        .iter()
        .map(message_text)
        .collect::<Vec<_>>()
        .join("\n")
}
