//! The `condense` command line.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use condense::config::Config;
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
