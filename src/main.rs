//! The `condense` command line.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use condense::config::Config;
use condense::offline::CompactOptions;
use condense::server::Server;

#[derive(Parser)]
#[command(
    name = "condense",
    version,
    about = "An OpenAI-compatible proxy that keeps long agent conversations inside the model's context window"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Configuration file (default: config/condense.toml when it exists).
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy (the default).
    Serve,
    /// Validate the configuration and print it, secrets redacted.
    CheckConfig,
    /// Exit 0 when the proxy configured here answers `/healthz` (for
    /// container health checks; the image has no curl).
    Healthcheck {
        /// The health URL (default: /healthz on `server.listen`, with an
        /// unspecified address replaced by 127.0.0.1).
        #[arg(long, value_name = "URL")]
        url: Option<String>,
    },
    /// Compact one chat request body offline: the body goes to stdout, a
    /// JSON report (tokens, window, budget, pressure, actions) to stderr.
    Compact {
        /// The request body file, or - for stdin.
        file: PathBuf,
        /// Treat the request as being for this model (window, encoding).
        #[arg(long)]
        model: Option<String>,
        /// Use this context window instead of the model's.
        #[arg(long, value_name = "N")]
        window: Option<u64>,
    },
    /// Replay a recorded conversation turn by turn through condense (in
    /// process, offline) to a simulated provider, and report tokens, prefix
    /// stability, probe retention and failed turns per turn, next to two
    /// common strategies. Given several conversations, report each one's
    /// totals and their means.
    Replay {
        /// Chat requests whose messages are each a whole conversation.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Use this context window instead of the model's.
        #[arg(long, value_name = "N")]
        window: Option<u64>,
        /// Treat the conversation as being for this model.
        #[arg(long)]
        model: Option<String>,
        /// A JSON list of probes: {"text", "first_message_index"} facts
        /// whose survival is measured. With several conversations, a
        /// directory holding each one's list under the conversation's file
        /// name or as NAME.probes.json.
        #[arg(long, value_name = "PATH")]
        probes: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Summarize old turns with this OpenAI-compatible API (its
        /// `/chat/completions`, model from `summary.model` or the
        /// conversation, key from `summary.api_key` or `upstream.api_key`)
        /// instead of dropping them; the report counts the calls and tokens.
        #[arg(long, value_name = "URL")]
        upstream: Option<String>,
        /// How the simulated provider counts prompt tokens: `o200k` (as
        /// condense does), `chars:N` (N characters of text per token, e.g.
        /// chars:3.6 for a Llama-like tokenizer), `bytes:N`, or `mix:T,P`
        /// (T characters per token in tool output, call arguments and tool
        /// schemas, P in the rest: a ratio that moves with the content
        /// mix). condense learns the difference from its usage, as in
        /// production.
        #[arg(long, value_name = "RULE", default_value = "o200k")]
        provider_count: condense::simulate::CountRule,
        /// The window the provider enforces (default: the window condense
        /// applies, i.e. --window or the model's).
        #[arg(long, value_name = "N")]
        provider_window: Option<u64>,
        /// The server behind chat completions, and so its overflow error:
        /// `openai` (names the window, the prompt and any max_tokens),
        /// `llamacpp` (exceed_context_size_error, for a prompt that fills
        /// the window) or `bare` (no numbers). Messages and Responses
        /// bodies get their own API's wordings.
        #[arg(long, value_name = "STYLE", default_value = "openai")]
        provider_errors: condense::simulate::OverflowStyle,
        /// The provider's /models listing names its window (as vLLM's
        /// max_model_len does).
        #[arg(long)]
        provider_lists_window: bool,
        /// Write every request body the provider received to DIR, one
        /// folder per conversation, numbered in order (`NNNN.json`, or
        /// `NNNN.rejected.json` for one it refused): what condense sent.
        #[arg(long, value_name = "DIR")]
        dump: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("condense: {e}");
            return ExitCode::from(2);
        }
    };
    // Variables such as CONDENSE_BIN belong to something else: named, never
    // fatal (see config/env.rs).
    let ignored = condense::config::ignored_variables();
    match cli.command.unwrap_or(Command::Serve) {
        Command::CheckConfig => {
            for name in &ignored {
                eprintln!("condense: warning: {name} {NOT_CONFIGURATION}");
            }
            // The CA file (upstream.ca_file, or SSL_CERT_FILE's) is read as
            // `serve` would read it.
            if let Err(e) = condense::upstream::trust::Trust::from_config(&config.upstream) {
                eprintln!("condense: {e}");
                return ExitCode::FAILURE;
            }
            let mut out = std::io::stdout().lock();
            if out.write_all(config.to_redacted_toml().as_bytes()).is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Command::Serve => serve(config, &ignored),
        Command::Healthcheck { url } => healthcheck(&config, url),
        Command::Compact {
            file,
            model,
            window,
        } => compact(&config, &file, CompactOptions { model, window }),
        Command::Replay {
            files,
            window,
            model,
            probes,
            json,
            upstream,
            provider_count,
            provider_window,
            provider_errors,
            provider_lists_window,
            dump,
        } => replay(
            &config,
            &files,
            &ReplayArgs {
                options: CompactOptions { model, window },
                summarizer: upstream,
                provider: condense::replay::Provider {
                    count: provider_count,
                    window: provider_window,
                    overflow: provider_errors,
                    lists_window: provider_lists_window,
                },
                dump,
            },
            probes.as_deref(),
            json,
        ),
    }
}

