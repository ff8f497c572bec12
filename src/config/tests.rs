use super::*;
use std::path::Path;

#[test]
fn shipped_file_states_every_default() {
    let text = include_str!("../../config/condense.toml");
    let parsed = Config::from_toml(text).unwrap();
    assert_eq!(parsed, Config::default());
    // Not only equal in effect: the file spells out every key.
    let file: toml::Value = toml::from_str(text).unwrap();
    let defaults = toml::Value::try_from(Config::default()).unwrap();
    assert_eq!(file, defaults);
}

#[test]
fn a_models_table_replaces_the_shipped_one() {
    let c = Config::from_toml(
        "[[models]]\nmatch = \"my-*\"\ncontext_window = 8192\nencoding = \"cl100k_base\"\ntrigger = 0.85\ntarget = 0.4\n",
    )
    .unwrap();
    assert_eq!(c.models.len(), 1);
    assert_eq!(c.models[0].encoding, Some(Encoding::Cl100k));
    assert_eq!(c.thresholds(Some(&c.models[0])), (0.85, 0.4));
    assert_eq!(c.thresholds(None), (0.98, 0.5));
}

#[test]
fn unknown_keys_are_errors() {
    let err = Config::from_toml("[upstream]\nbase_ur = \"http://x\"\n").unwrap_err();
    assert!(err.to_string().contains("base_ur"), "{err}");
    assert!(Config::from_toml("listen = \"1.2.3.4:5\"\n").is_err());
}

#[test]
fn invalid_values_are_errors() {
    assert!(Config::from_toml("[upstream]\nbase_url = \"ftp://x\"\n").is_err());
    assert!(Config::from_toml("[upstream]\nidle_timeout_seconds = 0\n").is_err());
    assert!(Config::from_toml("[server]\nlisten = \"nowhere\"\n").is_err());
    assert!(Config::from_toml("[log]\nformat = \"xml\"\n").is_err());
    assert!(Config::from_toml("[compaction]\ntrigger = 0.5\ntarget = 0.7\n").is_err());
    for bad in [
        "fit_share = 0.0",
        "fit_share = 1.5",
        "recent_share = -0.1",
        "ahead_share = nan",
        "recent_max_share = 0",
        "fade_share = inf",
    ] {
        let err = Config::from_toml(&format!("[compaction]\n{bad}\n")).unwrap_err();
        let key = bad.split(' ').next().unwrap();
        assert!(err.to_string().contains(key), "{bad}: {err}");
    }
    // Out of reach on purpose: turns a mechanism off.
    assert!(Config::from_toml("[compaction]\nahead_share = 10\n").is_ok());
    for bad in [
        "min_learned_window = 0",
        "learned_window_ttl_seconds = 0",
        "learned_window_ttl_seconds = 2592001",
    ] {
        let err = Config::from_toml(&format!("[tokens]\n{bad}\n")).unwrap_err();
        let key = bad.split(' ').next().unwrap();
        assert!(err.to_string().contains(key), "{bad}: {err}");
    }
    assert!(Config::from_toml("[[models]]\nmatch = \"x\"\ncontext_window = 10\n").is_err());
    assert!(
        Config::from_toml(
            "[[models]]\nmatch = \"x\"\ncontext_window = 8192\nencoding = \"p50k\"\n"
        )
        .is_err()
    );
    assert!(
        Config::from_toml("[[models]]\nmatch = \"x\"\ncontext_window = 8192\nwindow = 1\n")
            .is_err()
    );
}

#[test]
#[allow(clippy::result_large_err)]
fn environment_overrides_file_with_double_underscore_nesting() {
    figment::Jail::expect_with(|jail| {
        jail.create_file("c.toml", "[upstream]\nbase_url = \"http://file:1/v1\"\n")?;
        jail.set_env("CONDENSE_UPSTREAM__BASE_URL", "http://env:2/v1");
        jail.set_env("CONDENSE_SERVER__LISTEN", "0.0.0.0:9999");
        jail.set_env("CONDENSE_AUTH__CLIENT_KEYS", "[k1, k2]");
        let c = Config::load(Some(Path::new("c.toml"))).unwrap();
        assert_eq!(c.upstream.base_url, "http://env:2/v1");
        assert_eq!(c.server.listen.port(), 9999);
        assert_eq!(c.auth.client_keys.len(), 2);
        jail.set_env("CONDENSE_UPSTREAM__NOPE", "1");
        assert!(Config::load(Some(Path::new("c.toml"))).is_err());
        Ok(())
    });
}

#[test]
#[allow(clippy::result_large_err)]
fn an_empty_optional_key_is_unset() {
    figment::Jail::expect_with(|jail| {
        jail.set_env("CONDENSE_UPSTREAM__API_KEY", "");
        jail.set_env("CONDENSE_STATE__REDIS_URL", "");
        jail.set_env("CONDENSE_SUMMARY__MODEL", "");
        jail.set_env("CONDENSE_UPSTREAM__CA_FILE", "");
        let c = Config::load(None).unwrap();
        assert!(c.upstream.api_key.is_none() && c.state.redis_url.is_none());
        assert!(c.summary.model.is_none() && c.upstream.ca_file.is_none());
        jail.set_env("CONDENSE_UPSTREAM__CA_FILE", "/etc/condense/ca.pem");
        let c = Config::load(None).unwrap();
        assert_eq!(
            c.upstream.ca_file.as_deref(),
            Some(Path::new("/etc/condense/ca.pem"))
        );
        Ok(())
    });
}

