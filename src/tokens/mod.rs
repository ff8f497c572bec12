//! Token accounting: how full the model's context is, fast and calibrated.
//!
//! - `encoding`: the tokenizers, built once per process.
//! - `count`: the counting rules for a request (messages, tools, images).
//! - `image`: OpenAI's tile rule for image parts.
//! - `cache`: per-message counts under a hash of the message's bytes.
//! - `calibration`: the upstream's count relative to ours, per model.
//! - `models`: profiles, the windows upstreams list, and which window
//!   applies.
//! - `learned`: windows learned from overflow errors, their floors and
//!   expiry.
//! - `shared`: both of those for one pair as the record replicas share.
//! - `budget`: the prompt budget and the pressure on it.

pub mod bpe;
pub mod budget;
pub mod cache;
pub mod calibration;
pub mod count;
pub mod encoding;
pub mod image;
mod key;
pub mod learned;
pub mod models;
pub mod shared;

use std::sync::{Arc, OnceLock};

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

pub use budget::Budget;
pub use encoding::Encoding;
pub use key::{key_of, pair_key};
pub use models::{Correction, ModelInfo, WindowSource};

use crate::chat::{ChatRequest, Message};
use crate::compaction::memo::Memo;
use crate::config::{Config, ModelProfile};
use crate::metrics::Metrics;
use cache::CountCache;
use calibration::{Calibration, Ratios};
use learned::Learned;
use models::Listings;
use shared::Shared;

/// Bytes of masked message forms remembered across requests.
const MEMO_BYTES: usize = 16 * 1024 * 1024;
/// The least share of the window an overflow's retry keeps in reserve
/// (`tokens.reserve_ratio` when that is larger). A generated Messages turn
/// whose retry was cut to a 5% reserve was rejected again, its count 6%
/// over; 15% fixed it but cost a Claude Code session 0.010 stability at
/// 32k (chars:3.0: its retry's deeper frontier stays), 10% gained it 0.008
/// and moved no other replay.
pub const RETRY_RESERVE: f64 = 0.10;

/// Cache keys of messages, and of tool schemas apart from them.
const MESSAGES_DOMAIN: u64 = 0;
const TOOLS_DOMAIN: u64 = 0x5bd1_e995_0000_0001;

/// The count cache's key for bytes whose xxh3 is `digest`: every path that
/// reads or fills the cache takes its key here, so they cannot disagree.
fn cache_key(digest: u64, enc: Encoding, domain: u64) -> u64 {
    digest ^ enc.salt() ^ domain
}

/// A message's count with a density floor: no less than its `bytes` at
/// `density` raw tokens per byte (see `Correction::density`).
pub fn floored(count: u64, bytes: usize, density: f64) -> u64 {
    count.max((bytes as f64 * density).ceil() as u64)
}

/// A request's raw (uncalibrated) token count, per part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Count {
    pub per_message: Vec<u64>,
    pub tools: u64,
    pub total: u64,
}

/// Everything condense knows about a request's size before compacting it.
#[derive(Debug, Clone, Serialize)]
pub struct Assessment {
    pub model: String,
    pub encoding: &'static str,
    pub window_source: &'static str,
    #[serde(flatten)]
    pub budget: Budget,
    pub trigger: f64,
    pub target: f64,
    /// The observed calibration ratio: `tokens` is the raw count times it.
    pub calibration_ratio: f64,
    /// The ratio compaction plans with (see `calibration`): `pressure` is
    /// the raw count times it over the budget.
    pub plan_ratio: f64,
    /// The raw count per part; None when the request took the cheap path.
    #[serde(skip)]
    pub count: Option<Count>,
    pub tokens_raw: Option<u64>,
    /// The calibrated estimate (on the cheap path: cached counts of the
    /// messages seen before, the others at the conversation's tokens per
    /// byte; see [`TokenService::estimate_cached`]).
    pub tokens: u64,
    pub pressure: f64,
    /// True when the request was judged far below the trigger from its byte
    /// length alone and not tokenized.
    pub cheap_path: bool,
}

/// Token accounting and the per-message caches that make it cheap: counts
/// under a hash of each message, and (for the compaction stages) masked
/// forms of old messages.
pub struct TokenService {
    cache: CountCache,
    /// Per-message transforms of the compaction stages, remembered across
    /// requests (bounded in bytes).
    pub memo: Memo,
    pub calibration: Calibration,
    pub listings: Listings,
    /// Windows learned from context-overflow errors.
    pub learned: Learned,
    profiles: Vec<ModelProfile>,
    /// Which profile each model name seen lately matched (an index into
    /// `profiles`): matching walks every profile's pattern, and a request
    /// asks for its model's more than once.
    matched: crate::cache::Bounded<String, Option<usize>>,
    config: Arc<Config>,
}

