//! What a replay reports: per turn, per strategy, per conversation and
//! over a suite, and its rendering as text.

use serde::{Deserialize, Serialize};

/// A fact an agent needs later: its exact text and where it first appears.
#[derive(Debug, Clone, Deserialize)]
pub struct Probe {
    pub text: String,
    pub first_message_index: usize,
    #[serde(default)]
    pub kind: Option<String>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Strategy {
    pub tokens: u64,
    pub stability: f64,
    pub uncached: u64,
    pub retention: Option<f64>,
    /// Probes present, or in an original a recall key in the prompt gives
    /// back (the baselines have no keys: their retention).
    pub recoverable: Option<f64>,
    /// Retention over the probes the agent used again (quoted in a later
    /// assistant message or tool call); None before any.
    pub reused: Option<f64>,
    /// The same, counting probes a recall key gives back.
    pub reused_recoverable: Option<f64>,
    pub fits: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Turn {
    pub turn: usize,
    pub messages: usize,
    pub tokens_before: u64,
    /// condense's calibrated estimate of the turn as the client sent it
    /// (`x-condense-tokens-before`): the raw count times the ratio it had
    /// learned by then.
    pub estimate: Option<u64>,
    /// The status the client got.
    pub status: u16,
    pub actions: String,
    /// Probes condense lost on this turn (present in the uncompacted turn).
    pub lost: Vec<String>,
    /// Of those, the ones no recall key in the request gives back either.
    pub unrecoverable: Vec<String>,
    pub condense: Strategy,
    pub drop_oldest: Strategy,
    pub last_10_results: Strategy,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Totals {
    pub tokens_sent: u64,
    pub uncached_tokens: u64,
    /// Token-weighted over all turns.
    pub prefix_stability: f64,
    /// The prefix stability had nothing sent before been rewritten: one
    /// less the tokens of the messages each turn's client request added,
    /// as this strategy sent them, over the tokens sent. What is left
    /// between it and `prefix_stability` is what rewrites cost.
    pub stability_ceiling: f64,
    /// Mean over turns that had probes.
    pub probe_retention: Option<f64>,
    /// The same, counting probes a recall key in the prompt gives back.
    pub recoverable_retention: Option<f64>,
    /// Probe retention over the probes the agent used again: mean over
    /// turns that had one.
    pub reused_retention: Option<f64>,
    /// The same, counting probes a recall key in the prompt gives back.
    pub reused_recoverable: Option<f64>,
    pub turns_not_fit: usize,
    /// What the rewrites cost, by what changed first in the request that
    /// rewrote; they add up to `stability_ceiling - prefix_stability`.
    pub rewrites: Rewrites,
}

/// The tokens a strategy sent again although it had sent them before
/// (uncached, and not new in the client's request), as shares of all the
/// tokens it sent, by the first message of the request that differed
/// from the one before. Where stability goes, and so which knob to turn.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Rewrites {
    /// The strategy's first rewrite (for condense, its first compaction):
    /// whatever the strategy, a request near the window is rewritten once.
    pub first: f64,
    /// A message sent whole before went out cut: masked, or shortened.
    pub cut: f64,
    /// A digest or checkpoint came or changed, or a message went while
    /// the request holds one: old turns were dropped.
    pub dropped: f64,
    /// A message sent cut before went out whole again.
    pub restored: f64,
    /// A message sent cut before went out cut differently.
    pub recut: f64,
    /// Anything else, such as a message dropped with no stand-in anywhere
    /// (the baseline that drops the oldest messages).
    pub other: f64,
}

impl Rewrites {
    fn add(&mut self, o: &Rewrites) {
        self.first += o.first;
        self.cut += o.cut;
        self.dropped += o.dropped;
        self.restored += o.restored;
        self.recut += o.recut;
        self.other += o.other;
    }

    fn scaled(self, by: f64) -> Rewrites {
        Rewrites {
            first: self.first * by,
            cut: self.cut * by,
            dropped: self.dropped * by,
            restored: self.restored * by,
            recut: self.recut * by,
            other: self.other * by,
        }
    }
}

/// What the summarizer did over a replay (`--upstream`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct SummaryStats {
    /// Summarizer calls made.
    pub calls: u32,
    /// Turns that reused a stored checkpoint.
    pub reused: u32,
    /// Turns that needed a checkpoint and fell back to mechanical drops.
    pub fallbacks: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// The simulated provider of a replay, and what it saw.
#[derive(Debug, Clone, Serialize)]
pub struct ProviderReport {
    /// Its counting rule (`o200k`, `chars:3.6`, ...).
    pub count: String,
    /// The window it enforced.
    pub window: u64,
    /// Requests it rejected for their length.
    pub rejections: usize,
    /// The calibration ratio condense had learned at the end.
    pub calibration_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub window: u64,
    pub prompt_budget: u64,
    pub provider: ProviderReport,
    pub turns: Vec<Turn>,
    pub condense: Totals,
    pub drop_oldest: Totals,
    pub last_10_results: Totals,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summarizer: Option<SummaryStats>,
}

/// One conversation's totals, in a replay of several.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    pub conversation: String,
    pub model: String,
    pub window: u64,
    pub prompt_budget: u64,
    pub turns: usize,
    pub provider: ProviderReport,
    pub condense: Totals,
    pub drop_oldest: Totals,
    pub last_10_results: Totals,
}

impl Overview {
    pub fn of(conversation: String, r: Report) -> Overview {
        Overview {
            conversation,
            model: r.model,
            window: r.window,
            prompt_budget: r.prompt_budget,
            turns: r.turns.len(),
            provider: r.provider,
            condense: r.condense,
            drop_oldest: r.drop_oldest,
            last_10_results: r.last_10_results,
        }
    }
}

/// Each strategy over all the conversations of a [`Suite`].
#[derive(Debug, Clone, Serialize)]
pub struct Overall {
    pub condense: Totals,
    pub drop_oldest: Totals,
    pub last_10_results: Totals,
}

/// Several conversations replayed with the same settings: each one's
/// totals, and over all of them tokens and turns summed, prefix stability
/// and probe retention averaged (each conversation counts once, whatever
/// its length, so one long conversation cannot hide the others).
#[derive(Debug, Clone, Serialize)]
pub struct Suite {
    pub conversations: Vec<Overview>,
    pub all: Overall,
}

impl Suite {
    pub fn of(conversations: Vec<Overview>) -> Suite {
        let all = Overall {
            condense: mean(conversations.iter().map(|c| &c.condense)),
            drop_oldest: mean(conversations.iter().map(|c| &c.drop_oldest)),
            last_10_results: mean(conversations.iter().map(|c| &c.last_10_results)),
        };
        Suite { conversations, all }
    }
}

/// Tokens and turns summed, stability and retention averaged.
fn mean<'a>(totals: impl Iterator<Item = &'a Totals>) -> Totals {
    let (mut out, mut n, mut kept, mut with_probes) = (Totals::default(), 0, 0.0, 0);
    let mut recoverable = 0.0;
    let (mut reused, mut reused_recoverable, mut with_reused) = (0.0, 0.0, 0);
    for t in totals {
        out.tokens_sent += t.tokens_sent;
        out.uncached_tokens += t.uncached_tokens;
        out.turns_not_fit += t.turns_not_fit;
        out.prefix_stability += t.prefix_stability;
        out.stability_ceiling += t.stability_ceiling;
        out.rewrites.add(&t.rewrites);
        n += 1;
        if let Some(r) = t.probe_retention {
            kept += r;
            recoverable += t.recoverable_retention.unwrap_or(r);
            with_probes += 1;
        }
        if let Some(r) = t.reused_retention {
            reused += r;
            reused_recoverable += t.reused_recoverable.unwrap_or(r);
            with_reused += 1;
        }
    }
    if n > 0 {
        out.prefix_stability /= n as f64;
        out.stability_ceiling /= n as f64;
        out.rewrites = out.rewrites.scaled(1.0 / n as f64);
    }
    out.probe_retention = (with_probes > 0).then(|| kept / with_probes as f64);
    out.recoverable_retention = (with_probes > 0).then(|| recoverable / with_probes as f64);
    out.reused_retention = (with_reused > 0).then(|| reused / with_reused as f64);
    out.reused_recoverable = (with_reused > 0).then(|| reused_recoverable / with_reused as f64);
    out
}

