//! A JSON object kept as its keys in their original order, each with its value
//! as the exact bytes the client sent. Re-emitting an object rewrites only the
//! values that were replaced; everything else goes out byte-for-byte, which is
//! what keeps unknown fields intact and the upstream's prompt cache warm.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

#[derive(Debug, Clone, Default)]
pub struct RawObject {
    entries: Vec<(String, Box<RawValue>)>,
}

impl RawObject {
    pub fn parse(bytes: &[u8]) -> Result<RawObject, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// The value of `key`. With duplicate keys the last one counts, as in
    /// most JSON parsers (and the upstream's, most likely).
    pub fn get(&self, key: &str) -> Option<&RawValue> {
        self.position(key).map(|i| &*self.entries[i].1)
    }

    fn position(&self, key: &str) -> Option<usize> {
        self.entries.iter().rposition(|(k, _)| k == key)
    }

    /// Replaces the value of `key` in place, or appends it when absent.
    pub fn set(&mut self, key: &str, value: Box<RawValue>) {
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

    pub fn iter(&self) -> impl Iterator<Item = (&str, &RawValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), &**v))
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
            out.extend_from_slice(v.get().as_bytes());
        }
        out.push(b'}');
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out);
        out
    }
}

/// Writes `s` as a JSON string literal.
pub fn write_json_string(out: &mut Vec<u8>, s: &str) {
    // Serializing a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// A raw JSON value for a literal the caller knows is valid JSON.
pub fn raw(json: &str) -> Box<RawValue> {
    RawValue::from_string(json.to_string()).unwrap_or_else(|_| null())
}

pub fn null() -> Box<RawValue> {
    // "null" is valid JSON; the default RawValue is exactly that.
    serde_json::from_str("null").unwrap_or_default()
}

impl<'de> Deserialize<'de> for RawObject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawObject;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawObject, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((k, v)) = map.next_entry::<String, Box<RawValue>>()? {
                    entries.push((k, v));
                }
                Ok(RawObject { entries })
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_order_and_value_bytes() {
        let src = br#"{"b": [1, 2 ,3],"a":{"x" : "\u00e9"},"z":null}"#;
        let o = RawObject::parse(src).unwrap();
        assert_eq!(
            String::from_utf8(o.to_vec()).unwrap(),
            r#"{"b":[1, 2 ,3],"a":{"x" : "\u00e9"},"z":null}"#
        );
    }

    #[test]
    fn set_replaces_last_duplicate_or_appends() {
        let mut o = RawObject::parse(br#"{"k":1,"k":2}"#).unwrap();
        assert_eq!(o.get("k").unwrap().get(), "2");
        o.set("k", raw("3"));
        o.set("n", raw("true"));
        assert_eq!(o.to_vec(), br#"{"k":1,"k":3,"n":true}"#);
        assert!(o.remove("k"));
        assert_eq!(o.to_vec(), br#"{"n":true}"#);
    }

    #[test]
    fn non_objects_are_rejected() {
        assert!(RawObject::parse(b"[1]").is_err());
        assert!(RawObject::parse(b"{\"a\":").is_err());
        assert!(RawObject::parse(b"\"s\"").is_err());
    }
}
