//! A compact byte-pair counter: the counts of tiktoken's `count_ordinary`,
//! from tables about a seventh of the size.
//!
//! `tiktoken_rs::CoreBPE` keeps each encoding's vocabulary three times
//! (encoder, decoder, sorted copy), every token in an allocation of its own:
//! 42 MB for o200k_base, most of condense's memory at rest. Counting needs
//! only one direction. This keeps every token's bytes in one buffer, by
//! rank, and a table from a hash of a token's bytes to its rank (each hit
//! checked against the bytes): about 6 MB. The vocabulary is read out of a
//! `CoreBPE` once and that is dropped (see `Encoding::counter`).
//!
//! Counting is tiktoken's algorithm: the text split by the encoding's
//! pattern, each piece one token when it is one, else its bytes merged pair
//! by pair, always the lowest-ranked adjacent pair first (the leftmost of
//! equal ones), until no adjacent pair is a token. The tests compare every
//! count with `CoreBPE::count_ordinary`.
//!
//! The split runs as a lazy DFA rather than tiktoken's backtracking
//! matcher (about 40% of a cold count): see `Split` for how its one
//! look-ahead is written without one.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};

use regex_automata::meta::Regex;
use regex_automata::{Anchored, Input};
use xxhash_rust::xxh3::xxh3_64;

use crate::cache::PreHashed;

type Rank = u32;

/// A rank no pair has: the pair is not a token.
const NONE: Rank = Rank::MAX;

/// Pieces at least this long are merged with a heap (tiktoken switches at
/// the same length): the plain scan is quadratic in the piece's length.
const LARGE_PIECE: usize = 100;

/// An encoding's split pattern in a form a DFA runs. tiktoken's patterns
/// are alternations with one look-ahead, `\s+(?!\S)`: a run of whitespace
/// less its last character when a non-space follows. That alternative is
/// written `\s+\s` and its match cut by its last character; the ones
/// before it and after it are patterns of their own, tried in order (the
/// first that matches at a position wins, as in the alternation).
/// Possessive quantifiers are written plain: each is followed by a class
/// it shares no character with, so backtracking into it never matched
/// more. o200k's `\s+(?!\S)` also matches a run that ends the text, which
/// `\s+$` before it keeps whole.
pub struct Split {
    before: &'static str,
    after: &'static str,
}

/// The alternative cut by its last character.
const LOOK_AHEAD: &str = r"\s+\s";

/// Its pattern id: the second.
const LOOK_AHEAD_ID: usize = 1;

/// cl100k_base's pattern (tiktoken-rs's, with possessive quantifiers).
pub const CL100K: Split = Split {
    before: r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+$|\s*[\r\n]",
    after: r"\s",
};

/// o200k_base's pattern (`tiktoken_rs::O200K_BASE_PAT_STR`).
pub const O200K: Split = Split {
    before: concat!(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"|\p{N}{1,3}",
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"|\s*[\r\n]+",
        r"|\s+$",
    ),
    after: r"\s+",
};

/// Special tokens' text: in no encoding's ordinary vocabulary.
const SPECIAL: [&str; 5] = [
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|endofprompt|>",
];

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("the split pattern does not compile: {0}")]
    Pattern(#[from] Box<regex_automata::meta::BuildError>),
    #[error("two tokens share a 64-bit hash")]
    Collision,
    #[error("the vocabulary is empty")]
    Empty,
}

/// An encoding's ordinary tokens, by rank.
#[derive(Clone)]
pub struct Vocabulary {
    /// Every token's bytes, by rank.
    bytes: Vec<u8>,
    /// Rank `r`'s bytes are `bytes[starts[r]..starts[r + 1]]` (empty for a
    /// rank that is not an ordinary token).
    starts: Vec<u32>,
    /// xxh3 of a token's bytes to its rank.
    ranks: HashMap<u64, Rank, PreHashed>,
}

