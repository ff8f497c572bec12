//! A compact byte-pair counter: the counts of tiktoken's `count_ordinary`,
//! from tables about a seventh of the size.
//!
//! `tiktoken_rs::CoreBPE` keeps each encoding's vocabulary three times
//! (encoder, decoder, sorted copy), every token in an allocation of its own:
//! 42 MB for o200k_base, most of condense's memory at rest. Counting needs
//! only one direction. This keeps every token's bytes in one buffer, by
//! rank, a table from a token's key to its rank (a short token's key is
//! its bytes; a longer one's is a hash, each hit checked against the
//! bytes), and the ranks of the two-byte tokens by their bytes: about
//! 6 MB. The vocabulary is read out of a `CoreBPE` once and that is
//! dropped (see `Encoding::counter`).
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
//!
//! One exception to tiktoken's counts, for bounded memory: a piece longer
//! than `LONG_PIECE` (a word of megabytes without a space, a run of
//! whitespace or punctuation) is merged in chunks of that length, cut at
//! character boundaries a fixed distance from its start, and their counts
//! added up. Merging it whole needs tens of bytes of scratch a byte of the
//! piece (a 12 MB word took half a gigabyte); a chunk needs at most a few
//! megabytes. The sum is the same count for the same text every time, and
//! within a few tokens a chunk of the exact one (tokens cannot span a cut,
//! so it is almost always a little more). No real text has such pieces;
//! the provider's own count decides overflow either way.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::util::pool::Pool;
use regex_automata::{Anchored, Input, MatchKind};
use xxhash_rust::xxh3::xxh3_64;

type Rank = u32;

/// A rank no pair has: the pair is not a token.
const NONE: Rank = Rank::MAX;

/// Pieces at least this long are merged with a heap (tiktoken switches at
/// the same length): the plain scan is quadratic in the piece's length.
const LARGE_PIECE: usize = 100;
const _: () = assert!(LARGE_PIECE <= u8::MAX as usize);

/// Pieces longer than this are merged in chunks of about this length (see
/// the module doc): 16 KiB, whose merge needs under 2 MB of scratch. Ranks
/// and positions in a chunk fit in 32 bits.
const LONG_PIECE: usize = 16 * 1024;
const _: () = assert!(LONG_PIECE > LARGE_PIECE && LONG_PIECE < u32::MAX as usize);

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
    Pattern(#[from] Box<regex_automata::hybrid::BuildError>),
    #[error("two tokens share a key (their 56-bit hash)")]
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
    /// A token's `key` to its rank.
    ranks: HashMap<u64, Rank, BuildHasherDefault<Mix>>,
    /// The rank of each two-byte token, by its bytes (`NONE` for a pair
    /// that is not one): most lookups are of pairs, and an index is
    /// cheaper than a hash and a comparison. 256 KB.
    pairs: Vec<Rank>,
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
        let mut ranks = HashMap::with_capacity_and_hasher(tokens, Default::default());
        let mut pairs = vec![NONE; 1 << 16];
        starts.push(0);
        for rank in 0..end as Rank {
            if let Some(t) = ordinary(rank) {
                if ranks.insert(key(&t), rank).is_some() {
                    return Err(BuildError::Collision);
                }
                if let [a, b] = t[..] {
                    pairs[pair_index(a, b)] = rank;
                }
                bytes.extend_from_slice(&t);
            }
            starts.push(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
        }
        Ok(Vocabulary {
            bytes,
            starts,
            ranks,
            pairs,
        })
    }
}

/// Pieces this long and shorter are their own key.
const SHORT: usize = 7;

/// A piece's key in `Vocabulary::ranks`. A piece of up to `SHORT` bytes is
/// its own key: its bytes, and its length in the top byte, so a hit needs
/// no comparison (most lookups are of short pieces, and a comparison is two
/// more cache misses). A longer piece's key is its xxh3 with the top byte
/// all ones, which no short key has; a hit is checked against the token.
fn key(piece: &[u8]) -> u64 {
    match piece.len() {
        len @ 0..=SHORT => {
            let mut b = [0u8; 8];
            b[..len].copy_from_slice(piece);
            b[7] = len as u8;
            u64::from_le_bytes(b)
        }
        _ => xxh3_64(piece) | 0xff << 56,
    }
}