/// Bytes of messages not counted before from which counting them is worth
/// a thread.
const PARALLEL_COUNT_BYTES: usize = 64 * 1024;

/// The cores this process may use, read once (the standard library reads
/// the cgroup's quota from files on every call).
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Bytes of model names whose matched profile is remembered.
const MATCHED_BYTES: u64 = 1 << 20;

impl TokenService {
    pub fn new(config: Arc<Config>, metrics: &Metrics) -> TokenService {
        TokenService {
            cache: CountCache::new(
                config.tokens.cache_entries,
                metrics.token_cache_hits_total.clone(),
                metrics.token_cache_misses_total.clone(),
            ),
            memo: Memo::new(MEMO_BYTES),
            calibration: Calibration::default(),
            listings: Listings::default(),
            learned: Learned::new(
                config.tokens.min_learned_window,
                std::time::Duration::from_secs(config.tokens.learned_window_ttl_seconds),
            ),
            profiles: config.models.clone(),
            matched: crate::cache::Bounded::new(4096, MATCHED_BYTES, |k, _| k.len() as u64 + 32),
            config,
        }
    }

    /// The profile `model` matches, if any.
    fn profile(&self, model: &str) -> Option<&ModelProfile> {
        let index = match self.matched.get(model) {
            Some(i) => i,
            None => {
                let i = models::best_profile_index(&self.profiles, model);
                self.matched.insert(model.to_string(), i);
                i
            }
        };
        index.and_then(|i| self.profiles.get(i))
    }

    /// The window, encoding and thresholds for a model on an upstream, by
    /// what this process learned.
    pub fn model_info(&self, upstream: &str, model: &str) -> ModelInfo {
        // One key for the three lookups.
        let key = pair_key(upstream, model);
        let learned = self.learned.window_keyed(key);
        self.model_info_with(upstream, model, key, learned, None)
    }

    /// [`TokenService::model_info`] by what the replicas learned: the
    /// learned window and the calibration of `shared`, the record read
    /// from the state store.
    pub fn model_info_shared(&self, upstream: &str, model: &str, shared: &Shared) -> ModelInfo {
        let key = pair_key(upstream, model);
        let learned = if shared.windows.learned_any() {
            shared.windows.window(self.learned.min(), learned::now_ms())
        } else {
            None
        };
        let ratios = shared.calibration.ratios();
        self.model_info_with(upstream, model, key, learned, Some(ratios))
    }

    /// What this process knows of the pair with this [`pair_key`], as the
    /// record replicas share.
    pub fn local_record(&self, key: u64) -> Shared {
        Shared {
            calibration: self.calibration.pair(key),
            windows: self.learned.windows(key),
        }
    }

    /// Takes the replicas' record of the pair as this process's own (what
    /// it falls back to when the store fails).
    pub fn adopt(&self, key: u64, shared: &Shared) {
        self.calibration.set(key, shared.calibration.clone());
        self.learned.set(key, shared.windows);
    }

    /// Changes this process's record of the pair with this [`pair_key`]
    /// (in process, what an overflow error teaches).
    pub fn change(&self, key: u64, change: &dyn Fn(&mut Shared, u64)) {
        let mut record = self.local_record(key);
        change(&mut record, learned::now_ms());
        self.adopt(key, &record);
    }

    fn model_info_with(
        &self,
        upstream: &str,
        model: &str,
        key: u64,
        learned: Option<u64>,
        ratios: Option<Ratios>,
    ) -> ModelInfo {
        let profile = self.profile(model);
        let listed = self.listings.window_keyed(upstream, key);
        let (window, source) = match (listed, profile) {
            (Some(l), Some(p)) if p.context_window < l => (p.context_window, WindowSource::Profile),
            (Some(l), _) => (l, WindowSource::Listing),
            (None, Some(p)) => (p.context_window, WindowSource::Profile),
            (None, None) => (self.config.default_context_window, WindowSource::Default),
        };
        let (window, source) = match learned {
            Some(learned) if learned < window => (learned, WindowSource::Overflow),
            _ => (window, source),
        };
        let (trigger, target) = self.config.thresholds(profile);
        ModelInfo {
            window,
            source,
            encoding: profile
                .and_then(|p| p.encoding)
                .unwrap_or_else(|| Encoding::for_model(model)),
            trigger,
            target,
            correction: None,
            ratios,
        }
    }