impl Vocabulary {
    fn token(&self, rank: Rank) -> &[u8] {
        let r = rank as usize;
        match (self.starts.get(r), self.starts.get(r + 1)) {
            (Some(&a), Some(&b)) => self.bytes.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// `core`'s ordinary tokens. Each table is allocated once, at its size.
    pub fn from_core(core: &tiktoken_rs::CoreBPE) -> Result<Vocabulary, BuildError> {
        // Ranks run from 0 with at most a few gaps (where the special
        // tokens sit); the vocabulary ends at the first long run of ranks
        // without a token.
        let ordinary = |rank: Rank| {
            core.decode_bytes(&[rank])
                .ok()
                .filter(|t| !SPECIAL.iter().any(|s| s.as_bytes() == &t[..]))
        };
        let (mut tokens, mut size, mut end, mut rank) = (0usize, 0usize, 0usize, 0);
        while (rank as usize) < end + 1024 {
            if let Some(t) = ordinary(rank) {
                tokens += 1;
                size += t.len();
                end = rank as usize + 1;
            }
            rank += 1;
        }
        if tokens == 0 {
            return Err(BuildError::Empty);
        }
        let mut bytes = Vec::with_capacity(size);
        let mut starts = Vec::with_capacity(end + 1);
        let mut ranks = HashMap::with_capacity_and_hasher(tokens, PreHashed::default());
        starts.push(0);
        for rank in 0..end as Rank {
            if let Some(t) = ordinary(rank) {
                if ranks.insert(xxh3_64(&t), rank).is_some() {
                    return Err(BuildError::Collision);
                }
                bytes.extend_from_slice(&t);
            }
            starts.push(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
        }
        Ok(Vocabulary {
            bytes,
            starts,
            ranks,
        })
    }
}

pub struct Bpe {
    /// Copies of the split pattern, one per thread slot: threads sharing
    /// one matcher wait on each other for its scratch space (tiktoken keeps
    /// copies for the same reason).
    patterns: Vec<Regex>,
    vocabulary: Vocabulary,
}

/// Copies of the split pattern kept.
const PATTERN_COPIES: usize = 16;

/// Threads given a pattern slot so far.
static SLOTS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's pattern slot: threads take them in turn.
    static SLOT: usize = SLOTS.fetch_add(1, Ordering::Relaxed);
}

impl Bpe {
    pub fn new(vocabulary: Vocabulary, split: &Split) -> Result<Bpe, BuildError> {
        let pattern =
            Regex::new_many(&[split.before, LOOK_AHEAD, split.after]).map_err(Box::new)?;
        // Each copy gets a matcher cache of its own.
        Ok(Bpe {
            patterns: vec![pattern; PATTERN_COPIES],
            vocabulary,
        })
    }

    /// This thread's copy of the split pattern.
    fn pattern(&self) -> &Regex {
        &self.patterns[SLOT.with(|s| *s) % self.patterns.len()]
    }

    /// The rank of the token whose bytes are `piece`, if there is one.
    fn rank(&self, piece: &[u8]) -> Rank {
        let v = &self.vocabulary;
        match v.ranks.get(&xxh3_64(piece)) {
            Some(&r) if v.token(r) == piece => r,
            _ => NONE,
        }
    }

    /// Tokens in `text`, special-token text counted as ordinary text.
    pub fn count(&self, text: &str) -> usize {
        let pattern = self.pattern();
        let (mut n, mut at) = (0, 0);
        while at < text.len() {
            // Every character starts a match of these patterns; were one
            // not to, the unanchored search skips it, as tiktoken's does.
            let from = Input::new(text).range(at..);
            let Some(m) = pattern
                .search(&from.clone().anchored(Anchored::Yes))
                .or_else(|| pattern.search(&from))
            else {
                break;
            };
            let mut end = m.end();
            if m.pattern().as_usize() == LOOK_AHEAD_ID {
                end -= text[..end].chars().next_back().map_or(0, char::len_utf8);
            }
            if end <= m.start() {
                // No empty match is possible; were there one, the rest
                // counts a token a byte, more than it can be.
                return n + text.len() - at;
            }
            n += self.piece_tokens(&text.as_bytes()[m.start()..end]);
            at = end;
        }
        n
    }

    fn piece_tokens(&self, piece: &[u8]) -> usize {
        if piece.len() <= 1 || self.rank(piece) != NONE {
            return usize::from(!piece.is_empty());
        }
        if piece.len() < LARGE_PIECE {
            self.merge_small(piece)
        } else {
            self.merge_large(piece)
        }
    }

    /// The merge as a scan over the parts: `parts[i]` is where part `i`
    /// starts and the rank of it joined with the next.
    fn merge_small(&self, piece: &[u8]) -> usize {
        let mut parts: Vec<(usize, Rank)> = (0..piece.len() - 1)
            .map(|i| (i, self.rank(&piece[i..i + 2])))
            .collect();
        parts.push((piece.len() - 1, NONE));
        parts.push((piece.len(), NONE));
        // The rank of parts i and i + 1 joined, once i + 1 and i + 2 are.
        let joined = |parts: &[(usize, Rank)], i: usize| match parts.get(i + 3) {
            Some(&(end, _)) => self.rank(&piece[parts[i].0..end]),
            None => NONE,
        };
        loop {
            let mut min = (NONE, 0);
            for (i, &(_, r)) in parts[..parts.len() - 1].iter().enumerate() {
                if r < min.0 {
                    min = (r, i);
                }
            }
            if min.0 == NONE {
                return parts.len() - 1;
            }
            let i = min.1;
            if i > 0 {
                parts[i - 1].1 = joined(&parts, i - 1);
            }
            parts[i].1 = joined(&parts, i);
            parts.remove(i + 1);
        }
    }

    /// The same merges for a long piece, with a heap of candidate pairs
    /// (lowest rank, then leftmost, first) and the parts as a linked list;
    /// a candidate whose parts changed since it was pushed is skipped.
    fn merge_large(&self, piece: &[u8]) -> usize {
        let len = piece.len();
        // Part i spans start..next[i]; prev[i] is the part before it.
        let mut next: Vec<usize> = (1..=len).collect();
        let mut prev: Vec<usize> = (0..len).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; len];
        let mut heap = BinaryHeap::new();
        for i in 0..len - 1 {
            let r = self.rank(&piece[i..i + 2]);
            if r != NONE {
                heap.push(Reverse((r, i, i + 2)));
            }
        }
        let mut parts = len;
        while let Some(Reverse((rank, i, end))) = heap.pop() {
            // Stale: part i is gone, or it or its neighbour changed.
            if !alive[i] || next[i] >= len || next[next[i]] != end {
                continue;
            }
            if self.rank(&piece[i..end]) != rank {
                continue;
            }
            let j = next[i];
            alive[j] = false;
            next[i] = end;
            if end < len {
                prev[end] = i;
            }
            parts -= 1;
            if let Some(&p) = prev.get(i).filter(|_| i > 0) {
                let r = self.rank(&piece[p..end]);
                if r != NONE {
                    heap.push(Reverse((r, p, end)));
                }
            }
            if end < len {
                let after = next[end];
                let r = self.rank(&piece[i..after]);
                if r != NONE {
                    heap.push(Reverse((r, i, after)));
                }
            }
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    fn pair() -> &'static (tiktoken_rs::CoreBPE, Bpe) {
        static P: OnceLock<(tiktoken_rs::CoreBPE, Bpe)> = OnceLock::new();
        P.get_or_init(|| {
            let core = tiktoken_rs::o200k_base().unwrap();
            let bpe = Bpe::new(Vocabulary::from_core(&core).unwrap(), &O200K).unwrap();
            (core, bpe)
        })
    }

    fn cl100k() -> &'static (tiktoken_rs::CoreBPE, Bpe) {
        static P: OnceLock<(tiktoken_rs::CoreBPE, Bpe)> = OnceLock::new();
        P.get_or_init(|| {
            let core = tiktoken_rs::cl100k_base().unwrap();
            let bpe = Bpe::new(Vocabulary::from_core(&core).unwrap(), &CL100K).unwrap();
            (core, bpe)
        })
    }

    fn same(text: &str) {
        for (core, bpe) in [pair(), cl100k()] {
            assert_eq!(bpe.count(text), core.count_ordinary(text), "{text:?}");
        }
    }

    #[test]
    fn counts_are_tiktokens() {
        for text in [
            "",
            "a",
            "Hello, world! It's a test.",
            "def f(x):\n    return x ** 2\n\n\n",
            "   leading and trailing   \n\t\r\n  ",
            "日本語のテキストと emoji 🎉👩‍👩‍👧 and zalgo z̷̢a̸l̴g̵o",
            "مرحبا بالعالم and עברית",
            "12345678901234567890 1,234.56 ٣٤٥",
            "I'LL SAY IT'S THEY'RE we've you'd",
            "<|endoftext|> <|endofprompt|> <|fim_prefix|>",
            "{\"a\": [1, 2, {\"b\": null}], \"c\": \"d\\n\"}",
            "https://example.com/path?q=1&r=two#frag /usr/local/bin",
            "\u{0}\u{fffd}\u{feff}\u{ffff}\u{10ffff}",
            // The look-ahead: runs of every kind of space, before a word,
            // before a line break, ending the text.
            "a  b   c \u{a0}\u{3000}d\u{2028} \u{85}e\u{b}\u{c} f",
            "x   ",
            "x ",
            " ",
            "  \n  \n  y  \r\n\t z \n ",
            "\t\t\u{2003}\u{2003}",
            // Case-folded contractions: the Kelvin sign and long s fold to
            // k and s.
            "IT\u{17f} it'\u{17f} \u{212a}elvin 'S 'Ll 'D'VE",
            "a/b//c\n/\r\n// ?!/\n",
        ] {
            same(text);
        }
    }

    #[test]
    fn long_pieces_merge_as_tiktoken_merges_them() {
        // Pieces of 100 bytes and more take the heap.
        let word: String = (0..3000)
            .map(|i| ["ab", "cd", "ef", "zq", "xx", "ing", "tion"][i * 7 % 13 % 7])
            .collect();
        same(&word);
        same(&"a".repeat(5000));
        same(&"é".repeat(700));
        same(&" ".repeat(3000));
        same(&"\n \t".repeat(900));
        same(&"+-*/".repeat(400));
        same(&"日本".repeat(500));
    }

    fn strings(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::String(s) => out.push(s.clone()),
            serde_json::Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
            serde_json::Value::Object(o) => o.values().for_each(|x| strings(x, out)),
            _ => {}
        }
    }

