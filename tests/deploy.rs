//! The deployment files and the README, kept honest without a Docker engine:
//! they parse, they say what they must, the dashboard queries only metrics
//! condense exports, and the README's configuration and metric tables match
//! the schema and the registry exactly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use condense::config::{Config, ModelProfile, Secret};
use condense::metrics::Metrics;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn yaml(path: &str) -> serde_yaml::Value {
    serde_yaml::from_str(&read(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_dockerfile_builds_locked_in_release_and_runs_unprivileged_with_a_healthcheck() {
    let d = read("Dockerfile");
    let lines: Vec<&str> = d.lines().map(str::trim).collect();
    let froms: Vec<&&str> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert!(froms.len() >= 2, "multi-stage");
    assert!(d.contains("cargo build --release --locked"));
    assert!(d.contains("COPY --from=build"));
    let (uid, gid) = image_user();
    assert!(uid != 0 && gid != 0, "the image runs as root");
    assert!(lines.contains(&"EXPOSE 8080"));
    assert!(d.contains("CONDENSE_SERVER__LISTEN=0.0.0.0:8080"));
    assert!(lines.iter().any(|l| l.starts_with("HEALTHCHECK")));
    assert!(d.contains("\"healthcheck\""));
    assert!(
        lines.iter().any(|l| l.starts_with("WORKDIR /app")),
        "config/condense.toml is read from /app"
    );
    // Every file the build copies exists and is not ignored.
    let ignored = read(".dockerignore");
    for l in lines
        .iter()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        for src in l
            .split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
            .split_last()
            .unwrap()
            .1
        {
            assert!(root().join(src).exists(), "{src}");
            assert!(
                !ignored.lines().any(|i| i.trim() == *src),
                "{src} is in .dockerignore"
            );
        }
    }
}

/// The Dockerfile's last `USER`, as numbers: Kubernetes' `runAsNonRoot`
/// can only check a numeric user (with a name, the kubelet refuses to start
/// the container: "image has non-numeric user").
fn image_user() -> (u64, u64) {
    let d = read("Dockerfile");
    let user = d
        .lines()
        .map(str::trim)
        .rfind(|l| l.starts_with("USER "))
        .expect("the Dockerfile sets a USER");
    let spec = user.trim_start_matches("USER ").trim();
    let (uid, gid) = spec
        .split_once(':')
        .unwrap_or_else(|| panic!("{user}: name the group as well"));
    let number = |s: &str| {
        s.parse::<u64>()
            .unwrap_or_else(|_| panic!("{user}: runAsNonRoot needs a numeric user and group"))
    };
    (number(uid), number(gid))
}

#[test]
fn the_image_user_is_numeric_and_the_kubernetes_manifests_run_condense_as_it() {
    let (uid, gid) = image_user();
    let dir = root().join("docker/kubernetes");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if !matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let doc: serde_yaml::Value = serde::Deserialize::deserialize(doc).unwrap();
            let spec = &doc["spec"]["template"]["spec"];
            for c in ["containers", "initContainers"]
                .iter()
                .filter_map(|k| spec[k].as_sequence())
                .flatten()
                .filter(|c| c["image"].as_str().is_some_and(|i| i.contains("condense")))
            {
                let name = format!("{}: {}", path.display(), c["name"].as_str().unwrap());
                let sc = &c["securityContext"];
                assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true), "{name}");
                assert_eq!(sc["runAsUser"].as_u64(), Some(uid), "{name}");
                assert_eq!(sc["runAsGroup"].as_u64(), Some(gid), "{name}");
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no condense container in docker/kubernetes");
}

#[test]
fn the_build_context_leaves_out_build_outputs_history_and_the_fuzzing_corpus() {
    let text = read(".dockerignore");
    let ignored: BTreeSet<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    for must in ["target", ".git", "fuzz/target", "fuzz/corpus"] {
        assert!(ignored.contains(must), "{must} is not in .dockerignore");
    }
    // What git ignores is output, never source: the build context leaves it
    // out too. A .dockerignore pattern is anchored at the root, so a
    // .gitignore name that holds at any depth needs `**/`.
    for line in read(".gitignore").lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let path = line.trim_matches('/');
        let anchored = line.starts_with('/') || path.contains('/');
        let base = path.rsplit('/').next().unwrap();
        let any_depth = format!("**/{base}");
        let mut ancestors = path.match_indices('/').map(|(i, _)| &path[..i]);
        let covered = ignored.contains(any_depth.as_str())
            || (anchored && (ignored.contains(path) || ancestors.any(|a| ignored.contains(a))));
        assert!(covered, ".gitignore has {line}; .dockerignore does not");
    }
}

