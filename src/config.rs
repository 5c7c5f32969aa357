//! The validated configuration: every rule about flags, names, URLs and timings is checked here,
//! once, before any network I/O. The rest of the program only ever sees a `Config`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;
use thiserror::Error;

use crate::cli::{Cli, ForwardTo, LogFormat};

/// A configuration mistake: reported with exit code 2 before anything is contacted.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct ConfigError(String);

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError(message.into())
}

/// Room, on top of the guard's own detection bound, for scheduling delays on the guard's host and
/// network latency, before a MySQL server may free the lock of a silent connection.
pub const MYSQL_SAFETY_MARGIN: Duration = Duration::from_secs(5);
/// The largest `wait_timeout` MySQL and MariaDB accept on Unix.
const MYSQL_MAX_WAIT_TIMEOUT_SECS: u64 = 31_536_000;
const MIN_CHECK_INTERVAL: Duration = Duration::from_millis(100);
const MIN_CHECK_TIMEOUT: Duration = Duration::from_millis(100);
const MAX_NAME_LEN: usize = 64;

#[derive(Debug)]
pub struct Config {
    pub name: LockName,
    /// `None` when `SINGLE_INSTANCE_GUARD=false`: the command runs with no lock at all.
    pub target: Option<Target>,
    pub timings: Timings,
    pub held_exit_code: u8,
    pub stop_signal: Signal,
    pub forward_to: ForwardTo,
    pub exit_code_map: ExitCodeMap,
    pub max_runtime: Option<Duration>,
    pub log_format: LogFormat,
    pub command: Vec<OsString>,
}

impl Config {
    /// `guard_switch` is the raw value of `SINGLE_INSTANCE_GUARD`, if set.
    pub fn from_cli(cli: Cli, guard_switch: Option<&str>) -> Result<Config, ConfigError> {
        let guarded = parse_guard_switch(guard_switch)?;
        let name = LockName::parse(&cli.name)?;
        let raw_url = match (&cli.url, &cli.url_file) {
            (Some(url), _) => Some(url.clone()),
            (None, Some(path)) => Some(read_url_file(path)?),
            (None, None) => None,
        };
        let target = raw_url.as_deref().map(Target::parse).transpose()?;
        if guarded && target.is_none() {
            return Err(invalid(
                "no lock backend: set --url or --url-file (SENTINEL_GUARD_URL / SENTINEL_GUARD_URL_FILE), \
                 or SINGLE_INSTANCE_GUARD=false to run unguarded",
            ));
        }
        let timings = Timings {
            check_interval: cli.check_interval,
            check_timeout: cli.check_timeout,
            connect_timeout: cli.connect_timeout,
            grace_period: cli.grace_period,
        };
        timings.validate(target.as_ref())?;
        if cli.max_runtime == Some(Duration::ZERO) {
            return Err(invalid("--max-runtime must be longer than 0s"));
        }
        Ok(Config {
            name,
            target: if guarded { target } else { None },
            timings,
            held_exit_code: cli.held_exit_code,
            stop_signal: parse_signal(&cli.stop_signal)?,
            forward_to: cli.forward_to,
            exit_code_map: ExitCodeMap::parse(&cli.exit_code_map)?,
            max_runtime: cli.max_runtime,
            log_format: cli.log_format,
            command: cli.command,
        })
    }
}

fn parse_guard_switch(value: Option<&str>) -> Result<bool, ConfigError> {
    let Some(value) = value else { return Ok(true) };
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(invalid(format!(
            "SINGLE_INSTANCE_GUARD={value:?} is neither true/1/yes/on nor false/0/no/off"
        ))),
    }
}

fn read_url_file(path: &Path) -> Result<String, ConfigError> {
    let contents = std::fs::read_to_string(path)
        .map_err(|e| invalid(format!("--url-file {}: {e}", path.display())))?;
    let url = contents
        .strip_suffix('\n')
        .map(|s| s.strip_suffix('\r').unwrap_or(s))
        .unwrap_or(&contents);
    if url.is_empty() {
        return Err(invalid(format!(
            "--url-file {}: the file is empty",
            path.display()
        )));
    }
    Ok(url.to_owned())
}

