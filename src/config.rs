//! The validated configuration: every rule about flags, names, URLs and timings is checked here,
//! once, before any network I/O. The rest of the program only ever sees a `Config`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use thiserror::Error;

mod etcd_target;
mod health;
mod mysql_target;
mod postgres_target;
mod redis_target;
mod schedule;
mod target;
mod timings;
mod urls;

pub use etcd_target::EtcdTarget;
pub use health::HealthCheck;
pub use mysql_target::MysqlTarget;
pub use postgres_target::{PostgresTarget, PostgresTls, SslMode};
pub use redis_target::{RedisServers, RedisTarget};
pub use target::Target;
pub use timings::Timings;
pub use urls::{CaFile, RedactedUrl, SecretUrl};

use health::health_check;
use schedule::schedule;

use crate::cli::{Cli, ForwardTo, LockArgs, LogFormat, OutputFormat, StatusArgs, Subcommand};
use crate::window::{IfUnavailable, Schedule, ScheduleMode};

/// A configuration mistake: reported with exit code 2 before anything is contacted.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct ConfigError(String);

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError(message.into())
}

impl ConfigError {
    /// The same error about a URL read from `path`: every URL error starts with `--url`, which the
    /// user never typed.
    fn said_of_url_file(self, path: &Path) -> ConfigError {
        match self.0.strip_prefix("--url") {
            Some(rest) if rest.starts_with(':') => {
                invalid(format!("--url-file {}{rest}", path.display()))
            }
            Some(rest) => invalid(format!("--url-file {}:{rest}", path.display())),
            None => self,
        }
    }
}

/// Room, on top of the guard's own detection bound, for scheduling delays on the guard's host and
/// network latency, before a MySQL or PostgreSQL server may free the lock of a silent connection.
pub const SESSION_SAFETY_MARGIN: Duration = Duration::from_secs(5);
/// The longest one server-side wait for the lock (`GET_LOCK`, `pg_advisory_lock` with a timeout)
/// lasts: a grant is accepted up to this plus `--check-timeout` after it was asked for, which the
/// server's session timeout must cover too.
pub const MAX_LOCK_WAIT_CHUNK: Duration = Duration::from_secs(2);
const MIN_CHECK_INTERVAL: Duration = Duration::from_millis(100);

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(86_400);
/// The largest value each duration option takes. Beyond it a value is a mistake (a grace period of
/// days, a unit typo), never a setting; and every deadline the guard computes from these stays far
/// from the limits of its clock arithmetic. Documented in `--help` and the README.
pub const MAX_GRACE_PERIOD: Duration = HOUR;
pub const MAX_CHECK_INTERVAL: Duration = HOUR;
pub const MAX_CHECK_TIMEOUT: Duration = Duration::from_secs(10 * 60);
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(10 * 60);
pub const MAX_TTL: Duration = DAY;
pub const MAX_RENEW_INTERVAL: Duration = DAY;
pub const MAX_TAKEOVER_DELAY: Duration = HOUR;
/// No lock is promised for longer than a lease lasts.
pub const MAX_MIN_VALIDITY: Duration = DAY;
/// humantime's year (365.25 days): `1y` is the longest wait, run or window.
const YEAR: Duration = Duration::from_secs(31_557_600);
pub const MAX_WAIT: Duration = YEAR;
pub const MAX_MAX_RUNTIME: Duration = YEAR;
pub const MAX_WINDOW: Duration = YEAR;

/// The bounds of the timeouts the guard and `status` share.
fn bound_lock_timeouts(lock: &LockArgs) -> Result<(), ConfigError> {
    at_most("--check-timeout", lock.check_timeout, MAX_CHECK_TIMEOUT)?;
    at_most(
        "--connect-timeout",
        lock.connect_timeout,
        MAX_CONNECT_TIMEOUT,
    )
}

/// `option value` must not be below `min`.
fn at_least(option: &str, value: Duration, min: Duration) -> Result<(), ConfigError> {
    if value < min {
        return Err(invalid(format!(
            "{option} {} is below the minimum of {}",
            crate::vocab::show_duration(value),
            crate::vocab::show_duration(min)
        )));
    }
    Ok(())
}

/// `option value` must not exceed `max`.
fn at_most(option: &str, value: Duration, max: Duration) -> Result<(), ConfigError> {
    if value > max {
        return Err(invalid(format!(
            "{option} {} is above its maximum of {}",
            crate::vocab::show_duration(value),
            crate::vocab::show_duration(max)
        )));
    }
    Ok(())
}
const MIN_CHECK_TIMEOUT: Duration = Duration::from_millis(100);
const MAX_NAME_LEN: usize = 64;

/// What the command line asks for.
#[derive(Debug)]
pub enum Invocation {
    Guard(Box<Config>),
    Status(StatusConfig),
    /// `held`: asks the guard whose socket the environment names.
    Held {
        min_validity: Duration,
        format: OutputFormat,
    },
    /// `explain`: the timeline of the guard's configuration given after it.
    Explain {
        config: Box<Config>,
        format: OutputFormat,
    },
    Man,
    Completions(clap_complete::Shell),
}

impl Invocation {
    /// `guard_switch` is the raw value of `SINGLE_INSTANCE_GUARD`, if set.
    pub fn from_cli(cli: Cli, guard_switch: Option<&str>) -> Result<Invocation, ConfigError> {
        match cli.subcommand {
            Some(Subcommand::Status(args)) => {
                Ok(Invocation::Status(StatusConfig::from_args(args)?))
            }
            Some(Subcommand::Held(args)) => {
                at_most("--min-validity", args.min_validity, MAX_MIN_VALIDITY)?;
                Ok(Invocation::Held {
                    min_validity: args.min_validity,
                    format: args.format,
                })
            }
            Some(Subcommand::Explain(args)) => Ok(Invocation::Explain {
                config: Box::new(explained(&args.guard_args, guard_switch)?),
                format: args.format,
            }),
            Some(Subcommand::Man) => Ok(Invocation::Man),
            Some(Subcommand::Completions { shell }) => Ok(Invocation::Completions(shell)),
            None => Ok(Invocation::Guard(Box::new(Config::from_cli(
                cli,
                guard_switch,
            )?))),
        }
    }
}