    /// The tokens of a `tools` list (counted once per distinct list).
    pub fn tools_tokens(&self, raw: &[u8], enc: Encoding) -> u64 {
        self.cached(raw, enc, TOOLS_DOMAIN, || count::tools_tokens(enc, raw))
    }

    /// The raw token count of a request; only messages not seen before are
    /// tokenized.
    pub fn count(&self, req: &ChatRequest, enc: Encoding) -> Count {
        let per_message = self.message_counts(req.messages(), enc);
        let tools: u64 = ["tools", "functions"]
            .iter()
            .filter_map(|k| req.field(k))
            .map(|raw| self.tools_tokens(raw, enc))
            .sum();
        let total = count::REPLY_PRIMING + per_message.iter().sum::<u64>() + tools;
        Count {
            per_message,
            tools,
            total,
        }
    }

    /// Bytes of the request's messages whose counts are not cached: the work
    /// a count of it would do.
    pub fn uncached_bytes(&self, req: &ChatRequest, enc: Encoding) -> usize {
        req.messages()
            .iter()
            .filter(|m| {
                !self
                    .cache
                    .contains(cache_key(m.digest(), enc, MESSAGES_DOMAIN))
            })
            .map(|m| m.raw().len())
            .sum()
    }

    /// A request's raw count from what the cache holds, without tokenizing.
    /// After a response, condense counts the body it sent off the request
    /// path, so on the next turn of a conversation only the new messages
    /// are not in the cache; they are estimated at the density (tokens per
    /// byte) of the messages that are, or at bytes / 4 when none are.
    /// The second value says whether every part was cached: the estimate
    /// is then the exact count.
    pub fn estimate_cached(&self, req: &ChatRequest, enc: Encoding) -> (u64, bool) {
        let messages = req
            .messages()
            .iter()
            .map(|m| (m.raw(), cache_key(m.digest(), enc, MESSAGES_DOMAIN)));
        let tools = ["tools", "functions"]
            .iter()
            .filter_map(|k| req.field(k))
            .map(|raw| (raw, cache_key(xxh3_64(raw), enc, TOOLS_DOMAIN)));
        let (mut known, mut known_bytes, mut unknown_bytes) = (0u64, 0usize, 0usize);
        for (raw, key) in messages.chain(tools) {
            match self.cache.peek(key) {
                Some(n) => {
                    known += n;
                    known_bytes += raw.len();
                }
                None => unknown_bytes += raw.len(),
            }
        }
        let density = if known_bytes > 0 {
            known as f64 / known_bytes as f64
        } else {
            0.25
        };
        let estimate =
            count::REPLY_PRIMING + known + (unknown_bytes as f64 * density).ceil() as u64;
        (estimate, unknown_bytes == 0)
    }

    /// Tokens of each message, from the cache for those seen before. When
    /// the others are many bytes (a conversation new to this process), they
    /// are tokenized on as many threads as there are cores, in groups of
    /// about equal bytes.
    fn message_counts(&self, messages: &[Message], enc: Encoding) -> Vec<u64> {
        let keys: Vec<u64> = messages
            .iter()
            .map(|m| cache_key(m.digest(), enc, MESSAGES_DOMAIN))
            .collect();
        let mut counts: Vec<Option<u64>> = keys.iter().map(|&k| self.cache.hit(k)).collect();
        let missing: Vec<usize> = (0..messages.len())
            .filter(|&i| counts[i].is_none())
            .collect();
        let bytes: usize = missing.iter().map(|&i| messages[i].raw().len()).sum();
        let threads = match bytes / PARALLEL_COUNT_BYTES {
            0 | 1 => 1,
            n => cores().min(n),
        };
        let count = |i: usize| {
            let raw = messages[i].raw();
            (
                i,
                self.cache
                    .get_or_insert_with(keys[i], || count::message_tokens(enc, raw)),
            )
        };
        let counted: Vec<(usize, u64)> = if threads < 2 {
            missing.iter().map(|&i| count(i)).collect()
        } else {
            let share = bytes.div_ceil(threads);
            let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
            let mut filled = 0;
            for &i in &missing {
                if filled >= share {
                    groups.push(Vec::new());
                    filled = 0;
                }
                filled += messages[i].raw().len();
                if let Some(g) = groups.last_mut() {
                    g.push(i);
                }
            }
            std::thread::scope(|s| {
                let others: Vec<_> = groups[1..]
                    .iter()
                    .map(|g| s.spawn(|| g.iter().map(|&i| count(i)).collect::<Vec<_>>()))
                    .collect();
                let mut all: Vec<(usize, u64)> = groups[0].iter().map(|&i| count(i)).collect();
                for t in others {
                    // A thread that panicked leaves its messages to the
                    // loop below.
                    all.extend(t.join().unwrap_or_default());
                }
                all
            })
        };
        for (i, n) in counted {
            counts[i] = Some(n);
        }
        counts
            .into_iter()
            .enumerate()
            .map(|(i, n)| n.unwrap_or_else(|| count(i).1))
            .collect()
    }

