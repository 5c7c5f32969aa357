//! sentinel-guard: parse and validate the configuration, run the guard on a single-threaded runtime,
//! and turn how the run ended into an exit code.

mod backend;
mod cli;
mod conceal;
mod config;
mod deadline;
mod endpoints;
mod explain;
mod guard;
mod handoff;
mod held;
mod holder;
mod input_file;
mod logging;
mod manpage;
mod metrics;
mod notify;
mod outcome;
mod record;
mod status;
mod supervisor;
mod vocab;
mod window;

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::FromArgMatches;

use crate::cli::Cli;
use crate::config::{Config, Invocation};
use crate::endpoints::Endpoints;
use crate::outcome::Outcome;
use crate::vocab::{EXIT_INTERNAL, EXIT_USAGE};

fn main() -> ExitCode {
    // Read before anything else, to narrow the moment in which a dying parent goes unnoticed by
    // --parent-death-signal.
    let parent = nix::unistd::getppid();
    // The guard's own watchdog process, not a command for operators (hidden from --help).
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if let Some(code) = supervisor::watchdog::main_if_asked(&args, backend::say_farewell) {
        return ExitCode::from(code);
    }
    let cli = cli::command()
        .try_get_matches()
        .and_then(|matches| {
            let mut cli = Cli::from_arg_matches(&matches)?;
            cli::command_line_wins(&mut cli, &matches);
            Ok(cli)
        })
        .unwrap_or_else(|e| with_separator_hint(e).exit());
    // Read: from here on, no process of the guard's user can read the URL from the guard.
    conceal::conceal_credentials();
    let guard_switch =
        std::env::var_os(cli::GUARD_SWITCH_VAR).map(|v| v.to_string_lossy().into_owned());
    // A refused configuration is said in the format the operator's log pipeline reads.
    let json_errors = cli.subcommand.is_none() && cli.log_format == cli::LogFormat::Json;
    let invocation = match Invocation::from_cli(cli, guard_switch.as_deref()) {
        Ok(invocation) => invocation,
        Err(e) if json_errors => {
            eprintln!(
                "{}",
                logging::json_error_line(
                    "config_invalid",
                    "configuration refused; nothing was contacted",
                    &e.to_string()
                )
            );
            return ExitCode::from(EXIT_USAGE);
        }
        Err(e) => {
            eprintln!("sentinel-guard: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match invocation {
        Invocation::Guard(config) => {
            let _flush = logging::init(config.log_format);
            notify::init();
            // Bound first: a taken address is a mistake in the invocation, reported before any lock.
            let endpoints = match config.metrics_addr.map(Endpoints::bind).transpose() {
                Ok(endpoints) => endpoints,
                Err(e) => {
                    tracing::error!(name = %config.name, event = "metrics_addr_unavailable", error = %e, "guard not started");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            match guard(&config, endpoints, parent) {
                Ok(outcome) => {
                    ExitCode::from(outcome.exit_code(config.held_exit_code, &config.exit_code_map))
                }
                Err(e) => {
                    tracing::error!(name = %config.name, event = "guard_failed", error = format!("{e:#}"), "guard failed");
                    ExitCode::from(EXIT_INTERNAL)
                }
            }
        }
        Invocation::Held {
            min_validity,
            format,
        } => ExitCode::from(held::ask(min_validity, format == cli::OutputFormat::Json)),
        Invocation::Explain { config, format } => print_generated(|out| {
            out.write_all(explain::render(&config, format == cli::OutputFormat::Json).as_bytes())?;
            if format == cli::OutputFormat::Json {
                out.write_all(b"\n")?;
            }
            Ok(())
        }),
        Invocation::Man => print_generated(|out| manpage::render(cli::command(), out)),
        Invocation::Completions(shell) => print_generated(|out| {
            // clap_complete panics on a failed write, so it writes to memory first.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cli::command(), "sentinel-guard", &mut script);
            out.write_all(&script)
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
    match render(&mut stdout).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        // `sentinel-guard man | head`: the reader has read all it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sentinel-guard: error: {e}");
            ExitCode::from(EXIT_INTERNAL)
        }
    }
}

/// A command given without `--` before it is what clap calls an unexpected argument; the error then
/// shows the form that works.
fn with_separator_hint(mut error: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let args: Vec<String> = std::env::args_os()
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect();
    let separated = args.iter().any(|arg| arg == "--");
    let stray = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => Some(arg.clone()),
        _ => None,
    };
    // `--wait` takes its value only after `=` (alone it means forever), which flock's `-w 30` habit
    // and `-w5s` both miss.
    let wait_value = stray.as_deref().and_then(|stray| {
        let before = args
            .iter()
            .position(|arg| arg == stray)
            .and_then(|at| at.checked_sub(1))
            .map(|at| args[at].as_str());
        match before {
            Some("--wait" | "-w") if !stray.starts_with('-') => Some(stray.to_owned()),
            _ => args
                .iter()
                .take_while(|arg| *arg != "--")
                .find_map(|arg| {
                    arg.strip_prefix("-w")
                        .filter(|v| !v.is_empty() && !v.starts_with('='))
                })
                .map(str::to_owned),
        }
    });
    let hint = match (&wait_value, &stray) {
        _ if error.kind() == ErrorKind::MissingRequiredArgument
            && matches!(
                error.get(ContextKind::InvalidArg),
                Some(ContextValue::Strings(missing)) if missing.iter().any(|m| m.contains("<COMMAND>"))
            ) =>
        {
            "give the command to guard after `--` (sentinel-guard --url URL --name NAME -- ./app), \
             or a subcommand: status, held, explain, man, completions"
                .to_owned()
        }
        (Some(value), _) if error.kind() == ErrorKind::UnknownArgument => format!(
            "--wait takes its duration after `=`: --wait={value} (--wait alone waits forever)"
        ),
        (None, Some(stray))
            if error.kind() == ErrorKind::UnknownArgument
                && !stray.starts_with('-')
                && !separated =>
        {
            "put the command after `--`: sentinel-guard [OPTIONS] -- <COMMAND> [ARGS]...".to_owned()
        }
        _ => return error,
    };
    error.insert(
        ContextKind::Suggested,
        ContextValue::StyledStrs(vec![hint.into()]),
    );
    error
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Runs on the main thread: the app is spawned from it, and its PR_SET_PDEATHSIG is tied to the
/// spawning thread, which must therefore live as long as the guard.
fn guard(
    config: &Config,
    endpoints: Option<Endpoints>,
    parent: nix::unistd::Pid,
) -> anyhow::Result<Outcome> {
    Ok(runtime()?.block_on(guard::run(config, endpoints, parent)))
}

/// In the unit tests' binary, the watchdog the guard runs (`/proc/self/exe __watchdog`) is that
/// binary, whose own `main` is the test harness: the watchdog is entered before it, as `main` enters
/// it in the guard's binary. The command line comes from `/proc`, since the standard library may not
/// have read it this early. Only as the guard runs it, `/proc/self/exe` first: a test filter
/// `__watchdog` stays a filter.
#[cfg(test)]
#[ctor::ctor(unsafe)]
fn watchdog_in_unit_tests() {
    let cmdline = std::fs::read("/proc/self/cmdline").unwrap_or_default();
    let argv: Vec<String> = cmdline
        .strip_suffix(&[0])
        .unwrap_or_default()
        .split(|byte| *byte == 0)
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect();
    let Some((program, args)) = argv.split_first() else {
        return;
    };
    if program == "/proc/self/exe" {
        if let Some(code) = supervisor::watchdog::main_if_asked(args, backend::say_farewell) {
            std::process::exit(code.into());
        }
    }
}
