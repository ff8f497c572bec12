//! `fit`: no single tool result or tool-call argument string may take more
//! than `compaction.fit_share` (30%) of the budget; one that does keeps its
//! head and tail up to that share. A 40k-token file dump would otherwise
//! crowd out the rest of the conversation on its own.

/// The size in tokens a message over the limit is cut to.
pub fn limit(budget: f64, share: f64) -> f64 {
    budget * share
}