/// The host address of a Compose port entry (`[HOST:]PORT:PORT`, or the
/// long form's `host_ip`), with `${VAR:-default}` taken at its default;
/// None when the entry names none (Docker then publishes on every
/// interface).
fn published_host(entry: &serde_yaml::Value) -> Option<String> {
    if entry.is_mapping() {
        return entry["host_ip"].as_str().map(str::to_string);
    }
    let short = entry.as_str()?;
    // Variables at their defaults: `${NAME:-default}` or `${NAME-default}`.
    let mut resolved = String::new();
    let mut rest = short;
    while let Some(i) = rest.find("${") {
        resolved.push_str(&rest[..i]);
        let end = rest[i..].find('}').unwrap() + i;
        let inner = &rest[i + 2..end];
        let default = inner
            .split_once(":-")
            .or_else(|| inner.split_once('-'))
            .map(|(_, d)| d)
            .unwrap_or_else(|| panic!("{short}: a variable without a default"));
        resolved.push_str(default);
        rest = &rest[end + 1..];
    }
    resolved.push_str(rest);
    if let Some(v6) = resolved.strip_prefix('[') {
        return Some(v6.split(']').next().unwrap().to_string());
    }
    let parts: Vec<&str> = resolved.split(':').collect();
    (parts.len() == 3).then(|| parts[0].to_string())
}

#[test]
fn compose_publishes_every_port_on_the_loopback_interface_only() {
    let c = yaml("docker/compose.yaml");
    let mut published = 0;
    for (name, service) in c["services"].as_mapping().unwrap() {
        let name = name.as_str().unwrap();
        for entry in service["ports"].as_sequence().into_iter().flatten() {
            let host = published_host(entry)
                .unwrap_or_else(|| panic!("{name}: {entry:?} is published on every interface"));
            let ip: std::net::IpAddr = host
                .parse()
                .unwrap_or_else(|_| panic!("{name}: {entry:?} binds {host:?}"));
            assert!(ip.is_loopback(), "{name}: {entry:?} is published on {ip}");
            published += 1;
        }
    }
    assert_eq!(published, 3, "condense, Prometheus and Grafana");
    // The helper reads what it must: these forms reach every interface.
    for open in [
        "8080:8080",
        "8080",
        "0.0.0.0:8080:8080",
        "${ADDR:-0.0.0.0}:1:1",
    ] {
        let entry = serde_yaml::Value::String(open.to_string());
        let host = published_host(&entry);
        assert!(
            host.is_none_or(|h| !h.parse::<std::net::IpAddr>().unwrap().is_loopback()),
            "{open}"
        );
    }
}

#[test]
fn compose_runs_condense_prometheus_and_grafana_with_the_upstream_from_the_environment() {
    let c = yaml("docker/compose.yaml");
    let services = &c["services"];
    for s in ["condense", "prometheus", "grafana"] {
        assert!(services[s].is_mapping(), "service {s}");
    }
    let condense = &services["condense"];
    assert_eq!(condense["build"]["context"].as_str(), Some(".."));
    let env = &condense["environment"];
    let base = env["CONDENSE_UPSTREAM__BASE_URL"].as_str().unwrap();
    assert!(
        base.starts_with("${") && base.contains("UPSTREAM_BASE_URL"),
        "{base}"
    );
    assert!(
        env["CONDENSE_UPSTREAM__API_KEY"]
            .as_str()
            .unwrap()
            .contains("UPSTREAM_API_KEY")
    );
    assert!(condense["ports"][0].as_str().unwrap().ends_with(":8080"));
    // Mounted files and directories exist.
    for s in ["condense", "prometheus", "grafana"] {
        for v in services[s]["volumes"].as_sequence().into_iter().flatten() {
            let host = v.as_str().unwrap().split(':').next().unwrap();
            let path = root().join("docker").join(host);
            assert!(path.exists(), "{s}: {host}");
        }
    }
    // Environment variables condense is given are real config keys.
    let keys = schema_keys();
    for (k, _) in env.as_mapping().unwrap() {
        let k = k.as_str().unwrap();
        let key = k
            .trim_start_matches("CONDENSE_")
            .to_lowercase()
            .replace("__", ".");
        assert!(keys.contains(&key), "{k} is not a config key");
    }
}