fn read_input(file: &Path) -> Result<Vec<u8>, ExitCode> {
    let read = if file == Path::new("-") {
        let mut buf = Vec::new();
        std::io::stdin().read_to_end(&mut buf).map(|_| buf)
    } else {
        std::fs::read(file)
    };
    read.map_err(|e| {
        eprintln!("condense: cannot read {}: {e}", file.display());
        ExitCode::from(2)
    })
}

/// How `condense replay` runs each conversation.
struct ReplayArgs {
    options: CompactOptions,
    summarizer: Option<String>,
    provider: condense::replay::Provider,
    /// Where the provider's received bodies are written (`--dump`).
    dump: Option<PathBuf>,
}

fn replay(
    config: &Config,
    files: &[PathBuf],
    args: &ReplayArgs,
    probes: Option<&Path>,
    json: bool,
) -> ExitCode {
    // What the replayed proxy logs (overflows, summarizer failures) shows
    // with RUST_LOG set; the report alone otherwise.
    if std::env::var_os("RUST_LOG").is_some() {
        condense::logging::init(&config.log);
    }
    let several = files.len() > 1;
    if several && probes.is_some_and(|p| !p.is_dir()) {
        eprintln!("condense: with several conversations, --probes names a directory");
        return ExitCode::from(2);
    }
    let mut overviews = Vec::new();
    let mut single = None;
    for file in files {
        let probe_file = probes.and_then(|p| probe_file(p, file));
        let report = match replay_one(config, file, args, probe_file.as_deref()) {
            Ok(r) => r,
            Err(code) => return code,
        };
        if several {
            let name = file.file_name().unwrap_or(file.as_os_str());
            overviews.push(condense::replay::Overview::of(
                name.to_string_lossy().into_owned(),
                report,
            ));
        } else {
            single = Some(report);
        }
    }
    let text = match (single, json) {
        (Some(r), true) => serde_json::to_string_pretty(&r).unwrap_or_default(),
        (Some(r), false) => condense::replay::render(&r),
        (None, json) => {
            let suite = condense::replay::Suite::of(overviews);
            if json {
                serde_json::to_string_pretty(&suite).unwrap_or_default()
            } else {
                condense::replay::render_suite(&suite)
            }
        }
    };
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{text}").is_err() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// The probe list for `conversation`: `probes` itself, or for a directory
/// the file in it named NAME.probes.json or like the conversation (when that
/// is not the conversation itself).
fn probe_file(probes: &Path, conversation: &Path) -> Option<PathBuf> {
    if !probes.is_dir() {
        return Some(probes.to_path_buf());
    }
    let name = conversation.file_name()?;
    let stem = conversation.file_stem()?.to_string_lossy();
    let itself = conversation.canonicalize().ok();
    let found = [
        probes.join(format!("{stem}.probes.json")),
        probes.join(name),
    ]
    .into_iter()
    .find(|p| p.is_file() && p.canonicalize().ok() != itself);
    if found.is_none() {
        eprintln!(
            "condense: no probes for {} in {}",
            conversation.display(),
            probes.display()
        );
    }
    found
}

/// One conversation's replay; errors are reported on stderr.
fn replay_one(
    config: &Config,
    file: &Path,
    args: &ReplayArgs,
    probes: Option<&Path>,
) -> Result<condense::replay::Report, ExitCode> {
    let body = read_input(file)?;
    let probes: Vec<condense::replay::Probe> = match probes {
        None => Vec::new(),
        Some(p) => match serde_json::from_slice(&read_input(p)?) {
            Ok(list) => list,
            Err(e) => {
                eprintln!("condense: {} is not a probe list: {e}", p.display());
                return Err(ExitCode::from(2));
            }
        },
    };
    let body = body.into();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("condense: cannot start the runtime: {e}");
            ExitCode::FAILURE
        })?;
    let replayed = runtime.block_on(condense::replay::replay_all(
        config,
        &body,
        &args.options,
        &probes,
        &args.provider,
        args.summarizer.as_deref(),
    ));
    let (report, received) = replayed.map_err(|e| {
        eprintln!("condense: {}: {e}", file.display());
        ExitCode::FAILURE
    })?;
    if let Some(dir) = &args.dump {
        dump(dir, file, &received)?;
    }
    Ok(report)
}

