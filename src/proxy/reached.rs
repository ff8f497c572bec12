//! What compaction did on a conversation's earlier turns, kept in the
//! state store so that no later turn of it undoes it.
//!
//! The replayed plan (`compaction/plan.rs`) puts each boundary where the
//! same decision, replayed over the earlier turns, puts it, in raw tokens
//! against a budget converted with the plan ratio. The boundaries stay put
//! while that ratio holds; when it moves, every earlier turn replays
//! differently. Against an upstream whose tokens per byte depend on what a
//! request holds, compaction itself moves it: a masked request holds less
//! tool output than the unmasked one, the ratio learned from it is another,
//! and at the new ratio the plan finds less (or nothing) to mask. Replayed
//! against such a provider (`condense replay --provider-count mix:3.5,8`), a
//! Codex session at 64k went from masked to unmasked and back from one turn
//! to the next: every switch loses the provider's cached prefix, and an
//! unmasked turn can overflow.
//!
//! So once a request of a conversation has been compacted, condense records
//! for the conversation the raw budget each of its requests was planned
//! against (a new pair only when it changed) and the furthest frontier one
//! reached. Every later request of it is compacted whatever its pressure,
//! each earlier turn replayed against the budget it had: the decisions made
//! then come out the same (masked results, results masked ahead of the
//! frontier, dropped turns), whatever the ratio or the window has done
//! since, and only the new turn is planned against today's budget, which
//! can move the boundaries forward and never back. A ratio that falls
//! costs nothing and does not make the conversation compacted harder than
//! it needs; one that rises is met on the turn it is learned. The frontier
//! recorded stays the least, should the budgets not replay it (pairs left
//! out past [`BUDGETS`], a store that lost them).
//!
//! Two simpler designs were measured on the replays (`mix:T,P` rules and
//! the shared traces at `chars:3.6` / `chars:3.0`): the frontier alone kept
//! the masked prefix but let dropped turns and results masked ahead come
//! back when the budget grew; a plan ratio fixed per conversation once it
//! was first compacted kept everything but compacted harder after a fall
//! (probe retention down to 0.52 from 0.60 on the Claude Code sessions at
//! 16k).
//!
//! A record is found by any replica: it is stored under
//! `reached:{scope}:{id}`, the scope being the client's credentials (one
//! tenant's conversation never steers another's) and the id a hash of the
//! messages up to the model's first answer, which branches of one
//! conversation (and reruns of one task) share. The value holds up to
//! [`ENTRIES`] entries `frontier:hash:messages=budget,...`, newest first,
//! the hash being that of the messages before the frontier, so that an
//! entry applies only to a conversation that still starts that way (one
//! the client compacted itself starts otherwise and is planned afresh).
//! Requests that cannot be at their trigger under any ratio read nothing.
//! A store that fails answers as a miss: the request is planned as without
//! a record.

use crate::chat::Message;
use crate::pipeline::{History, Reached};
use crate::recall::store::fold;
use crate::state::StateStore;

/// Entries kept under one id: branches of one conversation, or reruns of
/// one task by one client, each with its own.
pub const ENTRIES: usize = 4;
/// Budgets kept per entry, the newest (the calibration ratio moves in
/// steps of at least `tokens::calibration::PLAN_MARGIN`, so a conversation
/// sees few).
pub const BUDGETS: usize = 8;

/// A conversation's record: where it is kept, how its messages hash, and
/// what its earlier turns did (read by [`Course::read`]).
#[derive(Debug, Clone)]
pub struct Course {
    key: String,
    /// The conversation's messages (handles sharing their bytes), hashed
    /// only as far as an entry asks: a request with no record, often a
    /// large one below the trigger, hashes no more than its first turn.
    messages: Vec<Message>,
    /// What the earlier turns of this conversation did.
    pub history: Option<History>,
}

#[derive(Debug, Clone, PartialEq)]
struct Entry {
    frontier: usize,
    hash: u64,
    budgets: Vec<(usize, f64)>,
}

impl Course {
    /// The record of the conversation `messages` holds, for the client with
    /// `scope`; None before the model's first answer (nothing to compact).
    pub fn of(scope: &str, messages: &[Message]) -> Option<Course> {
        let first = messages
            .iter()
            .position(|m| m.role() == Some("assistant"))?;
        let id = prefix(&messages[..=first]);
        Some(Course {
            key: format!("reached:{scope}:{id:016x}"),
            messages: messages.to_vec(),
            history: None,
        })
    }

