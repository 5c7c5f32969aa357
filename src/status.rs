//! `sentinel-guard status`: who holds a lock, without taking or disturbing it. Exit codes follow LSB
//! `status`, so scripts and probes can branch on them.

use std::io::Write;

use serde_json::{json, Map, Value};

use crate::backend::{self, HolderInfo};
use crate::cli::OutputFormat;
use crate::config::StatusConfig;
use crate::record::RecordFacts;
use crate::vocab::{EXIT_UNAVAILABLE, EXIT_USAGE};
use crate::window::Claim;

/// The facts `status --format json` gives as numbers.
const NUMBERS: &[&str] = &[
    "pid",
    "locked_by_pid",
    "connection_id",
    "backend_pid",
    "command_secs",
    "fencing_token",
    "last_window_exit_code",
];

pub const EXIT_HELD: u8 = 0;
pub const EXIT_FREE: u8 = 3;

pub async fn run(config: &StatusConfig) -> u8 {
    let answer = backend::status(
        &config.target,
        &config.name,
        config.connect_timeout,
        config.check_timeout,
    )
    .await;
    match answer {
        Ok(holder) => {
            // Scheduled runs' last window, when the lock has ever been used for them.
            let claim = or_warn(
                "the last claimed window",
                backend::last_claim(
                    &config.target,
                    &config.name,
                    config.connect_timeout,
                    config.check_timeout,
                )
                .await,
            );
            let record = or_warn(
                "the lock record",
                backend::last_record(
                    &config.target,
                    &config.name,
                    config.connect_timeout,
                    config.check_timeout,
                )
                .await,
            );
            print_line(&render(config, holder.as_ref(), record, claim.as_ref()));
            if holder.is_some() {
                EXIT_HELD
            } else {
                EXIT_FREE
            }
        }
        // A path that is no lock file is a mistake in the invocation, as for the guard itself.
        Err(e @ backend::LockError::NotALockFile(_)) => {
            say_error(config, &e);
            EXIT_USAGE
        }
        Err(e) => {
            say_error(config, &e);
            EXIT_UNAVAILABLE
        }
    }
}

/// An error in the format asked for: with `--format json`, one JSON object on stdout, whose
/// `error` a script reads where it reads `state` (the exit code says which case it is).
fn say_error(config: &StatusConfig, error: &backend::LockError) {
    match config.format {
        OutputFormat::Text => eprintln!("sentinel-guard: error: {error}"),
        OutputFormat::Json => print_line(
            &json!({
                "name": config.name.as_str(),
                "backend": config.target.backend_name(),
                "url": config.target.location(),
                "state": Value::Null,
                "error": error.to_string(),
            })
            .to_string(),
        ),
    }
}

/// What was read, or nothing with a warning: the holder is the answer, the rest is detail.
fn or_warn<T>(what: &str, read: Result<Option<T>, backend::LockError>) -> Option<T> {
    read.unwrap_or_else(|e| {
        eprintln!("sentinel-guard: warning: cannot read {what}: {e}");
        None
    })
}

/// A closed stdout (`status | head -c1`) is a reader that has seen enough, not an error: the exit
/// code still gives the answer.
fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("sentinel-guard: error: cannot write to stdout: {e}");
        }
        _ => {}
    }
}

fn render(
    config: &StatusConfig,
    holder: Option<&HolderInfo>,
    record: Option<RecordFacts>,
    claim: Option<&Claim>,
) -> String {
    let claim_facts = claim.map(Claim::facts).unwrap_or_default();
    // The Redis holder already names its lease's token.
    let record_facts: Vec<_> = record
        .map(RecordFacts::facts)
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| !holder.is_some_and(|h| h.fields().iter().any(|(k, _)| k == key)))
        .collect();
    let state = if holder.is_some() { "held" } else { "free" };
    let key = backend::lock_key(&config.target, &config.name);
    match config.format {
        OutputFormat::Text => {
            let mut line = format!(
                "name={} backend={} url={} state={state}",
                config.name,
                config.target.backend_name(),
                config.target.location()
            );
            if let Some(key) = key {
                line.push_str(&format!(" key={key}"));
            }
            if let Some(holder) = holder {
                line.push(' ');
                line.push_str(&holder.to_string());
            }
            for (key, value) in record_facts.iter().chain(&claim_facts) {
                line.push_str(&format!(" {key}={value}"));
            }
            line
        }
        OutputFormat::Json => {
            // The facts that are numbers as JSON numbers (64-bit integers); the rest, holder ids
            // and host names that may happen to be all digits among them, as strings.
            let typed = |key: &str, value: &String| {
                let number = NUMBERS.contains(&key) || key.ends_with("_ms");
                match (number, value.parse::<i64>(), value.parse::<u64>()) {
                    (true, Ok(n), _) => json!(n),
                    (true, _, Ok(n)) => json!(n),
                    _ => Value::String(value.clone()),
                }
            };
            let object = |facts: &[(&'static str, String)]| {
                Value::Object(
                    facts
                        .iter()
                        .map(|(k, v)| (k.to_string(), typed(k, v)))
                        .collect::<Map<_, _>>(),
                )
            };
            let mut answer = json!({
                "name": config.name.as_str(),
                "backend": config.target.backend_name(),
                "url": config.target.location(),
                "state": state,
                "holder": holder.map(|h| object(h.fields())),
                "record": record.map(|_| object(&record_facts)),
                "last_window": claim.map(|_| object(&claim_facts)),
            });
            if let Some(key) = key {
                answer["key"] = json!(key);
            }
            answer.to_string()
        }
    }
}
