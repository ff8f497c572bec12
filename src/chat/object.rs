//! A JSON object kept as its keys in their original order, each with its value
//! as the exact bytes the client sent (zero-copy slices of the request body).
//! Re-emitting an object rewrites only the values that were replaced;
//! everything else goes out byte-for-byte, which keeps unknown fields intact
//! and the upstream's prompt cache warm.

use std::fmt;

use bytes::Bytes;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

#[derive(Debug, Clone, Default)]
pub struct RawObject {
    entries: Vec<(String, Bytes)>,
}

impl RawObject {
    /// Parses an object; values are slices of `src`, not copies.
    pub fn parse(src: &Bytes) -> Result<RawObject, serde_json::Error> {
        Ok(Self::parse_splitting(src, None)?.0)
    }

    /// Parses an object and, in the same pass over the input, splits the
    /// array under `list_key` into its elements (the chat request splits its
    /// `messages` this way). The entry for `list_key` keeps its place with an
    /// empty value; the elements are returned beside the object (None when
    /// the key is absent). A `list_key` value that is not an array is an
    /// error.
    pub fn parse_splitting(
        src: &Bytes,
        list_key: Option<&str>,
    ) -> Result<(RawObject, Option<Vec<Bytes>>), serde_json::Error> {
        let mut de = serde_json::Deserializer::from_slice(src);
        let out = ObjectSeed { src, list_key }.deserialize(&mut de)?;
        de.end()?;
        Ok(out)
    }

    /// The value of `key`. With duplicate keys the last one counts, as in
    /// most JSON parsers (and the upstream's, most likely).
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.position(key).map(|i| &self.entries[i].1[..])
    }

    fn position(&self, key: &str) -> Option<usize> {
        self.entries.iter().rposition(|(k, _)| k == key)
    }

    /// The keys, in order (a duplicate key as often as it occurs).
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// Replaces the value of `key` in place, or appends it when absent.
    /// `value` must be valid JSON.
    pub fn set(&mut self, key: &str, value: Bytes) {
        match self.position(key) {
            Some(i) => self.entries[i].1 = value,
            None => self.entries.push((key.to_string(), value)),
        }
    }

    /// Removes every occurrence of `key`; true when one was there.
    pub fn remove(&mut self, key: &str) -> bool {
        let before = self.entries.len();
        self.entries.retain(|(k, _)| k != key);
        before != self.entries.len()
    }

    /// Writes the object compactly; values are their original bytes.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        out.push(b'{');
        for (i, (k, v)) in self.entries.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_json_string(out, k);
            out.push(b':');
            out.extend_from_slice(v);
        }
        out.push(b'}');
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            self.entries
                .iter()
                .map(|(k, v)| k.len() + v.len() + 4)
                .sum(),
        );
        self.write_to(&mut out);
        out
    }
}

/// Writes `s` as a JSON string literal.
pub fn write_json_string(out: &mut Vec<u8>, s: &str) {
    // Serializing a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// The bytes of `raw` as a zero-copy slice of `src` when it lies inside it
/// (it does when `raw` was borrowed from `src`), else a copy.
pub(crate) fn slice_of(src: &Bytes, raw: &RawValue) -> Bytes {
    let text = raw.get().as_bytes();
    let start = (text.as_ptr() as usize).wrapping_sub(src.as_ptr() as usize);
    if start <= src.len() && text.len() <= src.len() - start {
        src.slice(start..start + text.len())
    } else {
        Bytes::copy_from_slice(text)
    }
}

struct ObjectSeed<'s, 'k> {
    src: &'s Bytes,
    list_key: Option<&'k str>,
}

impl<'de> DeserializeSeed<'de> for ObjectSeed<'_, '_> {
    type Value = (RawObject, Option<Vec<Bytes>>);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ObjectSeed<'_, '_> {
    type Value = (RawObject, Option<Vec<Bytes>>);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(8));
        let mut list = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if self.list_key == Some(&*key) {
                let items: Vec<&'de RawValue> = map.next_value()?;
                list = Some(items.into_iter().map(|r| slice_of(self.src, r)).collect());
                entries.push((key.into_owned(), Bytes::new()));
            } else {
                let value: &'de RawValue = map.next_value()?;
                entries.push((key.into_owned(), slice_of(self.src, value)));
            }
        }
        Ok((RawObject { entries }, list))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> RawObject {
        RawObject::parse(&Bytes::copy_from_slice(s.as_bytes())).unwrap()
    }

    #[test]
    fn round_trip_keeps_order_and_value_bytes() {
        let o = parse(r#"{"b": [1, 2 ,3],"a":{"x" : "\u00e9"},"z":null}"#);
        assert_eq!(
            String::from_utf8(o.to_vec()).unwrap(),
            r#"{"b":[1, 2 ,3],"a":{"x" : "\u00e9"},"z":null}"#
        );
    }

    #[test]
    fn values_are_slices_of_the_source() {
        let src = Bytes::from_static(br#"{"k": {"deep": true}}"#);
        let o = RawObject::parse(&src).unwrap();
        let v = o.get("k").unwrap();
        assert_eq!(v, br#"{"deep": true}"#);
        assert_eq!(v.as_ptr(), src[6..].as_ptr());
    }

    #[test]
    fn set_replaces_last_duplicate_or_appends() {
        let mut o = parse(r#"{"k":1,"k":2}"#);
        assert_eq!(o.get("k").unwrap(), b"2");
        o.set("k", Bytes::from_static(b"3"));
        o.set("n", Bytes::from_static(b"true"));
        assert_eq!(o.to_vec(), br#"{"k":1,"k":3,"n":true}"#);
        assert!(o.remove("k"));
        assert_eq!(o.to_vec(), br#"{"n":true}"#);
    }

    #[test]
    fn splitting_a_list_in_the_same_pass() {
        let src = Bytes::from_static(br#"{"a":1,"m":[ {"x":1} , "s", [2] ],"b":2}"#);
        let (o, list) = RawObject::parse_splitting(&src, Some("m")).unwrap();
        let list = list.unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(&list[0][..], br#"{"x":1}"#);
        assert_eq!(&list[2][..], b"[2]");
        assert_eq!(o.get("b").unwrap(), b"2");
        assert!(RawObject::parse_splitting(&Bytes::from_static(br#"{"m":5}"#), Some("m")).is_err());
    }

    #[test]
    fn non_objects_and_trailing_garbage_are_rejected() {
        for bad in ["[1]", "{\"a\":", "\"s\"", "{} x", "{\"a\":\"\\ud800\"}x"] {
            assert!(
                RawObject::parse(&Bytes::copy_from_slice(bad.as_bytes())).is_err(),
                "{bad}"
            );
        }
    }
}
