//! The two common strategies a replay compares condense with.

use crate::chat::Message;
use crate::compaction::Counter;
use crate::compaction::conversation::Analysis;
use crate::compaction::text::with_string_field;

/// Baseline: drop the oldest units (a call with its results) after the
/// system messages until the request fits; the last user message stays.
pub(super) fn drop_oldest(
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
pub(super) fn last_10_results(messages: &[Message], tokens: u64, trigger: f64) -> Vec<Message> {
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