    /// Tokens of one message, from the cache when it was seen before.
    pub fn message_tokens(&self, raw: &[u8], enc: Encoding) -> u64 {
        self.cached(raw, enc, MESSAGES_DOMAIN, || {
            count::message_tokens(enc, raw)
        })
    }

    fn cached(&self, raw: &[u8], enc: Encoding, domain: u64, f: impl FnOnce() -> u64) -> u64 {
        self.cache
            .get_or_insert_with(cache_key(xxh3_64(raw), enc, domain), f)
    }

    /// Measures a request against its model's budget. With `allow_cheap`, a
    /// request whose byte length proves it far below the trigger is not
    /// tokenized (see [`upper_bound`]).
    pub fn assess(
        &self,
        upstream: &str,
        req: &ChatRequest,
        body: &[u8],
        allow_cheap: bool,
    ) -> Assessment {
        let model = req.model().unwrap_or_default();
        let info = self.model_info(upstream, &model);
        self.assess_as(upstream, &model, info, req, body, allow_cheap)
    }

    /// The prompt budget of `req` for a model with `info`.
    fn budget(&self, info: &ModelInfo, req: &ChatRequest) -> Budget {
        // A retry after an overflow keeps a larger reserve: its count is
        // corrected by one observation of a whole body, and what the cut
        // leaves may be denser, as the provider counts, than what it took.
        let reserve = match &info.correction {
            Some(_) => self.config.tokens.reserve_ratio.max(RETRY_RESERVE),
            None => self.config.tokens.reserve_ratio,
        };
        let correction = info.correction.clone().unwrap_or_default();
        let mut budget = Budget::new(
            info.window,
            correction.completion.or(req.max_completion_tokens()),
            self.config.tokens.default_completion_tokens,
            reserve,
        );
        if let Some(cap) = correction.prompt_budget {
            budget.prompt_budget = budget.prompt_budget.min(cap.max(1));
        }
        budget
    }

    /// Whether `req` (whose body is `body`) could be at its trigger under
    /// any calibration ratio: false for a request so far below it that not
    /// even the largest ratio would put its bytes' upper bound there. Such
    /// a request was never compacted at any ratio, nor was any shorter
    /// request of its conversation, so nothing about it needs looking up.
    pub fn may_reach_trigger(&self, info: &ModelInfo, req: &ChatRequest, body: &[u8]) -> bool {
        let budget = self.budget(info, req);
        upper_bound(body) as f64 * calibration::MAX_RATIO
            >= info.trigger * budget.prompt_budget as f64
    }

    /// [`TokenService::assess`] with the model name and its window, encoding
    /// and thresholds given (offline tools override them).
    pub fn assess_as(
        &self,
        upstream: &str,
        model: &str,
        info: ModelInfo,
        req: &ChatRequest,
        body: &[u8],
        allow_cheap: bool,
    ) -> Assessment {
        let model = model.to_string();
        let correction = info.correction.clone().unwrap_or_default();
        let budget = self.budget(&info, req);
        // A retry after an overflow measures with the ratio its correction
        // gives, for the report and the plan alike.
        let ratios = match correction.ratio {
            Some(r) => Ratios {
                observed: r,
                plan: r,
            },
            None => match &info.ratios {
                Some(shared) => shared.clone(),
                None => self.calibration.ratios(upstream, &model),
            },
        };
        let cheap = allow_cheap
            && info.correction.is_none()
            && (upper_bound(body) as f64 * ratios.observed.max(ratios.plan))
                < info.trigger * budget.prompt_budget as f64;
        let (count, raw, exact) = if cheap {
            let (raw, exact) = self.estimate_cached(req, info.encoding);
            (None, raw, exact)
        } else {
            let mut c = self.count(req, info.encoding);
            // A retry's density floor (see `Correction::density`) counts
            // here as in the compaction that follows.
            if let Some(d) = correction.density {
                let fixed = c.total - c.per_message.iter().sum::<u64>();
                for (n, m) in c.per_message.iter_mut().zip(req.messages()) {
                    *n = floored(*n, m.raw().len(), d);
                }
                c.total = fixed + c.per_message.iter().sum::<u64>();
            }
            let t = c.total;
            (Some(c), t, true)
        };
        Assessment {
            encoding: info.encoding.name(),
            window_source: match info.source {
                WindowSource::Listing => "listing",
                WindowSource::Profile => "profile",
                WindowSource::Default => "default",
                WindowSource::Override => "override",
                WindowSource::Overflow => "overflow",
            },
            model,
            trigger: info.trigger,
            target: info.target,
            calibration_ratio: ratios.observed,
            plan_ratio: ratios.plan,
            // On the cheap path too when the cache held every message: the
            // response then calibrates without counting anything again.
            tokens_raw: exact.then_some(raw),
            count,
            pressure: budget.pressure((raw as f64 * ratios.plan).round() as u64),
            budget,
            tokens: (raw as f64 * ratios.observed).round() as u64,
            cheap_path: cheap,
        }
    }
}

