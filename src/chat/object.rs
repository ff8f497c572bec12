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

/// Calls `each` with every member of the JSON object `raw`, key decoded,
/// value as its exact bytes, in order. The values are not parsed: each
/// one's end is found from its delimiters alone (strings by their quotes,
/// with a vectorized search), which makes this several times cheaper than
/// a parse for values that are long strings. So `raw` must be valid JSON,
/// as a message's bytes always are (they passed the request's parse); on
/// anything that is not an object as expected this returns None, and the
/// caller parses `raw` properly.
pub fn members<'a>(raw: &'a [u8], mut each: impl FnMut(&str, &'a [u8])) -> Option<()> {
    walk(raw, b'{', b'}', |i| {
        if *raw.get(i)? != b'"' {
            return None;
        }
        let end = string_end(raw, i)?;
        let quoted = raw.get(i..end)?;
        let inner = quoted.get(1..quoted.len() - 1)?;
        let colon = space(raw, end);
        if *raw.get(colon)? != b':' {
            return None;
        }
        let start = space(raw, colon + 1);
        let end = value_end(raw, start)?;
        let value = raw.get(start..end)?;
        match memchr::memchr(b'\\', inner) {
            None => each(std::str::from_utf8(inner).ok()?, value),
            Some(_) => each(&serde_json::from_slice::<String>(quoted).ok()?, value),
        }
        Some(end)
    })
}

/// The value of `key` in the JSON object `raw`, parsed (the last one when
/// the key is there twice, as a parse keeps it); None when it is absent or
/// `raw` is not an object. Only that value is parsed: the others are
/// skipped by their delimiters.
pub fn member_value<T: serde::de::DeserializeOwned>(raw: &[u8], key: &str) -> Option<T> {
    let mut found = None;
    match members(raw, |k, v| {
        if k == key {
            found = Some(v);
        }
    }) {
        Some(()) => serde_json::from_slice(found?).ok(),
        None => match serde_json::from_slice::<serde_json::Value>(raw).ok()? {
            serde_json::Value::Object(mut o) => serde_json::from_value(o.remove(key)?).ok(),
            _ => None,
        },
    }
}

/// Calls `each` with every element of the JSON array `raw`, as its exact
/// bytes, in order; read as `members` reads an object (so `raw` must be
/// valid JSON), None on anything that is not an array as expected.
pub fn elements<'a>(raw: &'a [u8], mut each: impl FnMut(&'a [u8])) -> Option<()> {
    walk(raw, b'[', b']', |i| {
        let end = value_end(raw, i)?;
        each(raw.get(i..end)?);
        Some(end)
    })
}

/// Walks the object or array that is the whole of `raw` (`open` and
/// `close` its brackets): `item` reads the member or element that starts
/// at its argument and says where it ends.
fn walk(
    raw: &[u8],
    open: u8,
    close: u8,
    mut item: impl FnMut(usize) -> Option<usize>,
) -> Option<()> {
    let mut i = space(raw, 0);
    if *raw.get(i)? != open {
        return None;
    }
    i = space(raw, i + 1);
    if *raw.get(i)? != close {
        loop {
            i = space(raw, item(i)?);
            match *raw.get(i)? {
                b',' => i = space(raw, i + 1),
                c if c == close => break,
                _ => return None,
            }
        }
    }
    (space(raw, i + 1) == raw.len()).then_some(())
}

/// The first position from `i` that is not JSON whitespace.
fn space(raw: &[u8], mut i: usize) -> usize {
    while matches!(raw.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// Just past the string that starts at `i`: at the first quote after it
/// not escaped, that is with an even run of backslashes before it. Quotes
/// are searched for alone, as they are rarer than backslashes (every line
/// break of a tool's output is one).
fn string_end(raw: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        let k = j + memchr::memchr(b'"', raw.get(j..)?)?;
        let backslashes = raw[j..k].iter().rev().take_while(|&&c| c == b'\\').count();
        if backslashes % 2 == 0 {
            return Some(k + 1);
        }
        j = k + 1;
    }
}

/// Just past the value that starts at `i`.
fn value_end(raw: &[u8], i: usize) -> Option<usize> {
    match *raw.get(i)? {
        b'"' => string_end(raw, i),
        b'{' | b'[' => {
            let (mut j, mut depth) = (i, 0usize);
            loop {
                match *raw.get(j)? {
                    b'"' => {
                        j = string_end(raw, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        // A number, true, false or null.
        _ => {
            let end = raw[i..]
                .iter()
                .position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .map_or(raw.len(), |n| i + n);
            (end > i).then_some(end)
        }
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

    fn members_of(s: &str) -> Option<Vec<(String, String)>> {
        let mut out = Vec::new();
        members(s.as_bytes(), |k, v| {
            out.push((k.to_string(), String::from_utf8(v.to_vec()).unwrap()))
        })?;
        Some(out)
    }

    #[test]
    fn members_are_the_parsers_members() {
        for s in [
            r#"{}"#,
            r#" { } "#,
            r#"{"a":1}"#,
            "{ \"a\" :\n\t-1.5e3 , \"b\":\"x\\\"}{]\\\\\" ,\"c\" : [ {\"d\":[]} , \"]\" ,null], \"e\":{\"f\":{}},\"g\":true,\"h\":false }",
            r#"{"r\u006fle":"tool","k\"ey":"\u00e9\ud83c\udf89","":""}"#,
            r#"{"content":"line\nline\\n\"quoted\" { [ ","role":"user"}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":"\\","b":"\\\"","c":"\\\\\"\\","d":"\"\""}"#,
        ] {
            let parsed = RawObject::parse(&Bytes::copy_from_slice(s.as_bytes())).unwrap();
            let expected: Vec<(String, String)> = parsed
                .entries
                .iter()
                .map(|(k, v)| (k.clone(), String::from_utf8(v.to_vec()).unwrap()))
                .collect();
            assert_eq!(members_of(s), Some(expected), "{s}");
        }
    }

    #[test]
    fn elements_are_the_parsers_elements() {
        for s in [
            "[]",
            " [ ] ",
            r#"[1, "a\"]", {"b":[2,{}]} ,[[]],null,true, -0.5 ]"#,
        ] {
            let parsed: Vec<&RawValue> = serde_json::from_str(s).unwrap();
            let mut read = Vec::new();
            elements(s.as_bytes(), |e| read.push(std::str::from_utf8(e).unwrap())).unwrap();
            assert_eq!(
                read,
                parsed.iter().map(|r| r.get()).collect::<Vec<_>>(),
                "{s}"
            );
        }
        for s in ["{}", "[1", "[1,]", "[1] x", "", r#""[]""#] {
            assert_eq!(elements(s.as_bytes(), |_| {}), None, "{s}");
        }
    }

    #[test]
    fn members_of_what_is_not_an_object_is_none() {
        for s in [
            r#""text""#,
            "[1]",
            "7",
            "null",
            "",
            "{",
            r#"{"a":1"#,
            r#"{"a" 1}"#,
            r#"{"a":1,}x"#,
            r#"{"a":1} x"#,
            r#"{"a":"#,
        ] {
            assert_eq!(members_of(s), None, "{s}");
        }
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
