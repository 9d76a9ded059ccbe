//! `cleave-incast`: the two ends of `cleave bench incast` (python/cleave/bench/incast.py).
//! `ranker` receives messages from many senders under incast control and prints one JSON
//! line of measurements; `senders` runs a group of bursty senders on one host.

mod clock;
mod data;
mod ranker;
mod sender;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cleave-incast",
    version,
    about = "incast control bench: ranker and senders"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Receive under incast control; print ready, then a JSON line when the senders are done.
    Ranker(ranker::Args),
    /// Run bursty senders to one ranker.
    Senders(sender::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CLEAVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("cleave-incast: cannot start the runtime: {err}");
            return std::process::ExitCode::from(1);
        }
    };
    let result = match cli.command {
        Command::Ranker(args) => runtime
            .block_on(ranker::run(args))
            .map_err(|e| e.to_string()),
        Command::Senders(args) => runtime
            .block_on(sender::run(args))
            .map_err(|e| e.to_string()),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("cleave-incast: {err}");
            std::process::ExitCode::from(1)
        }
    }
}