/// The hasher for keys: a folded multiply, which spreads a short key's
/// bytes over every bit the table looks at.
#[derive(Default)]
struct Mix(u64);

impl Hasher for Mix {
    fn finish(&self) -> u64 {
        let m = u128::from(self.0) * 0x9e37_79b9_7f4a_7c15;
        (m as u64) ^ ((m >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

fn pair_index(a: u8, b: u8) -> usize {
    usize::from(a) << 8 | usize::from(b)
}

/// Whether `a` and `b` are the same bytes. Tokens are short: a loop is
/// cheaper than a call to `memcmp`.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && if a.len() > 16 {
            a == b
        } else {
            a.iter().zip(b).all(|(x, y)| x == y)
        }
}

type NewCache = Box<dyn Fn() -> Cache + Send + Sync>;

pub struct Bpe {
    /// The split: a lazy DFA run forward from each piece's start.
    split: DFA,
    /// Its scratch space, one a thread at a time.
    caches: Pool<Cache, NewCache>,
    vocabulary: Vocabulary,
}

impl Bpe {
    pub fn new(vocabulary: Vocabulary, split: &Split) -> Result<Bpe, BuildError> {
        let dfa = DFA::builder()
            .configure(DFA::config().match_kind(MatchKind::LeftmostFirst))
            .build_many(&[split.before, LOOK_AHEAD, split.after])
            .map_err(Box::new)?;
        let for_caches = dfa.clone();
        Ok(Bpe {
            split: dfa,
            caches: Pool::new(Box::new(move || for_caches.create_cache())),
            vocabulary,
        })
    }

    /// The rank of the token whose bytes are `piece`, if there is one.
    fn rank(&self, piece: &[u8]) -> Rank {
        let v = &self.vocabulary;
        if let [a, b] = *piece {
            return v.pairs.get(pair_index(a, b)).copied().unwrap_or(NONE);
        }
        match v.ranks.get(&key(piece)) {
            Some(&r) if piece.len() <= SHORT || same_bytes(v.token(r), piece) => r,
            _ => NONE,
        }
    }

    /// Tokens in `text`, special-token text counted as ordinary text.
    pub fn count(&self, text: &str) -> usize {
        let mut cache = self.caches.get();
        let (mut n, mut at) = (0, 0);
        while at < text.len() {
            let from = Input::new(text).range(at..).anchored(Anchored::Yes);
            let (mut end, id) = match self.split.try_search_fwd(&mut cache, &from) {
                Ok(Some(m)) => (m.offset(), m.pattern().as_usize()),
                // Every character starts a match of these patterns. Were
                // one not to, it is skipped, as tiktoken's search skips it.
                Ok(None) => {
                    at += text
                        .get(at..)
                        .and_then(|t| t.chars().next())
                        .map_or(1, char::len_utf8);
                    continue;
                }
                // The lazy DFA gave up (it does not with its default
                // settings): the rest counts a token a byte, more than it
                // can be.
                Err(_) => return n + text.len() - at,
            };
            if id == LOOK_AHEAD_ID {
                // Matches end between characters; were one not to, no cut.
                end -= text
                    .get(..end)
                    .and_then(|t| t.chars().next_back())
                    .map_or(0, char::len_utf8);
            }
            if end <= at {
                // No empty match is possible; were there one, as above.
                return n + text.len() - at;
            }
            n += self.piece_tokens(&text.as_bytes()[at..end]);
            at = end;
        }
        n
    }

    fn piece_tokens(&self, piece: &[u8]) -> usize {
        if piece.len() > LONG_PIECE {
            return chunks(piece).map(|c| self.piece_tokens(c)).sum();
        }
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
    /// starts and the rank of it joined with the next; the last is the
    /// piece's end. They live on the stack: `piece` is shorter than
    /// `LARGE_PIECE`.
    fn merge_small(&self, piece: &[u8]) -> usize {
        let len = piece.len();
        let mut parts = [(0u8, NONE); LARGE_PIECE + 1];
        for (i, part) in parts.iter_mut().enumerate().take(len + 1) {
            let rank = piece.get(i..i + 2).map_or(NONE, |p| self.rank(p));
            *part = (i as u8, rank);
        }
        let mut n = len + 1;
        // The rank of parts i and i + 1 joined, once i + 1 and i + 2 are.
        let joined = |parts: &[(u8, Rank)], i: usize| match parts.get(i + 3) {
            Some(&(end, _)) => self.rank(&piece[usize::from(parts[i].0)..usize::from(end)]),
            None => NONE,
        };
        loop {
            let mut min = (NONE, 0);
            for (i, &(_, r)) in parts[..n - 1].iter().enumerate() {
                if r < min.0 {
                    min = (r, i);
                }
            }
            if min.0 == NONE {
                return n - 1;
            }
            let i = min.1;
            if i > 0 {
                parts[i - 1].1 = joined(&parts[..n], i - 1);
            }
            parts[i].1 = joined(&parts[..n], i);
            parts.copy_within(i + 2..n, i + 1);
            n -= 1;
        }
    }

    /// The same merges for a long piece (at most `LONG_PIECE` bytes), with
    /// a heap of candidate pairs (lowest rank, then leftmost, first) and the
    /// parts as a linked list; a candidate whose parts changed since it was
    /// pushed is skipped. Positions are 32-bit: half the scratch.
    fn merge_large(&self, piece: &[u8]) -> usize {
        let len = piece.len() as u32;
        let at = |from: u32, to: u32| &piece[from as usize..to as usize];
        // Part i spans i..next[i]; prev[i] is the part before it.
        let mut next: Vec<u32> = (1..=len).collect();
        let mut prev: Vec<u32> = (0..len).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; len as usize];
        let mut heap = BinaryHeap::with_capacity(len as usize);
        for i in 0..len - 1 {
            let r = self.rank(at(i, i + 2));
            if r != NONE {
                heap.push(Reverse((r, i, i + 2)));
            }
        }
        let mut parts = len as usize;
        while let Some(Reverse((rank, i, end))) = heap.pop() {
            let iu = i as usize;
            // Stale: part i is gone, or it or its neighbour changed.
            if !alive[iu] || next[iu] >= len || next[next[iu] as usize] != end {
                continue;
            }
            if self.rank(at(i, end)) != rank {
                continue;
            }
            let j = next[iu];
            alive[j as usize] = false;
            next[iu] = end;
            if end < len {
                prev[end as usize] = i;
            }
            parts -= 1;
            if i > 0 {
                let p = prev[iu];
                let r = self.rank(at(p, end));
                if r != NONE {
                    heap.push(Reverse((r, p, end)));
                }
            }
            if end < len {
                let after = next[end as usize];
                let r = self.rank(at(i, after));
                if r != NONE {
                    heap.push(Reverse((r, i, after)));
                }
            }
        }
        parts
    }
}

/// `piece` in chunks of at most `LONG_PIECE` bytes, each cut at the last
/// character boundary at or before that length (a chunk that would hold
/// no whole character, which valid UTF-8 never gives, is cut where it
/// stands).
fn chunks(piece: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = piece;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut cut = rest.len().min(LONG_PIECE);
        if cut < rest.len() {
            // A UTF-8 continuation byte is 0b10xx_xxxx: a character starts
            // at most three bytes back.
            let start = (cut.saturating_sub(3)..=cut)
                .rev()
                .find(|&i| rest.get(i).is_some_and(|&b| b & 0xc0 != 0x80));
            cut = start.filter(|&i| i > 0).unwrap_or(cut);
        }
        let (chunk, tail) = rest.split_at(cut);
        rest = tail;
        Some(chunk)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    /// tiktoken's counter and this one, for the same encoding.
    fn both(core: tiktoken_rs::CoreBPE, split: &Split) -> (tiktoken_rs::CoreBPE, Bpe) {
        let bpe = Bpe::new(Vocabulary::from_core(&core).unwrap(), split).unwrap();
        (core, bpe)
    }

    fn pair() -> &'static (tiktoken_rs::CoreBPE, Bpe) {
        static P: OnceLock<(tiktoken_rs::CoreBPE, Bpe)> = OnceLock::new();
        P.get_or_init(|| both(tiktoken_rs::o200k_base().unwrap(), &O200K))
    }

    fn cl100k() -> &'static (tiktoken_rs::CoreBPE, Bpe) {
        static P: OnceLock<(tiktoken_rs::CoreBPE, Bpe)> = OnceLock::new();
        P.get_or_init(|| both(tiktoken_rs::cl100k_base().unwrap(), &CL100K))
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

    /// Text of `len` bytes that the split keeps as one piece: `unit`
    /// repeated, or (for "") random lowercase letters.
    fn one_piece(unit: &str, len: usize) -> String {
        if unit.is_empty() {
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            return (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    char::from(b'a' + (x % 26) as u8)
                })
                .collect();
        }
        let mut s = unit.repeat(len / unit.len() + 1);
        s.truncate(floor(&s, len));
        s
    }