/// `explain`'s flags are the guard's own: read by the guard's parser and validated by its rules, so
/// a configuration the guard refuses is refused here with the same reason. The command is
/// optional, and stands in as `true` when left out.
fn explained(args: &[OsString], guard_switch: Option<&str>) -> Result<Config, ConfigError> {
    use clap::FromArgMatches;
    let mut argv: Vec<OsString> = vec!["sentinel-guard".into()];
    argv.extend(args.iter().cloned());
    if !args.iter().any(|arg| arg == "--") {
        argv.extend(["--".into(), "true".into()]);
    }
    let said = |e: clap::Error| {
        let text = e.render().to_string();
        invalid(text.trim().trim_start_matches("error: ").to_owned())
    };
    let matches = crate::cli::command()
        .try_get_matches_from(argv)
        .map_err(said)?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(said)?;
    if cli.subcommand.is_some() {
        return Err(invalid("explain takes the guard's flags, not a subcommand"));
    }
    crate::cli::command_line_wins(&mut cli, &matches);
    Config::from_cli(cli, guard_switch)
}

/// The guard's configuration.
#[derive(Debug)]
pub struct Config {
    pub name: LockName,
    /// `None` when `SINGLE_INSTANCE_GUARD=false`: the command runs with no lock at all.
    pub target: Option<Target>,
    pub timings: Timings,
    pub held_exit_code: u8,
    pub stop_signal: Signal,
    /// `--parent-death-signal`: the signal the guard receives when its own parent dies.
    pub parent_death_signal: Option<Signal>,
    pub wait: Wait,
    /// `--rejoin`: after a lost lock, wait for it again instead of exiting (only with a wait).
    pub rejoin: bool,
    /// `--allow-no-cgroup`: a lock may be taken where nothing stops a process that left the app's
    /// group once the guard is SIGKILLed.
    pub allow_no_cgroup: bool,
    pub takeover_delay: TakeoverDelay,
    pub forward_to: ForwardTo,
    pub exit_code_map: ExitCodeMap,
    pub max_runtime: Option<Duration>,
    /// `--every` or `--once-per`: runs in windows rather than one run under a held lock.
    pub schedule: Option<Schedule>,
    /// `--health-cmd` and its companions.
    pub health: Option<HealthCheck>,
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Options given that do not apply to the backend (`not_applicable`), said at start.
    pub ignored_options: Vec<&'static str>,
    pub log_format: LogFormat,
    pub command: Vec<OsString>,
}

/// `--takeover-delay auto|DUR`: how long a new holder keeps the lock before starting the app when
/// the previous holder's app may still be stopping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeoverDelay {
    /// The bound the previous holder recorded, or this guard's own where there is no record; none
    /// after a clean hand-over.
    Auto,
    /// This long, whatever the record says, but none after a clean hand-over; zero: never.
    Fixed(Duration),
}

impl TakeoverDelay {
    fn parse(raw: &str) -> Result<TakeoverDelay, ConfigError> {
        if raw == "auto" {
            return Ok(TakeoverDelay::Auto);
        }
        let delay = humantime::parse_duration(raw).map_err(|e| {
            invalid(format!(
                "--takeover-delay {raw:?} is neither auto nor a duration: {e}"
            ))
        })?;
        at_most("--takeover-delay", delay, MAX_TAKEOVER_DELAY)?;
        Ok(TakeoverDelay::Fixed(delay))
    }
}

/// `--wait[=DUR]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    No,
    For(Duration),
    Forever,
}

impl Wait {
    fn parse(raw: Option<&str>) -> Result<Wait, ConfigError> {
        let Some(raw) = raw else { return Ok(Wait::No) };
        match raw.trim().to_ascii_lowercase().as_str() {
            "forever" | "true" | "yes" | "on" => Ok(Wait::Forever),
            "false" | "no" | "off" => Ok(Wait::No),
            duration => {
                let limit = humantime::parse_duration(duration).map_err(|e| {
                    invalid(format!(
                        "--wait={raw}: {e}; use a duration such as 30s, or forever"
                    ))
                })?;
                at_most("--wait", limit, MAX_WAIT)?;
                Ok(Wait::For(limit))
            }
        }
    }
}

/// `status`: who holds the lock.
#[derive(Debug)]
pub struct StatusConfig {
    pub name: LockName,
    pub target: Target,
    pub connect_timeout: Duration,
    pub check_timeout: Duration,
    pub format: OutputFormat,
}

impl StatusConfig {
    fn from_args(args: StatusArgs) -> Result<StatusConfig, ConfigError> {
        let (name, target) = lock_target(&args.lock)?;
        let target = target.ok_or_else(|| {
            invalid("no lock backend: set --url or --url-file (SENTINEL_GUARD_URL / SENTINEL_GUARD_URL_FILE)")
        })?;
        // The guard's own minimum: a check of status is the guard's check.
        at_least(
            "--check-timeout",
            args.lock.check_timeout,
            MIN_CHECK_TIMEOUT,
        )?;
        if args.lock.connect_timeout.is_zero() {
            return Err(invalid("--connect-timeout must be longer than 0s"));
        }
        bound_lock_timeouts(&args.lock)?;
        Ok(StatusConfig {
            name,
            target,
            connect_timeout: args.lock.connect_timeout,
            check_timeout: args.lock.check_timeout,
            format: args.format,
        })
    }
}

/// The lock name and, when a URL was given, where the lock lives.
fn lock_target(args: &LockArgs) -> Result<(LockName, Option<Target>), ConfigError> {
    let name = args
        .name
        .as_deref()
        .ok_or_else(|| invalid("--name (or SENTINEL_GUARD_NAME) is required"))
        .and_then(LockName::parse)?;
    let raw_url = match (&args.url, &args.url_file) {
        (Some(_), Some(_)) => return Err(invalid(
            "--url and --url-file (SENTINEL_GUARD_URL and SENTINEL_GUARD_URL_FILE) are both set; \
                 give one (one given on the command line wins over one in the environment)",
        )),
        (Some(url), None) => Some((url.clone(), None)),
        (None, Some(path)) => Some((read_url_file(path)?, Some(path))),
        (None, None) => None,
    };
    let ca = args.ca_file.as_deref().map(CaFile::read).transpose()?;
    let target = raw_url
        .map(|(raw, file)| {
            // What is wrong with the URL is said of the file it came from.
            let prefix = args.redis_prefix.as_deref().unwrap_or(DEFAULT_REDIS_PREFIX);
            let target = Target::parse(&raw, prefix).map_err(|e| match file {
                Some(path) => e.said_of_url_file(path),
                None => e,
            })?;
            match &ca {
                Some(ca) => target.trusting(ca),
                None => Ok(target),
            }
        })
        .transpose()?;
    Ok((name, target))
}