    #[test]
    #[ignore = "needs ../shared/traces beside the repository; run with `cargo test -- --ignored shared_traces`"]
    fn shared_traces_count_as_tiktoken_counts_them() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces");
        let mut texts = Vec::new();
        for sub in ["conversations", "anthropic", "responses"] {
            for entry in std::fs::read_dir(dir.join(sub)).unwrap() {
                let body = std::fs::read_to_string(entry.unwrap().path()).unwrap();
                strings(&serde_json::from_str(&body).unwrap(), &mut texts);
            }
        }
        assert!(texts.len() > 1000, "{}", texts.len());
        texts.push(texts.concat());
        for t in &texts {
            same(t);
        }
    }

    fn text() -> impl Strategy<Value = String> {
        let pieces = prop::sample::select(vec![
            " ", "  ", "\n", "\r\n", "\t", "'", "'s", "'LL", "a", "The", "tion", "é", "ß", "İ",
            "日", "本", "🎉", "\u{301}", "7", "42", "٣", ".", ",", "!?", "-", "_", "/", "\\", "\"",
            "{", "}", "x", "Z", "qu", "ing ", " the", "\u{a0}", "\u{200d}", "\u{3000}", "\u{85}",
            "\u{2028}", "\u{b}", "\u{17f}", "\u{212a}", "ǅ", "ʰ", "/", "\r",
        ]);
        prop::collection::vec(pieces, 0..60).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        #[test]
        fn random_texts_count_as_tiktoken_counts_them(t in text()) {
            for (core, bpe) in [pair(), cl100k()] {
                prop_assert_eq!(bpe.count(&t), core.count_ordinary(&t));
            }
        }

        #[test]
        fn random_long_words_count_as_tiktoken_counts_them(
            w in prop::collection::vec(prop::sample::select(vec!['a', 'b', 'e', 'n', 'r', 's', 't', 'é']), 100..400)
        ) {
            let t: String = w.into_iter().collect();
            for (core, bpe) in [pair(), cl100k()] {
                prop_assert_eq!(bpe.count(&t), core.count_ordinary(&t));
            }
        }
    }
}
