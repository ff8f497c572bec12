//! The prompt budget and the pressure on it.
//!
//! `prompt budget = window − completion allowance − reserve`, where the
//! completion allowance is the request's `max_completion_tokens` (or
//! `max_tokens`), else `tokens.default_completion_tokens` but at most a third
//! of the window (on a 4k window, 4096 tokens kept free for an answer the
//! request did not ask for would leave no room for the prompt), and the
//! reserve is
//! `tokens.reserve_ratio` of the window (room for the provider's own framing
//! and for estimation error). `pressure = calibrated estimate / budget`.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Budget {
    pub window: u64,
    pub completion_allowance: u64,
    pub reserve: u64,
    pub prompt_budget: u64,
}

impl Budget {
    /// The budget never falls below a tenth of the window: a request whose
    /// `max_tokens` leaves less is one the upstream will judge, not one to
    /// shred into a handful of tokens.
    pub fn new(
        window: u64,
        requested_completion: Option<u64>,
        default_completion: u64,
        reserve_ratio: f64,
    ) -> Budget {
        let completion_allowance =
            requested_completion.unwrap_or(default_completion.min(window / 3));
        let reserve = (window as f64 * reserve_ratio).round() as u64;
        let floor = (window / 10).max(1);
        let prompt_budget = window
            .saturating_sub(completion_allowance)
            .saturating_sub(reserve)
            .max(floor);
        Budget {
            window,
            completion_allowance,
            reserve,
            prompt_budget,
        }
    }

    pub fn pressure(&self, calibrated_estimate: u64) -> f64 {
        calibrated_estimate as f64 / self.prompt_budget as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_with_and_without_max_tokens() {
        let b = Budget::new(128_000, None, 4096, 0.05);
        assert_eq!(
            (b.completion_allowance, b.reserve, b.prompt_budget),
            (4096, 6400, 117_504)
        );
        let b = Budget::new(128_000, Some(1000), 4096, 0.05);
        assert_eq!(b.prompt_budget, 120_600);
        assert!((b.pressure(60_300) - 0.5).abs() < 1e-9);
        // A small window keeps at most a third free for an answer of
        // unasked length.
        assert_eq!(Budget::new(4096, None, 4096, 0.05).prompt_budget, 2526);
        // max_tokens larger than the window: the floor holds.
        assert_eq!(
            Budget::new(8192, Some(100_000), 4096, 0.05).prompt_budget,
            819
        );
    }
}