impl Config {
    /// Whether an app run under a lock (`locked`) needs a cgroup of its own where the guard is not
    /// PID 1: a helper that left its process group would otherwise outlive a SIGKILLed guard and run
    /// beside the next holder's app, unless `--allow-no-cgroup` accepts that. A run without a lock
    /// (unguarded, `--if-unavailable run`) has no next holder to run beside.
    pub fn cgroup_required(&self, locked: bool) -> bool {
        locked && !self.allow_no_cgroup
    }

    fn from_cli(cli: Cli, guard_switch: Option<&str>) -> Result<Config, ConfigError> {
        let guarded = parse_guard_switch(guard_switch)?;
        if let Ok(filter) = std::env::var(crate::cli::LOG_FILTER_VAR) {
            crate::logging::check_filter(&filter).map_err(|why| {
                invalid(format!("{}={filter:?}: {why}", crate::cli::LOG_FILTER_VAR))
            })?;
        }
        let (name, mut target) = lock_target(&cli.lock)?;
        if cli.redis_min_replicas > 0 {
            match target.as_mut() {
                Some(Target::Redis(redis)) => redis.min_replicas = cli.redis_min_replicas,
                _ => {
                    return Err(invalid(
                        "--redis-min-replicas applies to a Redis lock only (redis://, redis+sentinel://, redis+cluster://)",
                    ))
                }
            }
        }
        if guarded && target.is_none() {
            return Err(invalid(
                "no lock backend: set --url or --url-file (SENTINEL_GUARD_URL / SENTINEL_GUARD_URL_FILE), \
                 or SINGLE_INSTANCE_GUARD=false to run unguarded",
            ));
        }
        let ignored = match target.as_ref().filter(|_| guarded) {
            Some(target) => not_applicable(&cli, target),
            None => Vec::new(),
        };
        let ttl = cli.ttl.unwrap_or(DEFAULT_TTL);
        // Bounds first, so every later computation stays well inside Duration's range.
        bound_lock_timeouts(&cli.lock)?;
        for (option, value, max) in [
            ("--grace-period", Some(cli.grace_period), MAX_GRACE_PERIOD),
            (
                "--check-interval",
                Some(cli.check_interval),
                MAX_CHECK_INTERVAL,
            ),
            ("--ttl", cli.ttl, MAX_TTL),
            ("--renew-interval", cli.renew_interval, MAX_RENEW_INTERVAL),
            ("--max-runtime", cli.max_runtime, MAX_MAX_RUNTIME),
        ] {
            if let Some(value) = value {
                at_most(option, value, max)?;
            }
        }
        let timings = Timings {
            check_interval: cli.check_interval,
            check_timeout: cli.lock.check_timeout,
            connect_timeout: cli.lock.connect_timeout,
            grace_period: cli.grace_period,
            ttl,
            renew_interval: cli.renew_interval.unwrap_or(ttl / 3),
        };
        timings.validate(target.as_ref())?;
        let wait = Wait::parse(cli.wait.as_deref())?;
        let takeover_delay = TakeoverDelay::parse(&cli.takeover_delay)?;
        if cli.rejoin && wait == Wait::No {
            return Err(invalid(
                "--rejoin needs --wait: a guard that rejoins after a lost lock waits for it as a standby",
            ));
        }
        if cli.max_runtime == Some(Duration::ZERO) {
            return Err(invalid("--max-runtime must be longer than 0s"));
        }
        let schedule = schedule(&cli, wait, target.as_ref())?;
        let health = health_check(&cli)?;
        if health.is_some() && schedule.is_some() {
            return Err(invalid(
                "--health-cmd cannot be used with --every or --once-per: it watches a long-running app; bound a scheduled run with --max-runtime",
            ));
        }
        Ok(Config {
            name,
            target: if guarded { target } else { None },
            timings,
            held_exit_code: cli.held_exit_code,
            stop_signal: parse_signal("--stop-signal", &cli.stop_signal)?,
            parent_death_signal: cli
                .parent_death_signal
                .as_deref()
                .map(|raw| parse_signal("--parent-death-signal", raw))
                .transpose()?,
            wait,
            rejoin: cli.rejoin,
            allow_no_cgroup: cli.allow_no_cgroup,
            takeover_delay,
            forward_to: cli.forward_to,
            exit_code_map: ExitCodeMap::parse(&cli.exit_code_map)?,
            max_runtime: cli.max_runtime,
            schedule,
            health,
            metrics_addr: cli.metrics_addr.as_deref().map(listen_addr).transpose()?,
            ignored_options: ignored,
            log_format: cli.log_format,
            command: cli.command,
        })
    }
}
/// The words every yes-or-no variable takes (`SENTINEL_GUARD_REJOIN` and
/// `SENTINEL_GUARD_ALLOW_NO_CGROUP` through clap's `BoolishValueParser`, which reads the same): any
/// case; anything else, an empty value too, exits 2.
fn parse_guard_switch(value: Option<&str>) -> Result<bool, ConfigError> {
    let Some(value) = value else { return Ok(true) };
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "t" | "1" | "yes" | "y" | "on" => Ok(true),
        "false" | "f" | "0" | "no" | "n" | "off" => Ok(false),
        _ => Err(invalid(format!(
            "{}={value:?} is neither true/1/yes/y/on/t nor false/0/no/n/off/f",
            crate::cli::GUARD_SWITCH_VAR
        ))),
    }
}

/// `--ttl`'s default: a lease not renewed for this long expires.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// `--redis-prefix`'s default.
pub const DEFAULT_REDIS_PREFIX: &str = "sentinel-guard";