/// A lock name that is valid on every backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockName(String);

impl LockName {
    pub fn parse(raw: &str) -> Result<LockName, ConfigError> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || "._:/-".contains(c);
        if raw.is_empty() || raw.len() > MAX_NAME_LEN {
            return Err(invalid(format!(
                "--name {raw:?}: must be 1-{MAX_NAME_LEN} characters (MySQL's limit), got {}",
                raw.len()
            )));
        }
        if let Some(bad) = raw.chars().find(|c| !allowed(*c)) {
            return Err(invalid(format!(
                "--name {raw:?}: character {bad:?} is not allowed (use A-Z a-z 0-9 . _ : / -)"
            )));
        }
        Ok(LockName(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for LockName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where the lock lives, chosen by the URL scheme.
#[derive(Debug)]
pub enum Target {
    Mysql(MysqlTarget),
    File(PathBuf),
}

#[derive(Debug, Clone)]
pub struct MysqlTarget {
    pub opts: mysql_async::Opts,
    /// The URL with its password replaced, the only form that may be printed.
    pub redacted_url: String,
    /// The password, so that any text that echoes it back can be scrubbed before printing.
    pub password: Option<String>,
}

impl Target {
    pub fn parse(raw: &str) -> Result<Target, ConfigError> {
        let mut url = url::Url::parse(raw)
            .map_err(|e| invalid(format!("--url: not a valid URL ({e}); expected mysql://user:pass@host:port/db or file:///abs/path.lock")))?;
        match url.scheme() {
            "mysql" => {
                let password = url
                    .password()
                    .map(|p| percent_encoding::percent_decode_str(p).decode_utf8_lossy().into_owned());
                if url.password().is_some() {
                    let _ = url.set_password(Some("***"));
                }
                let redacted_url = url.to_string();
                let opts = mysql_async::Opts::from_url(raw)
                    .map_err(|e| invalid(format!("--url {redacted_url}: {e}")))?;
                Ok(Target::Mysql(MysqlTarget { opts, redacted_url, password }))
            }
            "file" => {
                if !matches!(url.host_str(), None | Some("") | Some("localhost")) {
                    return Err(invalid(format!(
                        "--url {url}: a file lock is local to this host; use file:///abs/path.lock"
                    )));
                }
                let path = url
                    .to_file_path()
                    .map_err(|()| invalid(format!("--url {url}: not an absolute file path")))?;
                if path.file_name().is_none() || raw.ends_with('/') {
                    return Err(invalid(format!("--url {url}: names a directory, not a lock file")));
                }
                Ok(Target::File(path))
            }
            "redis" | "rediss" => Err(invalid(format!(
                "--url: the {}:// backend is not available in this version; use mysql:// or file://",
                url.scheme()
            ))),
            other => Err(invalid(format!(
                "--url: unsupported scheme {other:?}; expected mysql:// or file://"
            ))),
        }
    }

    pub fn backend_name(&self) -> &'static str {
        match self {
            Target::Mysql(_) => "mysql",
            Target::File(_) => "file",
        }
    }
}

/// The timing knobs and the one inequality they must keep.
///
/// Every duration is measured on the guard's monotonic clock. The guard proves ownership every
/// `check_interval`; a proof that takes longer than `check_timeout` counts as a lost lock; once the lock
/// is lost the command gets `grace_period` between the stop signal and SIGKILL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    pub check_interval: Duration,
    pub check_timeout: Duration,
    pub connect_timeout: Duration,
    pub grace_period: Duration,
}

impl Timings {
    /// The longest a silent (partitioned or stalled) backend can go unnoticed: one check is outstanding
    /// for at most `check_interval + check_timeout`.
    pub fn detection_bound(&self) -> Duration {
        self.check_interval + self.check_timeout
    }