#[test]
fn prometheus_scrapes_condense() {
    let p = yaml("docker/prometheus.yml");
    let job = &p["scrape_configs"][0];
    assert_eq!(job["metrics_path"].as_str(), Some("/metrics"));
    assert_eq!(
        job["static_configs"][0]["targets"][0].as_str(),
        Some("condense:8080")
    );
    let ds = yaml("docker/grafana/provisioning/datasources/prometheus.yaml");
    assert_eq!(
        ds["datasources"][0]["url"].as_str(),
        Some("http://prometheus:9090")
    );
    let provider = yaml("docker/grafana/provisioning/dashboards/condense.yaml");
    assert_eq!(
        provider["providers"][0]["options"]["path"].as_str(),
        Some("/var/lib/grafana/dashboards")
    );
}

/// `condense_*` names in a PromQL expression, histogram suffixes removed.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("condense_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        out.push(base.to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn the_dashboard_queries_only_metrics_condense_exports_and_shows_what_matters() {
    let d: Value = serde_json::from_str(&read("docker/grafana/dashboards/condense.json")).unwrap();
    assert_eq!(d["uid"], "condense");
    let metrics = Metrics::new().unwrap();
    let exported: BTreeSet<&str> = metrics.names().iter().map(String::as_str).collect();
    let mut queried = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        assert!(p["title"].is_string());
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap();
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{expr}");
            for n in names {
                assert!(
                    exported.contains(n.as_str()),
                    "{n} in {expr:?} is not exported"
                );
                queried.insert(n);
            }
        }
    }
    for must in [
        "condense_requests_total",
        "condense_proxy_errors_total",
        "condense_prompt_tokens_received_total",
        "condense_prompt_tokens_forwarded_total",
        "condense_tokens_saved_total",
        "condense_pressure_ratio",
        "condense_calibration_ratio",
        "condense_context_window_tokens",
        "condense_summarizer_calls_total",
        "condense_summarizer_seconds",
        "condense_context_overflow_total",
        "condense_overhead_seconds",
        "condense_upstream_seconds",
    ] {
        assert!(queried.contains(must), "the dashboard does not show {must}");
    }
}