/// The options given that only tune a backend other than `target`'s: ignored, and said at start.
/// (Options that promise what the backend cannot keep, `--redis-min-replicas` or `--ca-file`
/// without TLS, are refused instead.)
fn not_applicable(cli: &Cli, target: &Target) -> Vec<&'static str> {
    let leased = matches!(target, Target::Redis(_) | Target::Etcd(_));
    let redis = matches!(target, Target::Redis(_));
    [
        ("--ttl", cli.ttl.is_some() && !leased),
        ("--renew-interval", cli.renew_interval.is_some() && !leased),
        ("--redis-prefix", cli.lock.redis_prefix.is_some() && !redis),
    ]
    .into_iter()
    .filter_map(|(option, ignored)| ignored.then_some(option))
    .collect()
}

/// The one URL a `--url-file` holds. Blank lines and the whitespace around the URL (spaces, tabs, a
/// CRLF or LF line end, as editors and `kubectl create secret --from-file` leave them) are trimmed; a
/// second non-empty line is refused rather than joined into the first: a URL has no whitespace in it.
fn read_url_file(path: &Path) -> Result<String, ConfigError> {
    let shown = path.display();
    let bytes =
        crate::input_file::read(path).map_err(|e| invalid(format!("--url-file {shown}: {e}")))?;
    let contents = String::from_utf8(bytes)
        .map_err(|_| invalid(format!("--url-file {shown}: not UTF-8 text")))?;
    let mut lines = contents
        .lines()
        .map(str::trim)
        .enumerate()
        .filter(|(_, line)| !line.is_empty());
    let Some((_, url)) = lines.next() else {
        return Err(invalid(format!(
            "--url-file {shown}: the file holds no URL (it is empty or blank)"
        )));
    };
    if let Some((number, _)) = lines.next() {
        return Err(invalid(format!(
            "--url-file {shown}: line {} holds more text after the URL; the file must hold the URL alone, on one line",
            number + 1
        )));
    }
    Ok(url.to_owned())
}

