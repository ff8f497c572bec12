//! Recall keys: every message a stage rewrites, and the turns a digest or
//! checkpoint replaces, get a key derived from their original bytes,
//! written into the marker condense's own text starts with
//! (`[condense: recall key: K; ...]`). The key is part of the pure
//! transform: the same original gives the same bytes on every turn, and
//! the provider's prompt cache stays warm. A leaf: compaction writes keys,
//! `recall` answers them.

use bytes::Bytes;
use memchr::memmem;

use super::text::MARK;
use crate::chat::Message;

/// What precedes a key in condense's markers.
const LABEL: &str = "recall key: ";
/// Characters a key adds to a marker (` recall key: K;`).
pub const TAG_CHARS: usize = LABEL.len() + KEY_CHARS + 2;
/// Digits of a key: about 50 bits of a 128-bit hash. Keys are scoped to a
/// client's credentials, so that is far from colliding; and a key costs
/// prompt tokens on every masked message: digits cost one token per three
/// in the tokenizers models use (5 here), where as many bits of base64
/// cost 8 to 11.
const KEY_CHARS: usize = 15;

/// The recall key of a message with these exact bytes.
pub fn key(raw: &[u8]) -> String {
    encode(xxhash_rust::xxh3::xxh3_128(raw))
}

/// The recall key of several messages replaced together (a digest's or a
/// checkpoint's span).
pub fn span_key<'a>(raws: impl Iterator<Item = &'a [u8]>) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"span");
    for raw in raws {
        h.update(&xxhash_rust::xxh3::xxh3_128(raw).to_le_bytes());
    }
    encode(h.digest128())
}

fn encode(h: u128) -> String {
    format!("{:015}", h % 10u128.pow(KEY_CHARS as u32))
}

/// Whether `s` has the shape of a key (6–64 of `[A-Za-z0-9_-]`).
pub fn valid_key(s: &str) -> bool {
    (6..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The opening of a notice that carries `key` from the start, for text
/// that may quote the marker itself (a client's, cut): [`tag`] would write
/// the key into the first marker, which may be the quote.
pub fn opening(key: &str) -> String {
    format!("{MARK} {LABEL}{key};")
}

/// The message `raw` (condense's own rewrite of it) with `key` written into
/// its first marker, unless it carries a key already or has no marker.
pub fn tag(raw: &[u8], key: &str) -> Option<Bytes> {
    if memmem::find(raw, LABEL.as_bytes()).is_some() {
        return None;
    }
    let at = memmem::find(raw, MARK.as_bytes())? + MARK.len();
    let mut out = Vec::with_capacity(raw.len() + LABEL.len() + key.len() + 3);
    out.extend_from_slice(&raw[..at]);
    out.extend_from_slice(b" ");
    out.extend_from_slice(LABEL.as_bytes());
    out.extend_from_slice(key.as_bytes());
    out.push(b';');
    // The marker's own text went on after a space.
    let rest = &raw[at..];
    out.extend_from_slice(rest);
    Some(Bytes::from(out))
}

/// The message `raw` with the key of its first marker changed to `key`
/// (a replacement that comes to stand for more messages than it was made
/// for); None when it holds no key.
pub fn retag(raw: &[u8], key: &str) -> Option<Bytes> {
    let at = memmem::find(raw, LABEL.as_bytes())? + LABEL.len();
    let old = raw[at..]
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_' || **b == b'-')
        .count();
    let mut out = Vec::with_capacity(raw.len() + key.len());
    out.extend_from_slice(&raw[..at]);
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&raw[at + old..]);
    Some(Bytes::from(out))
}

/// Whether any of `messages` mentions a recall key.
pub fn mentions_key(messages: &[Message]) -> bool {
    let finder = memmem::Finder::new(LABEL.as_bytes());
    messages.iter().any(|m| finder.find(m.raw()).is_some())
}

/// The recall keys `text` holds, in order.
pub fn keys_in(text: &str) -> impl Iterator<Item = &str> {
    text.match_indices(LABEL).filter_map(|(at, _)| {
        let rest = &text[at + LABEL.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(rest.len());
        Some(&rest[..end]).filter(|k| valid_key(k))
    })
}

/// Whether `raw` holds the key `key` in one of condense's markers.
pub fn holds(raw: &[u8], key: &str) -> bool {
    let needle = format!("{LABEL}{key}");
    memmem::find(raw, needle.as_bytes()).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_short_and_found_again() {
        let k = key(b"{\"role\":\"tool\",\"content\":\"x\"}");
        assert_eq!(k, key(b"{\"role\":\"tool\",\"content\":\"x\"}"));
        assert_ne!(k, key(b"{\"role\":\"tool\",\"content\":\"y\"}"));
        assert_eq!(k.len(), KEY_CHARS);
        assert!(valid_key(&k));
        let raw = br#"{"role":"tool","content":"[condense: earlier tool output elided: 9 chars]"}"#;
        let tagged = tag(raw, &k).unwrap();
        let text = std::str::from_utf8(&tagged).unwrap();
        assert!(
            text.contains(&format!("[condense: recall key: {k}; earlier tool output")),
            "{text}"
        );
        assert_eq!(keys_in(text).collect::<Vec<_>>(), vec![k.as_str()]);
        assert!(holds(&tagged, &k));
        // Tagged once only; nothing to tag without a marker.
        assert!(tag(&tagged, "other-key").is_none());
        assert!(tag(br#"{"content":"plain"}"#, &k).is_none());
    }

    #[test]
    fn retag_changes_the_first_key_only() {
        let raw = br#"{"content":"[condense: recall key: 123456789012345; 3 removed] recall key: 999999"}"#;
        let out = retag(raw, "543210987654321").unwrap();
        let text = std::str::from_utf8(&out).unwrap();
        assert_eq!(
            keys_in(text).collect::<Vec<_>>(),
            vec!["543210987654321", "999999"]
        );
        assert!(retag(br#"{"content":"[condense: 3 removed]"}"#, "543210987654321").is_none());
    }

    #[test]
    fn keys_in_ignores_what_is_not_a_key() {
        let t = "recall key: ab; recall key: abcdef_-9] and recall key: ";
        assert_eq!(keys_in(t).collect::<Vec<_>>(), vec!["abcdef_-9"]);
    }
}
