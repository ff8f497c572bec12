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
    match cli.command.unwrap_or(Command::Serve) {
        Command::CheckConfig => {
            let mut out = std::io::stdout().lock();
            if out.write_all(config.to_redacted_toml().as_bytes()).is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Command::Serve => serve(config),
        Command::Compact {
            file,
            model,
            window,
        } => compact(&config, &file, CompactOptions { model, window }),
    }
}

fn compact(config: &Config, file: &Path, options: CompactOptions) -> ExitCode {
    let read = if file == Path::new("-") {
        let mut buf = Vec::new();
        std::io::stdin().read_to_end(&mut buf).map(|_| buf)
    } else {
        std::fs::read(file)
    };
    let body = match read {
        Ok(b) => b,
        Err(e) => {
            eprintln!("condense: cannot read {}: {e}", file.display());
            return ExitCode::from(2);
        }
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

fn serve(config: Config) -> ExitCode {
    condense::logging::init(&config.log);
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
        let server = match Server::start(&config).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(
            listen = %server.local_addr(),
            upstream = %config.upstream.base_url,
            "condense listening"
        );
        match server.run_until_signal().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "server failed");
                ExitCode::FAILURE
            }
        }
    })
}