/// `--metrics-addr`, in the forms Prometheus exporters take: `HOST:PORT` with an address or a name
/// (resolved now; its first address), `[v6]:PORT`, or `:PORT` for every interface.
fn listen_addr(raw: &str) -> Result<std::net::SocketAddr, ConfigError> {
    use std::net::{SocketAddr, ToSocketAddrs};
    let bad = |why: String| {
        invalid(format!(
            "--metrics-addr {raw:?}: {why}; expected HOST:PORT or :PORT"
        ))
    };
    if let Some(port) = raw.strip_prefix(':') {
        let port = port
            .parse::<u16>()
            .map_err(|e| bad(format!("port {port:?}: {e}")))?;
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    if let Ok(addr) = raw.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let Some((host, port)) = raw.rsplit_once(':') else {
        return Err(bad("no port".to_owned()));
    };
    let port = port
        .parse::<u16>()
        .map_err(|e| bad(format!("port {port:?}: {e}")))?;
    (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(e.to_string()))?
        .next()
        .ok_or_else(|| bad(format!("{host:?} has no address")))
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

/// Accepts `TERM`, `SIGTERM` (any case) or a number.
/// A signal as `option` takes it: `TERM`, `SIGTERM` or `15`.
pub fn parse_signal(option: &str, raw: &str) -> Result<Signal, ConfigError> {
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
    parsed.ok_or_else(|| invalid(format!("{option} {raw:?}: not a signal name or number")))
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

    /// A target's `Debug` (reachable through every configuration type that derives it) names no
    /// password: the drivers' own options would print it.
    #[test]
    fn no_target_debug_shows_the_password() {
        for url in [
            "mysql://u:Pw-sEcret-77@127.0.0.1:3306/db",
            "postgres://u:Pw-sEcret-77@127.0.0.1:5432/db",
            "redis://u:Pw-sEcret-77@127.0.0.1:6379",
            "etcd://u:Pw-sEcret-77@127.0.0.1:2379",
        ] {
            let target = Target::parse(url, "sg").unwrap();
            let shown = format!("{target:?}");
            assert!(!shown.contains("sEcret"), "{url}: {shown}");
        }
    }

    fn timings(interval: u64, timeout: u64, grace: u64) -> Timings {
        Timings {
            check_interval: Duration::from_millis(interval),
            check_timeout: Duration::from_millis(timeout),
            connect_timeout: Duration::from_secs(5),
            grace_period: Duration::from_millis(grace),
            ttl: Duration::from_secs(30),
            renew_interval: Duration::from_secs(10),
        }
    }

    fn lease(ttl: u64, renew: u64, timeout: u64, grace: u64) -> Timings {
        Timings {
            ttl: Duration::from_millis(ttl),
            renew_interval: Duration::from_millis(renew),
            ..timings(1000, timeout, grace)
        }
    }

    #[test]
    fn redis_lease_must_fit_a_renewal_before_the_stop_begins() {
        let redis = Target::parse("redis://127.0.0.1:6379", "sg").unwrap();
        let cases = [
            // defaults: 30s - 400ms - 10s = 19.6s >= 10s + 2s
            (lease(30_000, 10_000, 2000, 10_000), true),
            // 3s - 130ms - 1s = 1.87s >= 500ms + 500ms
            (lease(3000, 500, 500, 1000), true),
            // 10s - 200ms - 10s < 0
            (lease(10_000, 3333, 2000, 10_000), false),
            // 30s - 400ms - 10s = 19.6s < 18s + 2s
            (lease(30_000, 18_000, 2000, 10_000), false),
            (lease(30_000, 0, 2000, 10_000), false),
        ];
        for (t, ok) in cases {
            assert_eq!(t.validate(Some(&redis)).is_ok(), ok, "{t:?}");
        }
        let message = lease(10_000, 3333, 2000, 10_000)
            .validate(Some(&redis))
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("--ttl") && message.contains("10s"),
            "{message}"
        );
    }

    #[test]
    fn timing_rules_accept_safe_configs_and_refuse_unsafe_ones() {
        let mysql = Target::parse("mysql://u:p@127.0.0.1:3306/db", "sg").unwrap();
        let file = Target::parse("file:///tmp/x.lock", "sg").unwrap();
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
    fn session_timeout_covers_detection_grace_and_margin() {
        // 2s lock wait + interval + 2 x timeout + grace + 5s margin.
        assert_eq!(timings(1000, 2000, 10_000).session_timeout_secs(), 22);
        assert_eq!(timings(200, 500, 1000).session_timeout_secs(), 10);
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
        assert_eq!(
            parse_signal("--stop-signal", "TERM").unwrap(),
            Signal::SIGTERM
        );
        assert_eq!(
            parse_signal("--stop-signal", "sigterm").unwrap(),
            Signal::SIGTERM
        );
        assert_eq!(
            parse_signal("--stop-signal", "15").unwrap(),
            Signal::SIGTERM
        );
        assert_eq!(
            parse_signal("--stop-signal", "QUIT").unwrap(),
            Signal::SIGQUIT
        );
        assert!(parse_signal("--stop-signal", "NOPE").is_err());
        assert!(parse_signal("--stop-signal", "0").is_err());
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
    fn urls_are_redacted_and_messages_scrubbed() {
        let Target::Mysql(t) = Target::parse("mysql://guard:s%40cret@db:3306/app", "sg").unwrap()
        else {
            panic!("not mysql")
        };
        assert_eq!(t.url.to_string(), "mysql://guard:***@db:3306/app");
        assert_eq!(t.url.scrub("denied for s@cret"), "denied for ***");
        let Target::Redis(t) = Target::parse("rediss://:hunter2@cache:6380/1", "sg").unwrap()
        else {
            panic!("not redis")
        };
        assert_eq!(t.url.to_string(), "rediss://:***@cache:6380/1");
        assert!(Target::parse("redis://h:6379", "bad{prefix}").is_err());
        // A driver that refuses an unknown parameter echoes the URL: a secret in the query is not
        // in what it echoes.
        for raw in [
            "mysql://guard@db/app?password=hunter2",
            "mysql://guard@db/app?PWD=hunter2&pool_min=1",
            "mysql://guard:x@db/app?auth_token=hunter2",
            "mysql://guard@db/app?pasword=hunter2",
            "postgres://guard:pw@/app?host=/run/pg&auth_token=hunter2",
            "redis+sentinel://s1:26379,s2:26379/mymaster?apikey=hunter2",
        ] {
            let error = Target::parse(raw, "sg").unwrap_err().to_string();
            assert!(!error.contains("hunter2"), "{raw}: {error}");
            assert!(error.contains("=***"), "{raw}: {error}");
        }
        // A short credential, and one echoed as written (percent-encoded), are scrubbed too.
        let Ok(Target::Mysql(t)) = Target::parse("mysql://guard:p%40ss@db/app", "sg") else {
            panic!("not mysql")
        };
        assert_eq!(t.url.scrub("as guard:p%40ss, p@ss"), "as guard:***, ***");
        let url =
            url::Url::parse("postgres://guard@db/app?sslmode=disable&password=a%2Fb").unwrap();
        let shown = urls::RedactedUrl::of(&url);
        assert_eq!(
            shown.to_string(),
            "postgres://guard@db/app?sslmode=disable&***=***"
        );
        assert_eq!(shown.scrub("password=a%2Fb or a/b"), "password=*** or ***");
        let url = url::Url::parse("mysql://guard@db/app?pwd=ab&apikey=abXY12zz").unwrap();
        assert_eq!(
            urls::RedactedUrl::of(&url).scrub("abXY12zz"),
            "***",
            "a short secret inside a longer one"
        );
        let url = url::Url::parse("mysql://guard:abcd@db/app?apikey=cdef").unwrap();
        assert_eq!(
            urls::RedactedUrl::of(&url).scrub("got abcdef, cdcdef and é-abcdé"),
            "got ***, cd*** and é-***é",
            "secrets that overlap, and overlapping occurrences of one"
        );
        // A password with an `&` left unencoded: its tail reads as a parameter, short as it is.
        let url = url::Url::parse("postgres://guard@db/app?password=Xy7&kP9=abc").unwrap();
        let scrubbed = urls::RedactedUrl::of(&url).scrub("invalid parameter kP9 (abc)");
        assert!(
            !scrubbed.contains("kP9") && !scrubbed.contains("abc"),
            "{scrubbed}"
        );
        // A password with a character a URL parser ends the credentials at, or an @ in a path or
        // query: refused, never guessed (it could name another server), and never shown.
        for raw in [
            "postgres://app:2024#hunter2!@127.0.0.1:1/prod",
            "mysql://app:a/hunter2@127.0.0.1:1/prod",
            "redis://:what?hunter2@127.0.0.1:1/0",
            "postgres://u:p@ss?hunter2@127.0.0.1:1/db",
            "postgres://app:hunter2@db1/app?application_name=job@db2",
        ] {
            let error = Target::parse(raw, "sg").unwrap_err().to_string();
            assert!(!error.contains("hunter2"), "{raw}: {error}");
            assert!(error.contains("percent-encode"), "{raw}: {error}");
        }
        // Encoded, the same password works; a fragment and a password's tail after `&` are masked.
        let Ok(Target::Postgres(t)) =
            Target::parse("postgres://app:2024%23hunter2!@127.0.0.1:1/prod", "sg")
        else {
            panic!("not postgres")
        };
        assert_eq!(t.config.get_password(), Some(&b"2024#hunter2!"[..]));
        for raw in [
            "mysql://guard@db/app?password=Xy7&hunter2",
            "mysql://guard@db/app?pool_min=1#hunter2",
        ] {
            let shown = match Target::parse(raw, "sg") {
                Ok(target) => target.location(),
                Err(e) => e.to_string(),
            };
            assert!(!shown.contains("hunter2"), "{raw}: {shown}");
        }
        // A file lock's path may hold an @.
        assert!(Target::parse("file:///run/lock/backup@nightly.lock", "sg").is_ok());
    }

    #[test]
    fn postgres_urls_take_libpq_tls_parameters_and_keep_passwords_out_of_queries() {
        let tls = |raw: &str| match Target::parse(raw, "sg") {
            Ok(Target::Postgres(t)) => Ok(t.tls),
            Ok(_) => panic!("not postgres"),
            Err(e) => Err(e.to_string()),
        };
        let mode = |raw: &str| tls(raw).unwrap().mode;
        assert_eq!(mode("postgres://u:p@db/app"), SslMode::Prefer);
        assert_eq!(
            mode("postgresql://u@db/app?sslmode=disable"),
            SslMode::Disable
        );
        assert_eq!(
            mode("postgres://u@db/app?sslmode=require"),
            SslMode::Require
        );
        assert_eq!(
            mode("postgres://u@db/app?sslmode=require&sslrootcert=/ca.pem"),
            SslMode::VerifyCa
        );
        let full = tls("postgres://u@db/app?sslmode=verify-full&sslrootcert=system").unwrap();
        assert_eq!((full.mode, full.ca_file), (SslMode::VerifyFull, None));
        assert!(tls("postgres://u@db/app?sslmode=allow").is_err());
        let Target::Postgres(t) = Target::parse(
            "postgres://guard:s%40c:r@t@/app?host=/run/pg&port=5433",
            "sg",
        )
        .unwrap() else {
            panic!("not postgres")
        };
        assert_eq!(
            t.url.to_string(),
            "postgres://guard:***@/app?host=/run/pg&port=5433"
        );
        assert_eq!(t.config.get_user(), Some("guard"));
        assert_eq!(t.config.get_password(), Some(&b"s@c:r@t"[..]));
        assert!(matches!(
            t.config.get_hosts(),
            [tokio_postgres::config::Host::Unix(dir)] if dir == Path::new("/run/pg")
        ));
        let refused = tls("postgres://u@db/app?password=hunter2").unwrap_err();
        assert!(!refused.contains("hunter2"), "{refused}");
        let Ok(Target::Postgres(t)) = Target::parse(
            "postgres://guard:s%40cret@db:5432/app?sslmode=verify-ca&sslrootcert=/ca.pem&connect_timeout=3",
            "sg",
        ) else {
            panic!("not postgres")
        };
        assert_eq!(t.url.to_string(), "postgres://guard:***@db:5432/app?sslmode=verify-ca&sslrootcert=/ca.pem&connect_timeout=3");
        assert_eq!(t.tls.ca_file, Some(std::path::PathBuf::from("/ca.pem")));
        assert_eq!(t.config.get_password(), Some(&b"s@cret"[..]));
    }

    #[test]
    fn metrics_addresses_take_the_forms_exporters_take() {
        let addr = |raw| listen_addr(raw).map(|a| a.to_string());
        assert_eq!(addr(":9464").unwrap(), "0.0.0.0:9464");
        assert_eq!(addr("127.0.0.1:9464").unwrap(), "127.0.0.1:9464");
        assert_eq!(addr("[::1]:9464").unwrap(), "[::1]:9464");
        assert!(addr("localhost:9464").unwrap().ends_with(":9464"));
        for bad in [
            "9464",
            ":x",
            "localhost",
            ":70000",
            "no-such-host.invalid:9464",
        ] {
            assert!(listen_addr(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn file_urls_must_be_absolute_local_files() {
        assert!(matches!(
            Target::parse("file:///var/lock/x.lock", "sg"),
            Ok(Target::File(_))
        ));
        assert!(Target::parse("file://otherhost/x.lock", "sg").is_err());
        assert!(Target::parse("file:///var/lock/", "sg").is_err());
        assert!(Target::parse("ftp://x/y", "sg").is_err());
        // The parser would read these as /rel.lock, a lock at the root.
        for relative in [
            "file:rel.lock",
            "file:./rel.lock",
            "file:../rel.lock",
            "FILE:rel.lock",
        ] {
            let error = Target::parse(relative, "sg").unwrap_err().to_string();
            assert!(
                error.contains("file:///abs/path.lock"),
                "{relative}: {error}"
            );
        }
        assert!(matches!(
            Target::parse("file:/var/lock/x.lock", "sg"),
            Ok(Target::File(path)) if path == Path::new("/var/lock/x.lock")
        ));
    }

    #[test]
    fn a_url_file_holds_one_url_and_its_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = |contents: &str| {
            let path = dir.path().join("url");
            std::fs::write(&path, contents).unwrap();
            path
        };
        let url = "redis://127.0.0.1:6379/0";
        for padded in [
            url,
            "redis://127.0.0.1:6379/0\n",
            "\n  redis://127.0.0.1:6379/0 \r\n\n",
        ] {
            assert_eq!(read_url_file(&file(padded)).unwrap(), url, "{padded:?}");
        }
        let two = file("mysql://u@h/test\nsecond line\n");
        let error = read_url_file(&two).unwrap_err().to_string();
        assert!(
            error.starts_with(&format!("--url-file {}: line 2", two.display())),
            "{error}"
        );
        let blank = file(" \n\n");
        let error = read_url_file(&blank).unwrap_err().to_string();
        assert!(error.contains("holds no URL"), "{error}");
        let bad = file("nosuch://x\n");
        let error = Target::parse(&read_url_file(&bad).unwrap(), "sg")
            .unwrap_err()
            .said_of_url_file(&bad)
            .to_string();
        assert!(
            error.starts_with(&format!("--url-file {}: ", bad.display())),
            "{error}"
        );
        assert!(!error.contains("--url:"), "{error}");
    }

    #[test]
    fn wait_accepts_a_duration_or_forever() {
        assert_eq!(Wait::parse(None).unwrap(), Wait::No);
        assert_eq!(Wait::parse(Some("forever")).unwrap(), Wait::Forever);
        assert_eq!(Wait::parse(Some("TRUE")).unwrap(), Wait::Forever);
        assert_eq!(Wait::parse(Some("off")).unwrap(), Wait::No);
        assert_eq!(
            Wait::parse(Some("2s")).unwrap(),
            Wait::For(Duration::from_secs(2))
        );
        assert!(Wait::parse(Some("soon")).is_err());
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

/// "Never panics" as a tested property: whatever flags and values an operator (or a typo) gives,
/// the configuration layer answers with a configuration or a usage error. Environment variables go
/// through the same clap value parsers as their flags, so flag values cover them.
#[cfg(test)]
mod never_panics {
    use clap::Parser;
    use proptest::prelude::*;

    use super::*;

    const DURATION_FLAGS: [&str; 11] = [
        "--every",
        "--once-per",
        "--grace-period",
        "--check-interval",
        "--check-timeout",
        "--connect-timeout",
        "--ttl",
        "--renew-interval",
        "--takeover-delay",
        "--max-runtime",
        "--wait",
    ];

    #[test]
    fn schedules_refuse_conflicts_and_windows_they_cannot_number() {
        let run = |flags: &[&str], url: &str| {
            let mut args: Vec<String> = ["sentinel-guard", "--url", url, "--name", "job"]
                .map(String::from)
                .to_vec();
            args.extend(flags.iter().map(|f| f.to_string()));
            args.extend(["--".to_owned(), "true".to_owned()]);
            invocation(&args, None)
        };
        let file = "file:///tmp/job.lock";
        let refused = [
            (
                &["--every", "1m", "--once-per", "1m"][..],
                file,
                "cannot be used together",
            ),
            (
                &["--every", "1m", "--wait"][..],
                file,
                "--every cannot be used with --wait",
            ),
            (
                &["--once-per", "1h", "--wait=5s"][..],
                file,
                "--once-per cannot be used with --wait",
            ),
            (&["--every", "1500ms"][..], file, "whole number of seconds"),
            (
                &["--every", "1h", "--window-offset", "1h"][..],
                file,
                "shorter than the window",
            ),
            (
                &["--window-offset", "1m"][..],
                file,
                "only apply to --every or --once-per",
            ),
            (
                &["--if-unavailable", "run"][..],
                file,
                "only apply to --every or --once-per",
            ),
            (
                &["--every", "1m"][..],
                "mysql://u:p@127.0.0.1:3306",
                "needs a database in the URL",
            ),
        ];
        for (flags, url, message) in refused {
            let error = run(flags, url).expect_err(&format!("{flags:?} was accepted"));
            assert!(error.contains(message), "{flags:?}: {error}");
        }
        let Ok(Invocation::Guard(config)) = run(
            &[
                "--every",
                "24h",
                "--window-offset",
                "2h",
                "--if-unavailable",
                "run",
            ],
            "mysql://u:p@127.0.0.1:3306/app",
        ) else {
            panic!("a daily schedule at 02:00 was refused");
        };
        assert_eq!(
            config.schedule,
            Some(Schedule {
                period: Duration::from_secs(86_400),
                offset: Duration::from_secs(7_200),
                mode: ScheduleMode::Every,
                if_unavailable: IfUnavailable::Run,
            })
        );
    }

    fn invocation(args: &[String], guard_switch: Option<&str>) -> Result<Invocation, String> {
        let cli = Cli::try_parse_from(args).map_err(|e| e.to_string())?;
        Invocation::from_cli(cli, guard_switch).map_err(|e| e.to_string())
    }

    #[test]
    fn options_of_another_backend_are_ignored_and_said_and_yes_or_no_words_are_one_set() {
        let ignored =
            |url: &str, flags: &[(&str, String)]| match invocation(&guard_args(url, flags), None) {
                Ok(Invocation::Guard(config)) => config.ignored_options,
                other => panic!("{url}: {:?}", other.err()),
            };
        let lease = [
            ("--ttl", "40s".to_owned()),
            ("--renew-interval", "1s".to_owned()),
        ];
        let prefix = [("--redis-prefix", "a b".to_owned())];
        assert_eq!(
            ignored("file:///tmp/o.lock", &lease),
            ["--ttl", "--renew-interval"]
        );
        assert_eq!(ignored("mysql://u@h/db", &prefix), ["--redis-prefix"]);
        assert!(ignored("redis://h:6379", &lease).is_empty());
        assert!(ignored("etcd://h:2379", &lease).is_empty());
        assert!(ignored("file:///tmp/o.lock", &[]).is_empty());
        for word in ["TRUE", "t", "1", "Yes", "y", "on"] {
            assert!(parse_guard_switch(Some(word)).unwrap(), "{word}");
        }
        for word in ["FALSE", "f", "0", "No", "n", "off"] {
            assert!(!parse_guard_switch(Some(word)).unwrap(), "{word}");
        }
        for word in ["", "perhaps", "2"] {
            assert!(parse_guard_switch(Some(word)).is_err(), "{word:?}");
        }
    }

    fn guard_args(url: &str, flags: &[(&str, String)]) -> Vec<String> {
        let mut args = vec![
            "sentinel-guard".to_owned(),
            "--url".to_owned(),
            url.to_owned(),
        ];
        args.extend(["--name".to_owned(), "prop".to_owned()]);
        for (flag, value) in flags {
            // `--wait` takes its value only with `=`; the others take both forms.
            args.push(format!("{flag}={value}"));
        }
        args.extend(["--".to_owned(), "true".to_owned()]);
        args
    }

    /// Values an operator might write, including the edges of every numeric type and unit.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            (
                0u64..=u64::MAX,
                prop::sample::select(vec!["ns", "ms", "s", "m", "h", "d", "w", "y", ""])
            )
                .prop_map(|(n, unit)| format!("{n}{unit}")),
            (
                0u64..100_000,
                prop::sample::select(vec!["ms", "s", "m", "h", "d"])
            )
                .prop_map(|(n, unit)| format!("{n}{unit}")),
            Just("18446744073709551615s".to_owned()),
            Just("forever".to_owned()),
            Just("-1s".to_owned()),
            ".{0,12}",
        ]
    }

    fn url() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("mysql://sg:pw@127.0.0.1:3306/test".to_owned()),
            Just("mysql://sg:pw@[::1]/test".to_owned()),
            Just("redis://[::1]:6379".to_owned()),
            Just("rediss://u:p@host/3".to_owned()),
            Just("redis+sentinel://u:p@h1,[::1]:26380/mymaster/2".to_owned()),
            Just("rediss+cluster://h1:7000,h2".to_owned()),
            Just("file:///tmp/prop.lock".to_owned()),
            "[a-z+]{1,8}://[a-z0-9@:\\[\\]./%]{0,24}",
            ".{0,20}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn any_flags_give_a_config_or_a_usage_error(
            url in url(),
            flags in prop::collection::vec((prop::sample::select(DURATION_FLAGS.to_vec()), value()), 0..6),
            switch in prop::option::of(prop_oneof![Just("false".to_owned()), ".{0,6}"]),
        ) {
            let flags: Vec<(&str, String)> = flags.iter().map(|(f, v)| (*f, v.clone())).collect();
            // The property is that this returns at all; either answer is fine.
            let _ = invocation(&guard_args(&url, &flags), switch.as_deref());
        }
    }

    #[test]
    fn min_replicas_need_a_redis_lock() {
        let with = |url: &str, n: &str| {
            invocation(
                &guard_args(url, &[("--redis-min-replicas", n.to_owned())]),
                None,
            )
        };
        let error = with("file:///tmp/x.lock", "1").unwrap_err();
        assert!(error.contains("Redis lock only"), "{error}");
        let Ok(Invocation::Guard(config)) = with("redis+sentinel://h1,h2/mymaster", "1") else {
            panic!("a Sentinel URL with one replica was refused");
        };
        let Some(Target::Redis(redis)) = &config.target else {
            panic!("not redis")
        };
        assert_eq!(redis.min_replicas, 1);
        assert!(with("redis://h1", "17").is_err());
    }

    #[test]
    fn huge_durations_are_usage_errors_that_name_the_option() {
        for flag in DURATION_FLAGS {
            for huge in ["18446744073709551615s", "10y", "400d"] {
                let args = guard_args("redis://127.0.0.1:6379", &[(flag, huge.to_owned())]);
                let error = match invocation(&args, None) {
                    Ok(_) => panic!("{flag}={huge} was accepted"),
                    Err(e) => e,
                };
                assert!(error.contains(flag), "{flag}={huge}: {error}");
            }
        }
        // The bound itself is accepted where no other rule forbids it.
        let ok = guard_args(
            "file:///tmp/prop.lock",
            &[
                ("--max-runtime", "1y".to_owned()),
                ("--wait", "1y".to_owned()),
            ],
        );
        assert!(invocation(&ok, None).is_ok());
    }

    #[test]
    fn bracketed_ipv6_hosts_reach_the_mysql_driver_as_addresses() {
        for (raw, host, port) in [
            ("mysql://sg:pw@[::1]:3307/test", "::1", 3307),
            ("mysql://sg:pw@[::1]/test", "::1", 3306),
            ("mysql://sg:pw@127.0.0.1/test", "127.0.0.1", 3306),
            ("mysql://sg:pw@db.example/test", "db.example", 3306),
        ] {
            let Ok(Target::Mysql(target)) = Target::parse(raw, "sg") else {
                panic!("{raw} did not parse")
            };
            assert_eq!(target.opts.ip_or_hostname(), host, "{raw}");
            assert_eq!(target.opts.tcp_port(), port, "{raw}");
        }
    }
}

/// The server's session timeout against a model of the server's idle clock, over the whole timing
/// range the guard accepts: whatever the network does to the answers the guard still accepts, the
/// server cannot free a silent session's lock before the app's deadline that followed them.
#[cfg(test)]
mod server_idle_clock {
    use proptest::prelude::*;

    use super::*;

    fn ms(d: Duration) -> u64 {
        d.as_millis() as u64
    }

    /// Every moment in milliseconds from the guard's question; returns (server frees the lock, the
    /// app's deadline), or `None` when the guard refuses the answer (too late) or the timings.
    /// `server_wait` is how long the server took before it answered (its sleep, or its wait for the
    /// lock), `there` and `back` the network's delays each way, `budget` the answer's.
    fn model(
        timings: &Timings,
        server_wait: u64,
        there: u64,
        back: u64,
        budget: u64,
    ) -> Option<(u64, u64)> {
        let mysql = Target::parse("mysql://u:p@127.0.0.1/test", "sg").ok()?;
        timings.validate(Some(&mysql)).ok()?;
        let answered = there + server_wait;
        let arrived = answered + back;
        if arrived > budget {
            return None;
        }
        // The next question goes out as the answer arrives, and moves the deadline.
        let deadline = arrived + ms(timings.detection_bound()) + ms(timings.grace_period);
        let frees = answered + timings.session_timeout_secs() * 1000;
        Some((frees, deadline))
    }

    fn timing() -> impl Strategy<Value = Timings> {
        (100u64..3_600_000, 100u64..600_000, 0u64..3_600_000).prop_map(|(i, t, g)| Timings {
            check_interval: Duration::from_millis(i),
            check_timeout: Duration::from_millis(t),
            connect_timeout: Duration::from_secs(5),
            grace_period: Duration::from_millis(g),
            ttl: Duration::from_secs(30),
            renew_interval: Duration::from_secs(10),
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5000))]

        #[test]
        fn a_late_check_answer_then_silence_never_frees_the_lock_first(
            timings in timing(),
            there in 0.0f64..1.0,
            back in 0.0f64..1.0,
        ) {
            let budget = ms(timings.detection_bound());
            let slack = budget - ms(timings.check_interval);
            // The server answers once its sleep is over; the network shares out what is left.
            let there = (there * slack as f64) as u64;
            let back = (back * (slack - there) as f64) as u64;
            let sleep = ms(timings.check_interval);
            if let Some((frees, deadline)) = model(&timings, sleep, there, back, budget) {
                prop_assert!(frees > deadline, "frees at {frees} ms, app dead by {deadline} ms");
            }
        }

        #[test]
        fn a_late_grant_then_silence_never_frees_the_lock_first(
            timings in timing(),
            chunk in 0u64..=2_000,
            wait in 0.0f64..1.0,
            there in 0.0f64..1.0,
            back in 0.0f64..1.0,
        ) {
            let chunk = chunk.min(ms(MAX_LOCK_WAIT_CHUNK));
            let budget = chunk + ms(timings.check_timeout);
            let wait = (wait * chunk as f64) as u64;
            let there = (there * (budget - wait) as f64) as u64;
            let back = (back * (budget - wait - there) as f64) as u64;
            if let Some((frees, deadline)) = model(&timings, wait, there, back, budget) {
                prop_assert!(frees > deadline, "frees at {frees} ms, app dead by {deadline} ms");
            }
        }
    }

    /// The case an outsider measured: check-interval 1s, check-timeout 10s, grace 1s, an answer 9s
    /// late, then silence. The old `wait_timeout` (17s) freed the lock 2s before the deadline.
    #[test]
    fn the_measured_case_is_covered() {
        let timings = Timings {
            check_interval: Duration::from_secs(1),
            check_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            grace_period: Duration::from_secs(1),
            ttl: Duration::from_secs(30),
            renew_interval: Duration::from_secs(10),
        };
        let (frees, deadline) = model(&timings, 1_000, 0, 9_000, 11_000).unwrap();
        assert!(frees > deadline, "{frees} <= {deadline}");
        assert!(
            17_000 + 1_000 < deadline,
            "the old timeout would have freed it first"
        );
    }
}