/// The report as a table for people.
pub fn render(r: &Report) -> String {
    let mut s = format!(
        "model {}  window {}  prompt budget {}\n\n",
        r.model, r.window, r.prompt_budget
    );
    s.push_str("turn  msgs   before  condense  stab  keep  fit | drop_old  stab  keep  fit | last_10  stab  keep  fit | actions\n");
    let pct = |x: Option<f64>| x.map_or("   -".to_string(), |v| format!("{:>4.0}%", v * 100.0));
    let yn = |b: bool| if b { "yes" } else { " NO" };
    for t in &r.turns {
        s.push_str(&format!(
            "{:>4} {:>5} {:>8} {:>9} {:>5.2} {} {} | {:>8} {:>5.2} {} {} | {:>7} {:>5.2} {} {} | {}\n",
            t.turn,
            t.messages,
            t.tokens_before,
            t.condense.tokens,
            t.condense.stability,
            pct(t.condense.retention),
            yn(t.condense.fits),
            t.drop_oldest.tokens,
            t.drop_oldest.stability,
            pct(t.drop_oldest.retention),
            yn(t.drop_oldest.fits),
            t.last_10_results.tokens,
            t.last_10_results.stability,
            pct(t.last_10_results.retention),
            yn(t.last_10_results.fits),
            t.actions
        ));
    }
    s.push('\n');
    strategies(&mut s, &r.condense, &r.drop_oldest, &r.last_10_results);
    s.push_str(&provider_line(&r.provider));
    if let Some(st) = &r.summarizer {
        s.push_str(&format!(
            "\nsummarizer: {} calls ({} prompt + {} completion tokens), {} turns reused a stored checkpoint, {} fell back to drops\n",
            st.calls, st.prompt_tokens, st.completion_tokens, st.reused, st.fallbacks
        ));
    }
    s
}