/// Writes `received` (each body the provider got, and whether it accepted
/// it) under `dir`, in a folder named like the conversation `file`.
fn dump(dir: &Path, file: &Path, received: &[(bytes::Bytes, bool)]) -> Result<(), ExitCode> {
    let stem = file
        .file_stem()
        .map_or("stdin".into(), |s| s.to_string_lossy());
    let folder = dir.join(stem.as_ref());
    let fail = |e: std::io::Error| {
        eprintln!("condense: cannot write {}: {e}", folder.display());
        ExitCode::FAILURE
    };
    std::fs::create_dir_all(&folder).map_err(fail)?;
    for (i, (body, accepted)) in received.iter().enumerate() {
        let name = if *accepted {
            format!("{:04}.json", i + 1)
        } else {
            format!("{:04}.rejected.json", i + 1)
        };
        std::fs::write(folder.join(name), body).map_err(fail)?;
    }
    Ok(())
}

fn compact(config: &Config, file: &Path, options: CompactOptions) -> ExitCode {
    let body = match read_input(file) {
        Ok(b) => b,
        Err(code) => return code,
    };
    match condense::offline::compact(config, body.into(), &options) {
        Ok((out, report)) => {
            let mut stdout = std::io::stdout().lock();
            if stdout.write_all(&out).and_then(|_| stdout.flush()).is_err() {
                return ExitCode::FAILURE;
            }
            match serde_json::to_string_pretty(&report) {
                Ok(r) => eprintln!("{r}"),
                Err(e) => eprintln!("condense: cannot render the report: {e}"),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("condense: {e}");
            ExitCode::FAILURE
        }
    }
}

fn healthcheck(config: &Config, url: Option<String>) -> ExitCode {
    let url = url.unwrap_or_else(|| {
        let mut addr = config.server.listen;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        format!("http://{addr}/healthz")
    });
    // condense's own client, with 3 seconds to connect and to answer.
    let check = async {
        let client = condense::upstream::Upstream::new(&condense::config::UpstreamConfig {
            base_url: url.clone(),
            connect_timeout_seconds: 3.0,
            first_byte_timeout_seconds: 3.0,
            ..Default::default()
        })
        .map_err(|e| e.to_string())?;
        let uri = url.parse::<http::Uri>().map_err(|e| e.to_string())?;
        let resp = client
            .send(
                http::Method::GET,
                uri,
                http::HeaderMap::new(),
                condense::upstream::Outgoing::Empty,
            )
            .await
            .map_err(|e| e.to_string())?;
        match resp.status() {
            s if s.is_success() => Ok(()),
            s => Err(format!("it answered {s}")),
        }
    };
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .and_then(|rt| rt.block_on(check));
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("condense: {url} is not healthy: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What a warning says of a `CONDENSE_` variable that is not configuration.
const NOT_CONFIGURATION: &str =
    "is not configuration (not CONDENSE_<SECTION>__<KEY>) and is ignored";

fn serve(config: Config, ignored: &[String]) -> ExitCode {
    condense::logging::init(&config.log);
    for name in ignored {
        tracing::warn!(variable = %name, "{NOT_CONFIGURATION}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("condense: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        // Before anything can be told where condense listens.
        let signal = condense::server::shutdown_signal();
        let server = match Server::start(&config).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(
            listen = %server.local_addr(),
            upstream = %condense::config::redact_url(&config.upstream.base_url),
            "condense listening"
        );
        let result = server.run_until(signal).await;
        // The access lines of the last requests, before the process ends.
        condense::logging::flush();
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "server failed");
                ExitCode::FAILURE
            }
        }
    })
}