    /// The MySQL session `wait_timeout`, in whole seconds: the server frees the lock of a silent
    /// connection only after the guard has detected the silence and killed its command.
    pub fn mysql_wait_timeout_secs(&self) -> u64 {
        let needed = self.detection_bound() + self.grace_period + MYSQL_SAFETY_MARGIN;
        needed.as_secs() + u64::from(needed.subsec_nanos() > 0)
    }

    pub fn validate(&self, target: Option<&Target>) -> Result<(), ConfigError> {
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if self.check_interval < MIN_CHECK_INTERVAL {
            return Err(invalid(format!(
                "--check-interval {} is below the minimum of {}",
                show(self.check_interval),
                show(MIN_CHECK_INTERVAL)
            )));
        }
        if self.check_timeout < MIN_CHECK_TIMEOUT {
            return Err(invalid(format!(
                "--check-timeout {} is below the minimum of {}",
                show(self.check_timeout),
                show(MIN_CHECK_TIMEOUT)
            )));
        }
        if self.connect_timeout.is_zero() {
            return Err(invalid("--connect-timeout must be longer than 0s"));
        }
        if let Some(Target::Mysql(_)) = target {
            let wait_timeout = self.mysql_wait_timeout_secs();
            if wait_timeout > MYSQL_MAX_WAIT_TIMEOUT_SECS {
                return Err(invalid(format!(
                    "the MySQL server must not free the lock before the guard has stopped the command, \
                     which needs wait_timeout = check-interval {} + check-timeout {} + grace-period {} + margin {} = {wait_timeout}s, \
                     above the server's maximum of {MYSQL_MAX_WAIT_TIMEOUT_SECS}s: shorten --grace-period or --check-interval",
                    show(self.check_interval),
                    show(self.check_timeout),
                    show(self.grace_period),
                    show(MYSQL_SAFETY_MARGIN),
                )));
            }
        }
        Ok(())
    }
}

/// Accepts `TERM`, `SIGTERM` (any case) or a number.
pub fn parse_signal(raw: &str) -> Result<Signal, ConfigError> {
    let trimmed = raw.trim();
    let parsed = match trimmed.parse::<i32>() {
        Ok(number) => Signal::try_from(number).ok(),
        Err(_) => {
            let upper = trimmed.to_ascii_uppercase();
            let full = if upper.starts_with("SIG") {
                upper
            } else {
                format!("SIG{upper}")
            };
            full.parse::<Signal>().ok()
        }
    };
    parsed.ok_or_else(|| {
        invalid(format!(
            "--stop-signal {raw:?}: not a signal name or number"
        ))
    })
}

/// `--exit-code-map FROM=TO`: rewrites the command's exit status before the guard exits with it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ExitCodeMap(BTreeMap<u8, u8>);

impl ExitCodeMap {
    pub fn parse(entries: &[String]) -> Result<ExitCodeMap, ConfigError> {
        let mut map = BTreeMap::new();
        for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let bad = || {
                invalid(format!(
                    "--exit-code-map {entry:?}: expected FROM=TO with codes 0-255"
                ))
            };
            let (from, to) = entry.split_once('=').ok_or_else(bad)?;
            let from: u8 = from.trim().parse().map_err(|_| bad())?;
            let to: u8 = to.trim().parse().map_err(|_| bad())?;
            if map.insert(from, to).is_some() {
                return Err(invalid(format!("--exit-code-map: {from} is mapped twice")));
            }
        }
        Ok(ExitCodeMap(map))
    }