/// One line on the provider.
fn provider_line(p: &ProviderReport) -> String {
    format!(
        "provider: counts {}, window {}; {} requests rejected for their length; calibration ratio learned {:.3}\n",
        p.count, p.window, p.rejections, p.calibration_ratio
    )
}

/// The strategies' totals as a table.
fn strategies(s: &mut String, condense: &Totals, drop_oldest: &Totals, last_10: &Totals) {
    s.push_str(
        "strategy          tokens sent  uncached  prefix stability  ceiling  probe retention  recoverable  reused  reused rec.  turns not fit\n",
    );
    let num = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.3}"));
    for (name, t) in [
        ("condense", condense),
        ("drop_oldest", drop_oldest),
        ("last_10_results", last_10),
    ] {
        s.push_str(&format!(
            "{:<17} {:>11} {:>9} {:>17.3} {:>8.3} {:>16} {:>12} {:>7} {:>12} {:>14}\n",
            name,
            t.tokens_sent,
            t.uncached_tokens,
            t.prefix_stability,
            t.stability_ceiling,
            num(t.probe_retention),
            num(t.recoverable_retention),
            num(t.reused_retention),
            num(t.reused_recoverable),
            t.turns_not_fit
        ));
    }
    let r = &condense.rewrites;
    s.push_str(&format!(
        "condense's rewrites (ceiling - stability), by what changed first: first compaction {:.4}, cut {:.4}, dropped {:.4}, restored {:.4}, cut again {:.4}, other {:.4}\n",
        r.first, r.cut, r.dropped, r.restored, r.recut, r.other
    ));
}

/// A replay of several conversations as text: each one's totals, then all.
pub fn render_suite(suite: &Suite) -> String {
    let mut s = String::new();
    for c in &suite.conversations {
        s.push_str(&format!(
            "{}  (model {}, window {}, prompt budget {}, {} turns)\n",
            c.conversation, c.model, c.window, c.prompt_budget, c.turns
        ));
        strategies(&mut s, &c.condense, &c.drop_oldest, &c.last_10_results);
        s.push_str(&provider_line(&c.provider));
        s.push('\n');
    }
    s.push_str(&format!(
        "all {} conversations (tokens and turns summed; stability and retention averaged, each conversation once)\n",
        suite.conversations.len()
    ));
    let a = &suite.all;
    strategies(&mut s, &a.condense, &a.drop_oldest, &a.last_10_results);
    s
}