    /// Reads what the earlier turns did: of the entries that apply to this
    /// conversation, the one with the furthest frontier.
    pub async fn read(&mut self, store: &StateStore) {
        let entries = self.entries(store).await;
        self.history = self.applying(&entries).map(|e| History {
            budgets: e.budgets.clone(),
            frontier: e.frontier,
        });
    }

    /// Adds what this request did (`now`) to the record, when that changes
    /// it: this conversation's entry first, the other conversations' after
    /// it (the entries this one supersedes go).
    pub async fn record(&self, store: &StateStore, now: Reached) {
        if now.frontier > self.messages.len() || !(now.budget.is_finite() && now.budget > 0.0) {
            return;
        }
        let before = self.history.clone().unwrap_or_default();
        let mut budgets: Vec<(usize, f64)> = before
            .budgets
            .iter()
            .copied()
            .filter(|&(m, _)| m < now.messages)
            .collect();
        if budgets.last().is_none_or(|&(_, b)| b != now.budget) {
            budgets.push((now.messages, now.budget));
        }
        let excess = budgets.len().saturating_sub(BUDGETS);
        budgets.drain(..excess);
        let frontier = before.frontier.max(now.frontier);
        if self.history.is_some() && budgets == before.budgets && frontier == before.frontier {
            return;
        }
        let entry = Entry {
            frontier,
            hash: prefix(&self.messages[..frontier]),
            budgets,
        };
        // Read again: another replica may have written since.
        let others = self.entries(store).await;
        let kept = others
            .into_iter()
            .filter(|e| !self.applies(e))
            .take(ENTRIES - 1);
        let value: Vec<String> = std::iter::once(entry).chain(kept).map(render).collect();
        store.put(&self.key, &value.join(";")).await;
    }

    async fn entries(&self, store: &StateStore) -> Vec<Entry> {
        store
            .get(&self.key)
            .await
            .map_or_else(Vec::new, |v| parse(&v))
    }

    /// Of `entries`, the one that applies with the furthest frontier.
    fn applying<'e>(&self, entries: &'e [Entry]) -> Option<&'e Entry> {
        entries
            .iter()
            .filter(|e| self.applies(e))
            .max_by_key(|e| e.frontier)
    }

    /// Whether an entry was written by (an earlier turn of) a conversation
    /// that starts as this one does, up to the entry's frontier.
    fn applies(&self, e: &Entry) -> bool {
        e.frontier <= self.messages.len() && prefix(&self.messages[..e.frontier]) == e.hash
    }
}

/// The hash of a run of messages, as conversation points take it.
fn prefix(messages: &[Message]) -> u64 {
    fold(&messages.iter().map(Message::digest).collect::<Vec<_>>())
}

fn render(e: Entry) -> String {
    let budgets: Vec<String> = e.budgets.iter().map(|(m, b)| format!("{m}={b}")).collect();
    format!("{}:{:016x}:{}", e.frontier, e.hash, budgets.join(","))
}

