//! `cleave-router CONFIG.json`: the client-facing router, without Python (docs/serving.md,
//! "Executables and images"). CONFIG.json is the router config `cleave serve` writes
//! (crates/cleave-router/src/config.rs). Serves KServe v2 HTTP with `/ready` and `/live` on
//! its port; prints "listening http://ADDR [grpc=ADDR]" once bound (a launcher that passed
//! port 0 reads its ports there) and "ready http://ADDR" once every backend answered (for
//! people: launchers probe `/ready`); drains and exits 0 on SIGTERM/SIGINT.
//!
//! Exit codes: 2 for a bad flag or config (`--check` only validates it), 1 when the router
//! cannot start (port, bundle, backends never ready).

// glibc's malloc and free were a fifth of the router's CPU per request (perf, 100-candidate
// DLRM requests: each allocates its parsed tensors, lookups and replies); mimalloc's cost
// 0.88 times the CPU per request (docs/benchmarks.md, "The router's allocator"). Counted, for
// the live heap bytes in /metrics (cleave_router::heap).
#[global_allocator]
static ALLOCATOR: cleave_router::heap::Counting<mimalloc::MiMalloc> =
    cleave_router::heap::Counting(mimalloc::MiMalloc);

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use cleave_router::RouterConfig;
use cleave_wire::log::{self, LogFormat};

#[derive(Debug, Parser)]
#[command(name = "cleave-router", version, about = "The Cleave router")]
#[command(args_override_self = true)] // a flag given twice: the last wins
struct Args {
    /// The router's JSON config (what `cleave serve` writes).
    config: PathBuf,
    /// Validate the config, print "ok", and exit.
    #[arg(long)]
    check: bool,
    /// Log lines as "text" or "json" (one object per line); the level is CLEAVE_LOG's.
    #[arg(long, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// The config, or why not, naming the field: serde's own message gives only a position.
fn parse(text: &str) -> Result<RouterConfig, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    if let Err(e) = serde_path_to_error::deserialize::<_, RouterConfig>(&mut de) {
        let path = e.path().to_string();
        return Err(if path == "." {
            format!("router config: {}", e.inner())
        } else {
            format!("router config: field {path}: {}", e.inner())
        });
    }
    RouterConfig::from_json(text) // its own checks (ranges, names) after the types
}

fn main() -> ExitCode {
    let args = Args::parse(); // exits 2 naming the flag on bad input
    let path = args.config.display();
    let text = match std::fs::read_to_string(&args.config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cleave-router: cannot read {path}: {e}");
            return ExitCode::from(2);
        }
    };
    let config = match parse(&text) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cleave-router: {path}: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check {
        println!("{path}: ok");
        return ExitCode::SUCCESS;
    }
    if let Err(e) = log::init(args.log_format) {
        eprintln!("cleave-router: {e}");
        return ExitCode::from(2);
    }
    match cleave_router::run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            ExitCode::FAILURE
        }
    }
}
