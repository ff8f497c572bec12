//! What the plan reads of one (upstream, model), as one record replicas
//! share: the calibration ([`Pair`]: observations and plan ratio) and the
//! learned windows ([`Windows`]: window, bound, floor).
//!
//! Why one record of everything: a conversation must be compacted the same
//! whichever replica serves each turn, so every value a plan decision reads
//! must be the same on every replica, and every value those values are
//! derived from too. The plan ratio follows the sequence of observations
//! (its margin is hysteresis), so the observations are shared with it, not
//! just the ratio: three replicas each seeing a third of the responses and
//! keeping a ratio each would drift apart (1.40, 1.82 and 1.40 were seen).
//! Each observation is applied to the record as one process applies it to
//! its own ([`Pair::observe`], [`Windows::accepted`]), so a session spread
//! over replicas makes the same decisions as on one.
//!
//! Ratios are stored as their bits: a decimal round trip may be off by a
//! unit in the last place, and a plan at a boundary would notice.

use serde::{Deserialize, Serialize};

use super::calibration::Pair;
use super::learned::{Stamp, Windows};

/// The record's format, stored with it: a record of another format is
/// read as none (and replaced by the next write).
const VERSION: u32 = 1;

/// What the plan reads of one (upstream, model).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shared {
    pub calibration: Pair,
    pub windows: Windows,
}

/// The stored form: short names, ratios as bits, stamps as (value, until).
#[derive(Serialize, Deserialize)]
struct Wire {
    v: u32,
    /// Observations, oldest first: (ratio bits, raw estimate).
    o: Vec<(u64, u64)>,
    /// The plan ratio's bits.
    p: Option<u64>,
    w: Option<(u64, u64)>,
    b: Option<(u64, u64)>,
    a: Option<(u64, u64)>,
}

fn stamp(s: Option<Stamp>) -> Option<(u64, u64)> {
    s.map(|s| (s.value, s.until))
}

fn unstamp(s: Option<(u64, u64)>) -> Option<Stamp> {
    s.map(|(value, until)| Stamp { value, until })
}

impl Shared {
    /// The stored form (the same record always gives the same text).
    pub fn encode(&self) -> String {
        let w = Wire {
            v: VERSION,
            o: self
                .calibration
                .observations
                .iter()
                .map(|(r, e)| (r.to_bits(), *e))
                .collect(),
            p: self.calibration.plan.map(f64::to_bits),
            w: stamp(self.windows.window),
            b: stamp(self.windows.bound),
            a: stamp(self.windows.accepted),
        };
        serde_json::to_string(&w).unwrap_or_default()
    }