#[test]
fn a_key_no_http_header_can_carry_is_refused_without_being_shown() {
    let secret = "sk-do-not-print-me";
    for (bad, why) in [
        (format!("{secret}\n"), "line break"),
        (format!("{secret}\r\nX-Injected: 1"), "line break"),
        (format!("{secret}\u{7f}"), "control character"),
        (format!("{secret}\tx"), "control character"),
        (format!("{secret}\u{e9}"), "outside ASCII"),
        (format!(" {secret}"), "space"),
    ] {
        type Set = fn(&mut Config, Secret);
        let set: [(&str, Set); 4] = [
            ("upstream.api_key", |c, k| c.upstream.api_key = Some(k)),
            ("upstream.anthropic_api_key", |c, k| {
                c.upstream.anthropic_api_key = Some(k)
            }),
            ("summary.api_key", |c, k| c.summary.api_key = Some(k)),
            ("auth.client_keys", |c, k| {
                c.auth.client_keys = vec![Secret::new("fine"), k]
            }),
        ];
        for (key, set) in set {
            let mut c = Config::default();
            set(&mut c, Secret::new(bad.clone()));
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(why), "{err}");
            assert!(!err.contains("do-not-print"), "{err}");
        }
    }
    let mut c = Config::default();
    c.upstream.api_key = Some(Secret::new("sk-proj-AZaz09_-.~+/="));
    c.validate().unwrap();
}

#[test]
#[allow(clippy::result_large_err)]
fn a_malformed_secret_is_named_with_its_variable_but_never_shown() {
    for (var, value, wrong) in [
        // The common slip: no brackets around the list.
        (
            "CONDENSE_AUTH__CLIENT_KEYS",
            "sekrit-1, sekrit-2",
            "found a string, expected a sequence",
        ),
        (
            "CONDENSE_AUTH__CLIENT_KEYS",
            "[sekrit-1",
            "expected a sequence",
        ),
        (
            "CONDENSE_AUTH__CLIENT_KEYS",
            "[ok, 8675309]",
            "found an integer, expected a string",
        ),
        ("CONDENSE_UPSTREAM__API_KEY", "8675309", "found an integer"),
        (
            "CONDENSE_UPSTREAM__ANTHROPIC_API_KEY",
            "8675309",
            "found an integer",
        ),
        ("CONDENSE_SUMMARY__API_KEY", "true", "found a boolean"),
        ("CONDENSE_STATE__REDIS_URL", "8675309", "found an integer"),
        ("CONDENSE_UPSTREAM__BASE_URL", "8675309", "found an integer"),
    ] {
        figment::Jail::expect_with(|jail| {
            jail.set_env(var, value);
            let err = Config::load(None).unwrap_err().to_string();
            assert!(err.contains(var) && err.contains(wrong), "{var}: {err}");
            assert!(err.contains("not shown"), "{var}: {err}");
            assert!(
                !err.contains("sekrit") && !err.contains("8675309") && !err.contains("true"),
                "{var}: {err}"
            );
            Ok(())
        });
    }
    // The same from a file, and a file that does not parse (whose
    // error would quote the line).
    for text in [
        "[auth]\nclient_keys = \"sekrit\"\n",
        "[upstream]\napi_key = sekrit-unquoted\n",
    ] {
        let err = Config::from_toml(text).unwrap_err().to_string();
        assert!(!err.contains("sekrit"), "{err}");
        assert!(
            err.contains("client_keys") || err.contains("line 2"),
            "{err}"
        );
    }
    // Other values are still quoted: they help, and are not secret.
    figment::Jail::expect_with(|jail| {
        jail.set_env("CONDENSE_SERVER__MAX_BODY_BYTES", "lots");
        let err = Config::load(None).unwrap_err().to_string();
        assert!(
            err.contains("CONDENSE_SERVER__MAX_BODY_BYTES") && err.contains("\"lots\""),
            "{err}"
        );
        Ok(())
    });
}

#[test]
#[allow(clippy::result_large_err)]
fn stray_condense_variables_are_ignored_and_named_but_typos_in_settings_are_not() {
    figment::Jail::expect_with(|jail| {
        jail.set_env("CONDENSE_EXTRA", "1");
        jail.set_env("CONDENSE_BIN", "/usr/local/bin/condense");
        jail.set_env("CONDENSE_E2E_API_KEY", "sk-test");
        jail.set_env("CONDENSE_SERVER", "x");
        jail.set_env("CONDENSE_DEFAULT_CONTEXT_WINDOW", "4096");
        let c = Config::load(None).unwrap();
        assert_eq!(c.default_context_window, 4096);
        assert_eq!(
            ignored_variables(),
            [
                "CONDENSE_BIN",
                "CONDENSE_E2E_API_KEY",
                "CONDENSE_EXTRA",
                "CONDENSE_SERVER"
            ]
        );
        Ok(())
    });
    for typo in ["CONDENSE_SERVER__LISTN", "CONDENSE_SERVR__LISTEN"] {
        figment::Jail::expect_with(|jail| {
            jail.set_env("CONDENSE_EXTRA", "1");
            jail.set_env(typo, "127.0.0.1:1");
            let err = Config::load(None).unwrap_err().to_string();
            assert!(err.contains(typo) && err.contains("unknown field"), "{err}");
            Ok(())
        });
    }
}

#[test]
fn redacted_rendering_hides_secrets() {
    let mut c = Config::default();
    c.upstream.api_key = Some(Secret::new("sk-very-secret"));
    c.auth.client_keys = vec![Secret::new("client-secret")];
    c.upstream.base_url = "https://bob:hunter2@gw.example/v1".to_string();
    let text = c.to_redacted_toml();
    assert!(!text.contains("sk-very-secret") && !text.contains("client-secret"));
    assert!(!text.contains("hunter2") && !text.contains("bob"), "{text}");
    assert!(text.contains("https://redacted@gw.example/v1"), "{text}");
    assert!(text.contains("[redacted]"));
    assert!(!format!("{c:?}").contains("sk-very-secret"));
}