/// The entries of a stored value; a malformed entry is left out.
fn parse(value: &str) -> Vec<Entry> {
    value
        .split(';')
        .filter_map(|e| {
            let mut parts = e.splitn(3, ':');
            let frontier = parts.next()?.parse().ok()?;
            let hash = u64::from_str_radix(parts.next()?, 16).ok()?;
            let budgets = parts
                .next()?
                .split(',')
                .map(|p| {
                    let (m, b) = p.split_once('=')?;
                    let b: f64 = b.parse().ok()?;
                    (b.is_finite() && b > 0.0).then_some((m.parse().ok()?, b))
                })
                .collect::<Option<Vec<(usize, f64)>>>()?;
            let ascending = budgets.windows(2).all(|w| w[0].0 < w[1].0);
            (ascending && !budgets.is_empty() && budgets.len() <= BUDGETS).then_some(Entry {
                frontier,
                hash,
                budgets,
            })
        })
        .take(ENTRIES)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use bytes::Bytes;
    use std::time::Duration;

    fn msg(s: &str) -> Message {
        Message::from_bytes(Bytes::from(s.to_string()))
    }

    fn conversation(answers: &[&str]) -> Vec<Message> {
        let mut conv = vec![
            msg(r#"{"role":"system","content":"s"}"#),
            msg(r#"{"role":"user","content":"task"}"#),
        ];
        for a in answers {
            conv.push(msg(&format!(r#"{{"role":"assistant","content":"{a}"}}"#)));
            conv.push(msg(r#"{"role":"user","content":"go on"}"#));
        }
        conv
    }

    async fn read(store: &StateStore, scope: &str, conv: &[Message]) -> Option<History> {
        let mut c = Course::of(scope, conv)?;
        c.read(store).await;
        c.history
    }

    fn reached(messages: usize, budget: f64, frontier: usize) -> Reached {
        Reached {
            messages,
            budget,
            frontier,
        }
    }

    #[tokio::test]
    async fn a_later_turn_finds_what_the_earlier_ones_did() {
        let store = StateStore::memory(1 << 20, Duration::from_secs(60));
        assert!(Course::of("s", &conversation(&[])).is_none());
        let conv = conversation(&["a", "b", "c"]);
        let at = |n: usize| Course::of("s", &conv[..n]).unwrap();
        let mut c = at(5);
        c.read(&store).await;
        assert_eq!(c.history, None);
        c.record(&store, reached(5, 1000.0, 4)).await;
        let first = History {
            budgets: vec![(5, 1000.0)],
            frontier: 4,
        };
        assert_eq!(read(&store, "s", &conv[..7]).await, Some(first.clone()));
        // Another client, or a conversation that went otherwise before the
        // frontier, finds nothing; one that went otherwise after it shares
        // what was compacted.
        assert_eq!(read(&store, "t", &conv[..7]).await, None);
        let mut other = conv.clone();
        other[3] = msg(r#"{"role":"user","content":"stop"}"#);
        assert_eq!(read(&store, "s", &other).await, None);
        let later = conversation(&["a", "x", "c"]);
        assert_eq!(read(&store, "s", &later).await, Some(first.clone()));
        // The same budget and frontier again change nothing; a new budget
        // is added from the request it was planned for on; a request seen
        // again replaces what it recorded before.
        let mut c = at(7);
        c.read(&store).await;
        c.record(&store, reached(7, 1000.0, 4)).await;
        assert_eq!(read(&store, "s", &conv).await, Some(first));
        c.record(&store, reached(7, 1250.0, 6)).await;
        let later = History {
            budgets: vec![(5, 1000.0), (7, 1250.0)],
            frontier: 6,
        };
        assert_eq!(read(&store, "s", &conv).await, Some(later.clone()));
        let mut c = at(7);
        c.read(&store).await;
        c.record(&store, reached(7, 900.0, 4)).await;
        let again = History {
            budgets: vec![(5, 1000.0), (7, 900.0)],
            frontier: 6,
        };
        assert_eq!(read(&store, "s", &conv).await, Some(again));
        // Only the newest budgets are kept.
        let mut c = Course::of("s", &conv).unwrap();
        for m in 0..2 * BUDGETS {
            c.read(&store).await;
            c.record(&store, reached(9 + m, 2000.0 + m as f64, 6)).await;
        }
        let kept = read(&store, "s", &conv).await.unwrap().budgets;
        assert_eq!(kept.len(), BUDGETS);
        assert_eq!(
            kept.last(),
            Some(&(8 + 2 * BUDGETS, 1999.0 + (2 * BUDGETS) as f64))
        );
    }

    #[tokio::test]
    async fn branches_of_one_conversation_keep_their_own_entries() {
        let store = StateStore::memory(1 << 20, Duration::from_secs(60));
        let branches: Vec<Vec<Message>> = ["x", "y", "z", "w", "v"]
            .iter()
            .map(|b| conversation(&["a", b, "c"]))
            .collect();
        for (i, b) in branches.iter().enumerate() {
            let mut c = Course::of("s", b).unwrap();
            c.read(&store).await;
            c.record(&store, reached(8, 1000.0 + i as f64, 6)).await;
        }
        // The last ENTRIES branches keep theirs; the oldest made way.
        assert_eq!(read(&store, "s", &branches[0]).await, None);
        for (i, b) in branches.iter().enumerate().skip(1) {
            let h = read(&store, "s", b).await.unwrap();
            assert_eq!(h.budgets, vec![(8, 1000.0 + i as f64)]);
        }
        // A store that holds nonsense is no record.
        let key = Course::of("s", &branches[0]).unwrap().key;
        store
            .put(&key, "garbage;7:zz:1=1;3:0:5=NaN;3:0:;3:0:9=1,4=2")
            .await;
        assert_eq!(parse("garbage;7:zz:1=1;3:0:5=NaN;3:0:;3:0:9=1,4=2"), vec![]);
        assert_eq!(read(&store, "s", &branches[0]).await, None);
    }
}