/// The raw count of a request without the cache: what [`TokenService::count`]
/// must always equal.
pub fn count_request(req: &ChatRequest, enc: Encoding) -> u64 {
    let messages: u64 = req
        .messages()
        .iter()
        .map(|m| count::message_tokens(enc, m.raw()))
        .sum();
    let tools: u64 = ["tools", "functions"]
        .iter()
        .filter_map(|k| req.field(k))
        .map(|raw| count::tools_tokens(enc, raw))
        .sum();
    count::REPLY_PRIMING + messages + tools
}

/// An upper bound on a request's token count from its bytes alone: every
/// token of text is at least one byte of JSON, every message's overhead is
/// smaller than its JSON punctuation, and the only things that cost more
/// tokens than bytes are images (at most [`image::MAX_IMAGE_TOKENS`] each)
/// and the fixed framing of tool schemas.
pub fn upper_bound(body: &[u8]) -> u64 {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    // Built once: building a searcher costs as much as searching a small
    // request.
    static IMAGES: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"image_url\""));
    static FUNCTIONS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"function\""));
    // Two vectorized searches: cheaper than one pass for both keys.
    let images = IMAGES.find_iter(body).count() as u64;
    let functions = FUNCTIONS.find_iter(body).count() as u64;
    body.len() as u64 + images * image::MAX_IMAGE_TOKENS + functions * 16 + 64
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn a_key_is_the_hash_of_its_parts_joined_whatever_their_length() {
        let bytes: Vec<u8> = (0..700u32).map(|i| (i * 31 % 251) as u8).collect();
        for len in [0, 1, 17, 128, 240, 241, 255, 256, 257, 400, 700] {
            let whole = key_of(&[&bytes[..len]]);
            for cut in [0, len / 3, len / 2, len] {
                let (a, b) = bytes[..len].split_at(cut);
                assert_eq!(key_of(&[a, &[], b]), whole, "len {len} cut {cut}");
            }
        }
        // Different bytes, different keys.
        assert_ne!(key_of(&[b"up", b"model"]), key_of(&[b"up", b"model2"]));
        assert_ne!(key_of(&[&bytes[..256]]), key_of(&[&bytes[..257]]));
    }

    fn service(config: Config) -> (TokenService, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new().unwrap());
        (TokenService::new(Arc::new(config), &metrics), metrics)
    }

    fn request(json: &str) -> ChatRequest {
        ChatRequest::parse(&Bytes::copy_from_slice(json.as_bytes())).unwrap()
    }

    #[test]
    fn a_large_new_conversation_counts_the_same_on_several_threads() {
        let (svc, metrics) = service(Config::default());
        let messages: Vec<String> = (0..120)
            .map(|i| {
                let text: String = (0..40 + i % 9)
                    .map(|l| format!("line {l} of file {i}: let x_{l} = f({l}); // ok\\n"))
                    .collect();
                format!(r#"{{"role":"tool","tool_call_id":"c{i}","content":"{text}"}}"#)
            })
            .collect();
        let body = format!(
            r#"{{"model":"gpt-4o","messages":[{}]}}"#,
            messages.join(",")
        );
        assert!(body.len() > 2 * PARALLEL_COUNT_BYTES, "{}", body.len());
        let req = request(&body);
        let counted = svc.count(&req, Encoding::O200k);
        assert_eq!(counted.total, count_request(&req, Encoding::O200k));
        // Each count is its own message's, in order.
        let each: Vec<u64> = req
            .messages()
            .iter()
            .map(|m| count::message_tokens(Encoding::O200k, m.raw()))
            .collect();
        assert_eq!(counted.per_message, each);
        assert!(each.windows(2).any(|w| w[0] != w[1]));
        assert_eq!(metrics.token_cache_misses_total.get(), 120);
        // Every count went into the cache: the next time is all hits.
        assert_eq!(svc.count(&req, Encoding::O200k).total, counted.total);
        assert_eq!(metrics.token_cache_hits_total.get(), 120);
    }

    #[test]
    fn resending_history_tokenizes_only_the_new_message() {
        let (svc, metrics) = service(Config::default());
        let first = request(
            r#"{"model":"gpt-4o","messages":[{"role":"system","content":"sys"},{"role":"user","content":"one"}]}"#,
        );
        svc.count(&first, Encoding::O200k);
        assert_eq!(metrics.token_cache_misses_total.get(), 2);
        let second = request(
            r#"{"model":"gpt-4o","messages":[{"role":"system","content":"sys"},{"role":"user","content":"one"},{"role":"assistant","content":"two"}]}"#,
        );
        let c = svc.count(&second, Encoding::O200k);
        assert_eq!(metrics.token_cache_misses_total.get(), 3);
        assert_eq!(metrics.token_cache_hits_total.get(), 2);
        assert_eq!(c.per_message.len(), 3);
        assert_eq!(c.total, 3 + c.per_message.iter().sum::<u64>());
    }

    #[test]
    fn window_precedence_listing_profile_default() {
        let (svc, _) = service(Config::default());
        assert_eq!(svc.model_info("u", "gpt-4o").window, 128_000);
        assert_eq!(
            svc.model_info("u", "unknown-model").source,
            WindowSource::Default
        );
        assert_eq!(svc.model_info("u", "unknown-model").window, 32_768);
        svc.listings.learn("u", br#"{"data":[{"id":"unknown-model","max_model_len":65536},{"id":"gpt-4o","context_length":16384},{"id":"claude-x","context_length":1000000}]}"#);
        assert_eq!(svc.model_info("u", "unknown-model").window, 65_536);
        // A listing smaller than the profile wins; a larger one does not.
        assert_eq!(svc.model_info("u", "gpt-4o").window, 16_384);
        assert_eq!(svc.model_info("u", "claude-x").window, 200_000);
        assert_eq!(svc.model_info("other", "unknown-model").window, 32_768);
    }

    #[test]
    fn cheap_path_only_far_below_the_trigger() {
        let (svc, metrics) = service(Config::default());
        let small = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
        let a = svc.assess("u", &request(small), small.as_bytes(), true);
        assert!(a.cheap_path && a.count.is_none());
        assert_eq!(metrics.token_cache_misses_total.get(), 0);
        let a = svc.assess("u", &request(small), small.as_bytes(), false);
        assert!(!a.cheap_path && a.tokens_raw.is_some());
        // A body whose bytes could exceed the trigger is counted.
        let big = format!(
            r#"{{"model":"gpt-4","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "word ".repeat(2000)
        );
        let a = svc.assess("u", &request(&big), big.as_bytes(), true);
        assert!(!a.cheap_path);
        assert!(a.pressure > 0.2, "{}", a.pressure);
    }

    #[test]
    fn bound_exceeds_the_count() {
        let (svc, _) = service(Config::default());
        let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"string"}}}}}]}"#;
        let c = svc.count(&request(body), Encoding::O200k);
        assert!(
            upper_bound(body.as_bytes()) >= c.total,
            "{} < {}",
            upper_bound(body.as_bytes()),
            c.total
        );
    }

    #[test]
    fn the_bound_counts_each_key_where_it_occurs() {
        let with = |images: u64, functions: u64, len: usize| {
            len as u64 + images * image::MAX_IMAGE_TOKENS + functions * 16 + 64
        };
        for (body, images, functions) in [
            (r#"{"image_url":1,"function":2,"function":3}"#, 1, 2),
            (r#""image_url"function""#, 1, 1),
            (r#"\"image_url\" function image_url"#, 0, 0),
            ("", 0, 0),
        ] {
            assert_eq!(
                upper_bound(body.as_bytes()),
                with(images, functions, body.len()),
                "{body}"
            );
        }
    }
}