    /// A stored record; None for one of another format, or not one.
    pub fn decode(text: &str) -> Option<Shared> {
        let w: Wire = serde_json::from_str(text).ok()?;
        if w.v != VERSION {
            return None;
        }
        let calibration = Pair {
            observations: w
                .o
                .into_iter()
                .map(|(r, e)| (f64::from_bits(r), e))
                .collect(),
            plan: w.p.map(f64::from_bits),
        }
        .bounded();
        Some(Shared {
            calibration,
            windows: Windows {
                window: unstamp(w.w),
                bound: unstamp(w.b),
                accepted: unstamp(w.a),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::calibration::{Calibration, PLAN_MARGIN, WINDOW};
    use std::time::Duration;

    /// One response of a session: (reported, raw estimate).
    fn session() -> Vec<(u64, u64)> {
        // A provider at about 1.4 raw tokens per condense token, drifting
        // with the content mix, then moving to about 1.8 (a large
        // whitespace-heavy result, say) and back.
        let mut s = Vec::new();
        for i in 0..40u64 {
            let estimate = 500 + 311 * i;
            let ratio = match i {
                0..=12 => 1.36 + (i % 5) as f64 * 0.02,
                13..=25 => 1.75 + (i % 3) as f64 * 0.04,
                _ => 1.38 + (i % 4) as f64 * 0.03,
            };
            s.push(((estimate as f64 * ratio).round() as u64, estimate));
        }
        s
    }

    #[test]
    fn a_record_reads_back_as_it_was_written_bit_for_bit() {
        let mut s = Shared::default();
        for (reported, estimate) in session() {
            s.calibration.observe(reported, estimate);
        }
        s.windows.learn(8192, Duration::from_secs(3600), 1_000);
        s.windows.bound(6000, 1_000);
        s.windows.accepted(5000, Duration::from_secs(3600), 1_000);
        let text = s.encode();
        let back = Shared::decode(&text).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.encode(), text, "the same record, the same text");
        for ((a, _), (b, _)) in back
            .calibration
            .observations
            .iter()
            .zip(&s.calibration.observations)
        {
            assert_eq!(a.to_bits(), b.to_bits());
        }
        assert_eq!(Shared::decode("not json"), None);
        assert_eq!(Shared::decode(&text.replace("\"v\":1", "\"v\":2")), None);
    }

    #[test]
    fn a_foreign_record_cannot_make_this_process_hold_more_or_plan_with_nonsense() {
        let many: Vec<String> = (0..100)
            .map(|_| format!("[{},1000]", f64::NAN.to_bits()))
            .collect();
        let text = format!(
            r#"{{"v":1,"o":[{}],"p":{},"w":null,"b":null,"a":null}}"#,
            many.join(","),
            1e9f64.to_bits()
        );
        let s = Shared::decode(&text).unwrap();
        assert_eq!(s.calibration.observations.len(), WINDOW);
        assert!(s.calibration.observations.iter().all(|o| o.0 == 1.0));
        assert_eq!(s.calibration.plan, Some(2.5));
    }

    /// Replicas that read the record, apply an observation and write it
    /// back, turn after turn, plan exactly as one process does with its own
    /// calibration; replicas that each keep their own do not.
    #[test]
    fn replicas_sharing_the_record_plan_as_one_process_does() {
        let one = Calibration::default();
        let mut stored: Option<String> = None;
        let own: Vec<Calibration> = (0..3).map(|_| Calibration::default()).collect();
        let mut plans_one = Vec::new();
        let mut plans_shared = Vec::new();
        let mut plans_own = Vec::new();
        for (turn, (reported, estimate)) in session().into_iter().enumerate() {
            let replica = turn % 3;
            // Each turn is planned with the ratio known before its response.
            plans_one.push(one.ratios("u", "m").plan);
            let mut s = stored
                .as_deref()
                .and_then(Shared::decode)
                .unwrap_or_default();
            plans_shared.push(s.calibration.ratios().plan);
            plans_own.push(own[replica].ratios("u", "m").plan);
            one.observe("u", "m", reported, estimate);
            s.calibration.observe(reported, estimate);
            stored = Some(s.encode());
            own[replica].observe("u", "m", reported, estimate);
        }
        let bits = |v: &[f64]| v.iter().map(|p| p.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plans_shared), bits(&plans_one));
        assert!(
            plans_one.windows(2).filter(|w| w[0] != w[1]).count() >= 2,
            "the session moves the plan: {plans_one:?}"
        );
        assert_ne!(
            bits(&plans_own),
            bits(&plans_one),
            "replicas on their own plan differently"
        );
        // And the plan moved only beyond the margin.
        for w in plans_one.windows(2).filter(|w| w[0] != w[1]) {
            let drift = w[1] / w[0];
            assert!(
                !(1.0 / (1.0 + PLAN_MARGIN)..=1.0 + PLAN_MARGIN).contains(&drift) || w[0] == 1.0,
                "{w:?}"
            );
        }
    }

    #[test]
    fn calibration_and_the_shared_record_agree_on_what_they_keep() {
        let c = Calibration::default();
        let key = crate::tokens::pair_key("u", "m");
        for (reported, estimate) in session() {
            c.observe("u", "m", reported, estimate);
        }
        let mut s = Shared {
            calibration: c.pair(key),
            ..Shared::default()
        };
        assert_eq!(s.calibration.observations.len(), WINDOW);
        // Set as another process's record, it is this one's.
        let other = Calibration::default();
        other.set(key, s.calibration.clone());
        assert_eq!(other.ratios("u", "m"), c.ratios("u", "m"));
        // Unused observations change nothing.
        let before = s.clone();
        assert!(!s.calibration.observe(10, 20));
        assert!(!s.calibration.observe(0, 2000));
        assert_eq!(s, before);
    }
}