#[test]
fn the_kubernetes_sidecar_points_the_agent_at_condense_with_probes_and_scraping() {
    let text = read("docker/kubernetes/sidecar.yaml");
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let deploy = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let pod = &deploy["spec"]["template"];
    let ann = &pod["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(ann["prometheus.io/port"].as_str(), Some("8080"));
    let containers = pod["spec"]["containers"].as_sequence().unwrap();
    let condense = containers.iter().find(|c| c["name"] == "condense").unwrap();
    assert_eq!(
        condense["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert_eq!(
        condense["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(condense["ports"][0]["containerPort"].as_u64(), Some(8080));
    let agent = containers.iter().find(|c| c["name"] == "agent").unwrap();
    let base = agent["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "OPENAI_BASE_URL")
        .unwrap();
    assert_eq!(base["value"].as_str(), Some("http://127.0.0.1:8080/v1"));
    // The mounted config file is a valid condense configuration.
    let cm = docs.iter().find(|d| d["kind"] == "ConfigMap").unwrap();
    Config::from_toml(cm["data"]["condense.toml"].as_str().unwrap()).unwrap();
    assert!(docs.iter().any(|d| d["kind"] == "ServiceMonitor"));
}

#[test]
fn the_kubernetes_team_gateway_runs_replicas_sharing_its_redis() {
    let text = read("docker/kubernetes/team.yaml");
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let named = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };
    let deploy = named("Deployment", "condense");
    let replicas = deploy["spec"]["replicas"].as_u64().unwrap();
    assert!(replicas >= 2, "a gateway of one replica");
    let pdb = named("PodDisruptionBudget", "condense");
    assert!(pdb["spec"]["minAvailable"].as_u64().unwrap() < replicas);
    let pod = &deploy["spec"]["template"]["spec"];
    let grace = pod["terminationGracePeriodSeconds"].as_f64().unwrap();
    assert!(grace > Config::default().server.shutdown_grace_seconds);
    // The replicas share the Redis the manifest runs, by its Service.
    let cm = named("ConfigMap", "condense-team-config");
    let config = Config::from_toml(cm["data"]["condense.toml"].as_str().unwrap()).unwrap();
    let redis_url = config
        .state
        .redis_url
        .as_ref()
        .unwrap()
        .expose()
        .to_string();
    let service = named("Service", "condense-redis");
    let port = service["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert_eq!(redis_url, format!("redis://condense-redis:{port}/0"));
    let redis = named("Deployment", "condense-redis");
    assert_eq!(
        service["spec"]["selector"]["app"],
        redis["spec"]["template"]["metadata"]["labels"]["app"]
    );
    // The gateway's Service reaches the replicas; the team key is a list.
    let gateway = named("Service", "condense");
    assert_eq!(
        gateway["spec"]["selector"]["app"],
        deploy["spec"]["template"]["metadata"]["labels"]["app"]
    );
    let env = pod["containers"][0]["env"].as_sequence().unwrap();
    let keys = env
        .iter()
        .find(|e| e["name"] == "CONDENSE_AUTH__CLIENT_KEYS")
        .unwrap();
    assert_eq!(keys["value"].as_str(), Some("[$(TEAM_KEY)]"));
    let team_key = env.iter().position(|e| e["name"] == "TEAM_KEY").unwrap();
    let client_keys = env
        .iter()
        .position(|e| e["name"] == "CONDENSE_AUTH__CLIENT_KEYS")
        .unwrap();
    assert!(
        team_key < client_keys,
        "$(TEAM_KEY) expands only once defined"
    );
}

/// Every configuration key, optional ones included, as `section.key`
/// (`models.match` for the model table).
fn schema_keys() -> BTreeSet<String> {
    let mut c = Config::default();
    c.upstream.api_key = Some(Secret::new("x"));
    c.upstream.anthropic_api_key = Some(Secret::new("x"));
    c.upstream.ca_file = Some("x".into());
    c.summary.api_key = Some(Secret::new("x"));
    c.summary.base_url = Some("http://x".into());
    c.summary.model = Some("x".into());
    c.state.redis_url = Some(Secret::new("x"));
    c.models = vec![ModelProfile {
        pattern: "x".into(),
        context_window: 8192,
        encoding: Some(condense::tokens::Encoding::O200k),
        trigger: Some(0.9),
        target: Some(0.5),
    }];
    let mut out = BTreeSet::new();
    flatten("", &toml::Value::try_from(&c).unwrap(), &mut out);
    out
}

fn flatten(prefix: &str, v: &toml::Value, out: &mut BTreeSet<String>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        toml::Value::Array(a) if a.first().is_some_and(toml::Value::is_table) => {
            flatten(prefix, &a[0], out);
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

/// The first-column entries of the README table under `heading`.
fn readme_table(heading: &str) -> Vec<String> {
    let readme = read("README.md");
    let start = readme
        .find(heading)
        .unwrap_or_else(|| panic!("README has no {heading}"));
    readme[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| l.split('|').nth(1).unwrap().trim().to_string())
        .collect()
}

#[test]
fn the_readme_documents_exactly_the_config_keys_there_are() {
    let mut documented = BTreeSet::new();
    for cell in readme_table("## Configuration") {
        // "`[[models]]` `trigger`, `target`" and "`summary.enabled`".
        let names: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
        match names.split_first() {
            Some((&"[[models]]", rest)) => {
                for n in rest {
                    documented.insert(format!("models.{n}"));
                }
            }
            _ => {
                for n in names {
                    documented.insert(n.to_string());
                }
            }
        }
    }
    let schema = schema_keys();
    let missing: Vec<_> = schema.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&schema).collect();
    assert!(
        missing.is_empty(),
        "keys the README does not document: {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "README keys that do not exist: {unknown:?}"
    );
}

#[test]
fn the_readme_documents_exactly_the_metrics_there_are() {
    let documented: BTreeSet<String> = readme_table("## Metrics")
        .into_iter()
        .map(|c| c.trim_matches('`').to_string())
        .collect();
    let metrics = Metrics::new().unwrap();
    let exported: BTreeSet<String> = metrics.names().iter().cloned().collect();
    let missing: Vec<_> = exported.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "metrics the README does not document: {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "README metrics that do not exist: {unknown:?}"
    );
}

#[test]
fn the_shipped_config_file_names_only_schema_keys() {
    let file: toml::Value = toml::from_str(&read("config/condense.toml")).unwrap();
    let mut keys = BTreeSet::new();
    flatten("", &file, &mut keys);
    let schema = schema_keys();
    for k in keys {
        assert!(schema.contains(&k), "{k}");
    }
    assert!(Path::new(&root().join("config/condense.toml")).exists());
}
