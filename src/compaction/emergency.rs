//! `emergency`: when nothing else fits, every message but the system and
//! developer messages and the last user message keeps a shrinking share of
//! its text (head and tail), in steps, until the request fits. This is the
//! one stage allowed to shorten unconsumed tool results: a real trace has a
//! system prompt, a task and one fresh 8k-token result that together exceed
//! a 16k window. Reported as its own action.

/// The shares of each text tried, largest first.
pub const STEPS: &[f64] = &[0.5, 0.25, 0.1, 0.05, 0.0];
/// Characters every shortened text keeps at least.
pub const MIN_CHARS: usize = 64;
