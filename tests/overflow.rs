//! Context-overflow detection against the fixtures in
//! `tests/fixtures/overflow/`: one file per provider with the exact error
//! bodies, `negatives.json` with errors that must not be taken for an
//! overflow, and `echoes.json` with errors that quote client input holding
//! an overflow's wording (the window an overflow names is every tenant's,
//! so an echo must not pass for one).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use condense::overflow::detect;
use serde_json::Value;

fn fixtures() -> Vec<(String, Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/overflow");
    let mut out: Vec<(String, Value)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().to_string();
            (
                name,
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn every_provider_fixture_is_recognised_with_its_numbers() {
    let mut seen = 0;
    for (name, cases) in fixtures()
        .into_iter()
        .filter(|(n, _)| !NOT_OVERFLOWS.contains(&n.as_str()))
    {
        for case in cases.as_array().unwrap() {
            let status = case["status"].as_u64().unwrap() as u16;
            let body = case["body"].as_str().unwrap();
            let found = detect(status, body.as_bytes())
                .unwrap_or_else(|| panic!("{name}: {} not recognised", case["note"]));
            let got = serde_json::to_value(&found).unwrap();
            assert_eq!(got, case["expect"], "{name}: {}", case["note"]);
            seen += 1;
        }
    }
    assert!(seen >= 15, "{seen} fixtures");
}

/// The fixture files of errors that are not overflows.
const NOT_OVERFLOWS: &[&str] = &["negatives", "echoes"];

#[test]
fn negative_fixtures_are_not_overflows() {
    for (name, min) in [("negatives", 8), ("echoes", 10)] {
        let (_, cases) = fixtures().into_iter().find(|(n, _)| n == name).unwrap();
        for case in cases.as_array().unwrap() {
            let status = case["status"].as_u64().unwrap() as u16;
            let body = case["body"].as_str().unwrap();
            assert_eq!(
                detect(status, body.as_bytes()),
                None,
                "{name}: {}",
                case["note"]
            );
        }
        assert!(cases.as_array().unwrap().len() >= min, "{name}");
    }
}

#[test]
fn a_success_or_a_server_error_is_never_an_overflow() {
    let body = br#"{"error":{"message":"This model's maximum context length is 8192 tokens.","code":"context_length_exceeded"}}"#;
    assert!(detect(400, body).is_some());
    assert_eq!(detect(200, body), None);
    assert_eq!(detect(500, body), None);
    assert_eq!(detect(503, body), None);
}
