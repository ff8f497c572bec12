//! condense's counts against reference counts computed with OpenAI's own
//! tokenizer (see tests/fixtures/tokens/make_reference.py for the method).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use bytes::Bytes;
use condense::chat::ChatRequest;
use condense::config::Config;
use condense::metrics::Metrics;
use condense::tokens::{Encoding, TokenService};
use serde_json::Value;

fn reference() -> Value {
    serde_json::from_str(include_str!("fixtures/tokens/reference.json")).unwrap()
}

fn encoding(name: &str) -> Encoding {
    serde_json::from_value(Value::String(name.to_string())).unwrap()
}

#[test]
fn strings_match_openais_tokenizer() {
    let r = reference();
    let cases = r["strings"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let enc = encoding(case["encoding"].as_str().unwrap());
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            enc.count(text),
            case["tokens"].as_u64().unwrap(),
            "{enc:?} {text:?}"
        );
    }
}

#[test]
fn whole_requests_match_the_reference_rules() {
    let r = reference();
    let metrics = Metrics::new().unwrap();
    let svc = TokenService::new(Arc::new(Config::default()), &metrics);
    for case in r["requests"].as_array().unwrap() {
        let enc = encoding(case["encoding"].as_str().unwrap());
        let body = Bytes::from(case["request"].to_string());
        let req = ChatRequest::parse(&body).unwrap();
        let count = svc.count(&req, enc);
        assert_eq!(
            count.total,
            case["tokens"].as_u64().unwrap(),
            "{enc:?} {}",
            case["request"]
        );
        // The same again, now from the cache.
        assert_eq!(svc.count(&req, enc).total, count.total);
    }
}