    pub fn apply(&self, code: u8) -> u8 {
        self.0.get(&code).copied().unwrap_or(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timings(interval: u64, timeout: u64, grace: u64) -> Timings {
        Timings {
            check_interval: Duration::from_millis(interval),
            check_timeout: Duration::from_millis(timeout),
            connect_timeout: Duration::from_secs(5),
            grace_period: Duration::from_millis(grace),
        }
    }

    #[test]
    fn timing_rules_accept_safe_configs_and_refuse_unsafe_ones() {
        let mysql = Target::parse("mysql://u:p@127.0.0.1:3306/db").unwrap();
        let file = Target::parse("file:///tmp/x.lock").unwrap();
        let cases: &[(Timings, Option<&Target>, bool)] = &[
            (timings(1000, 2000, 10_000), Some(&mysql), true),
            (timings(100, 100, 0), Some(&mysql), true),
            (timings(99, 2000, 10_000), Some(&file), false),
            (timings(1000, 99, 10_000), Some(&mysql), false),
            (timings(1000, 2000, 31_536_000_000), Some(&mysql), false),
            (timings(1000, 2000, 31_536_000_000), Some(&file), true),
            (timings(1000, 2000, 10_000), None, true),
        ];
        for (t, target, ok) in cases {
            assert_eq!(t.validate(*target).is_ok(), *ok, "{t:?} with {target:?}");
        }
    }

    #[test]
    fn mysql_wait_timeout_covers_detection_grace_and_margin() {
        assert_eq!(timings(1000, 2000, 10_000).mysql_wait_timeout_secs(), 18);
        assert_eq!(timings(200, 500, 1000).mysql_wait_timeout_secs(), 7);
    }

    #[test]
    fn lock_names_are_portable() {
        assert!(LockName::parse("billing").is_ok());
        assert!(LockName::parse("team/app:v1.2_x-y").is_ok());
        assert!(LockName::parse(&"a".repeat(64)).is_ok());
        assert!(LockName::parse(&"a".repeat(65)).is_err());
        assert!(LockName::parse("").is_err());
        assert!(LockName::parse("has space").is_err());
        assert!(LockName::parse("quote'").is_err());
    }

    #[test]
    fn signals_parse_by_name_short_name_and_number() {
        assert_eq!(parse_signal("TERM").unwrap(), Signal::SIGTERM);
        assert_eq!(parse_signal("sigterm").unwrap(), Signal::SIGTERM);
        assert_eq!(parse_signal("15").unwrap(), Signal::SIGTERM);
        assert_eq!(parse_signal("QUIT").unwrap(), Signal::SIGQUIT);
        assert!(parse_signal("NOPE").is_err());
        assert!(parse_signal("0").is_err());
    }

    #[test]
    fn guard_switch_accepts_documented_spellings_only() {
        assert!(parse_guard_switch(None).unwrap());
        for on in ["true", "1", "YES", "On"] {
            assert!(parse_guard_switch(Some(on)).unwrap());
        }
        for off in ["false", "0", "No", "OFF"] {
            assert!(!parse_guard_switch(Some(off)).unwrap());
        }
        assert!(parse_guard_switch(Some("maybe")).is_err());
    }

    #[test]
    fn mysql_url_is_redacted_and_password_kept_for_scrubbing() {
        let Target::Mysql(t) = Target::parse("mysql://guard:s%40cret@db:3306/app").unwrap() else {
            panic!("not mysql")
        };
        assert_eq!(t.redacted_url, "mysql://guard:***@db:3306/app");
        assert_eq!(t.password.as_deref(), Some("s@cret"));
    }

    #[test]
    fn file_urls_must_be_absolute_local_files() {
        assert!(matches!(
            Target::parse("file:///var/lock/x.lock"),
            Ok(Target::File(_))
        ));
        assert!(Target::parse("file://otherhost/x.lock").is_err());
        assert!(Target::parse("file:///var/lock/").is_err());
        assert!(Target::parse("ftp://x/y").is_err());
    }

    #[test]
    fn exit_code_map_parses_and_applies() {
        let map = ExitCodeMap::parse(&["143=0".into(), " 1 = 3 ".into()]).unwrap();
        assert_eq!(map.apply(143), 0);
        assert_eq!(map.apply(1), 3);
        assert_eq!(map.apply(7), 7);
        assert!(ExitCodeMap::parse(&["143".into()]).is_err());
        assert!(ExitCodeMap::parse(&["256=0".into()]).is_err());
        assert!(ExitCodeMap::parse(&["1=2".into(), "1=3".into()]).is_err());
    }
}
