//! sentinel-guard: parse and validate the configuration, run the guard on a single-threaded runtime,
//! and turn how the run ended into an exit code.

mod backend;
mod cli;
mod config;
mod holder;
mod outcome;
mod run;
mod status;
mod supervisor;

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, Parser};
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, LogFormat};
use crate::config::{Config, Invocation};
use crate::outcome::{Outcome, EXIT_INTERNAL, EXIT_USAGE};

fn main() -> ExitCode {
    // The guard's own watchdog process, not a command for operators (hidden from --help).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|arg| arg == "__watchdog")
    {
        init_logging(LogFormat::Text);
        let args: Vec<String> = std::env::args_os()
            .skip(2)
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        return supervisor::watchdog::main(&args);
    }
    let cli = Cli::parse();
    let guard_switch =
        std::env::var_os("SINGLE_INSTANCE_GUARD").map(|v| v.to_string_lossy().into_owned());
    let invocation = match Invocation::from_cli(cli, guard_switch.as_deref()) {
        Ok(invocation) => invocation,
        Err(e) => {
            eprintln!("sentinel-guard: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match invocation {
        Invocation::Guard(config) => {
            init_logging(config.log_format);
            match guard(&config) {
                Ok(outcome) => {
                    ExitCode::from(outcome.exit_code(config.held_exit_code, &config.exit_code_map))
                }
                Err(e) => {
                    tracing::error!(lock = %config.name, error = format!("{e:#}"), "guard failed");
                    ExitCode::from(EXIT_INTERNAL)
                }
            }
        }
        Invocation::Man => print_generated(|out| clap_mangen::Man::new(Cli::command()).render(out)),
        Invocation::Completions(shell) => print_generated(|out| {
            clap_complete::generate(shell, &mut Cli::command(), "sentinel-guard", out);
            Ok(())
        }),
        Invocation::Status(config) => match runtime() {
            Ok(runtime) => ExitCode::from(runtime.block_on(status::run(&config))),
            Err(e) => {
                eprintln!("sentinel-guard: error: {e:#}");
                ExitCode::from(EXIT_INTERNAL)
            }
        },
    }
}

/// Man page and completions come from the clap definition itself, so they never drift from the CLI.
fn print_generated(
    render: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>,
) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match render(&mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sentinel-guard: error: {e}");
            ExitCode::from(EXIT_INTERNAL)
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Runs on the main thread: the app is spawned from it, and its PR_SET_PDEATHSIG is tied to the
/// spawning thread, which must therefore live as long as the guard.
fn guard(config: &Config) -> anyhow::Result<Outcome> {
    Ok(runtime()?.block_on(run::run(config)))
}

fn init_logging(format: LogFormat) {
    let filter =
        EnvFilter::try_from_env("SENTINEL_GUARD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .init(),
    }
}