    fn floor(s: &str, i: usize) -> usize {
        (0..=i.min(s.len()))
            .rev()
            .find(|&i| s.is_char_boundary(i))
            .unwrap_or(0)
    }

    const KINDS: [&str; 7] = ["", "a", " ", "é", "日本", "+-*/", "🎉"];

    #[test]
    fn a_long_piece_counts_within_a_hair_of_its_exact_count() {
        for (_, bpe) in [pair(), cl100k()] {
            for unit in KINDS {
                let text = one_piece(unit, 200 * 1024);
                let exact = bpe.merge_large(text.as_bytes());
                let counted = bpe.count(&text);
                // Tokens cannot span a cut: a few more a chunk at most.
                let chunks = text.len().div_ceil(LONG_PIECE);
                assert!(
                    counted + chunks >= exact && counted <= exact + 4 * chunks,
                    "{unit:?}: {counted} counted, {exact} exact"
                );
            }
        }
    }

    #[test]
    fn a_piece_of_megabytes_counts_the_same_every_time_and_in_proportion() {
        let (_, bpe) = pair();
        let block = one_piece("", 200 * 1024);
        let exact = bpe.merge_large(block.as_bytes());
        // 12 MB, one piece: the same count twice (the count cache and the
        // plan's prefix stability rest on it), near 60 blocks' worth.
        let text = block.repeat(60);
        let counted = bpe.count(&text);
        assert_eq!(bpe.count(&text), counted);
        let whole = 60 * exact;
        assert!(
            counted.abs_diff(whole) * 100 <= whole,
            "{counted} counted, {whole} for 60 blocks"
        );
    }

    #[test]
    fn chunks_cover_the_piece_and_cut_between_characters() {
        for unit in KINDS {
            let text = one_piece(unit, 3 * LONG_PIECE + 5);
            let parts: Vec<&[u8]> = chunks(text.as_bytes()).collect();
            assert_eq!(parts.concat(), text.as_bytes(), "{unit:?}");
            assert_eq!(parts.len(), 4, "{unit:?}");
            for (i, p) in parts.iter().enumerate() {
                assert!(p.len() <= LONG_PIECE, "{unit:?}");
                // A cut moves back at most to the start of a character.
                assert!(
                    i + 1 == parts.len() || p.len() + 3 >= LONG_PIECE,
                    "{unit:?}"
                );
                assert!(std::str::from_utf8(p).is_ok(), "{unit:?}");
            }
        }
        // Bytes that are not UTF-8 are cut where they stand.
        let odd = vec![0x80u8; LONG_PIECE + 1];
        assert_eq!(
            chunks(&odd).map(<[u8]>::len).collect::<Vec<_>>(),
            [LONG_PIECE, 1]
        );
        assert_eq!(chunks(b"").count(), 0);
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
