//! Raw command-line flags and environment variables, exactly as the operator wrote them.
//!
//! Nothing here decides anything: `config::Config::from_cli` turns these into a validated
//! configuration, so every rule lives in one place.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use crate::vocab::{
    ENV_BACKEND, ENV_FENCING_TOKEN, ENV_HOLDER_ID, ENV_NAME, ENV_SOCKET, ENV_WINDOW,
    ENV_WINDOW_START,
};
use crate::window::IfUnavailable;

/// `SINGLE_INSTANCE_GUARD`: `false` runs the app with no lock at all.
pub const GUARD_SWITCH_VAR: &str = "SINGLE_INSTANCE_GUARD";
/// The log filter (tracing's `EnvFilter` syntax).
pub const LOG_FILTER_VAR: &str = "SENTINEL_GUARD_LOG";

/// Variables the guard reads that no option stands for; the man page lists them with the options'
/// own variables, so every variable is documented from this one definition.
pub const ENV_ONLY: &[(&str, &str)] = &[
    (
        GUARD_SWITCH_VAR,
        "false/0/no/off (any case): run the command with no lock at all and a loud warning (local \
         development only); true/1/yes/on or unset: guarded; anything else: exit 2",
    ),
    (
        LOG_FILTER_VAR,
        "log level and filter in tracing's syntax, e.g. debug (default: info)",
    ),
];

/// Variables the guard sets in the command's environment.
pub const APP_ENV: &[(&str, &str)] = &[
    (ENV_NAME, "the lock name"),
    (
        ENV_BACKEND,
        "mysql, postgres, redis, etcd, file, or none when unguarded",
    ),
    (
        ENV_HOLDER_ID,
        "a random id of this guard, also in its log lines",
    ),
    (
        ENV_FENCING_TOKEN,
        "a number that strictly increases with every acquisition of the lock name, on every backend",
    ),
    (
        ENV_SOCKET,
        "a Unix socket that answers whether the lock is still held and for how long \
         (`sentinel-guard held`)",
    ),
    (
        ENV_WINDOW,
        "--every/--once-per only: the number k of the window being run",
    ),
    (
        ENV_WINDOW_START,
        "--every/--once-per only: the window's start, RFC 3339 in UTC",
    ),
];

/// Typical invocations, for the man page's EXAMPLES.
pub const EXAMPLES: &[(&str, &str)] = &[
    (
        "sentinel-guard --url-file /run/secrets/lock-url --name billing -- ./worker",
        "one worker across every replica; the others exit 1",
    ),
    (
        "sentinel-guard --url postgres://guard@db/app --name billing --wait forever -- ./worker",
        "a hot standby: wait for the lock, take over when the holder goes",
    ),
    (
        "sentinel-guard --url redis://cache:6379 --name report --every 1h -- ./report",
        "a resident scheduler: one run per hour across every replica",
    ),
    (
        "sentinel-guard --url file:///run/lock/backup.lock --name backup --once-per 24h -- ./backup",
        "from a cron line: at most one run per day",
    ),
    (
        "sentinel-guard held --min-validity 5s && ./write-next-batch",
        "from inside the app: write only while the lock is promised for 5s more",
    ),
    (
        "sentinel-guard status --url mysql://guard@db/app --name billing",
        "who holds the lock (exit 0 held, 3 free)",
    ),
];

/// `--url` and `--url-file` are one setting: given both ways, the command line wins over the
/// environment (a `SENTINEL_GUARD_URL_FILE` in the image, a `--url` typed to try something); given
/// both on the command line, or both in the environment, `config` refuses them.
pub fn command_line_wins(cli: &mut Cli, matches: &clap::ArgMatches) {
    use clap::parser::ValueSource;
    let (lock, matches) = match (&mut cli.subcommand, matches.subcommand()) {
        (Some(Subcommand::Status(args)), Some(("status", sub))) => (&mut args.lock, sub),
        _ => (&mut cli.lock, matches),
    };
    let source = |id| matches.value_source(id);
    match (source("url"), source("url_file")) {
        (Some(ValueSource::CommandLine), Some(ValueSource::EnvVariable)) => lock.url_file = None,
        (Some(ValueSource::EnvVariable), Some(ValueSource::CommandLine)) => lock.url = None,
        _ => {}
    }
}

/// The command line's definition with what derive cannot say: the exit codes, from their one table.
pub fn command() -> clap::Command {
    use clap::CommandFactory;
    let mut after = String::from("Exit codes:");
    for (code, meaning) in crate::vocab::EXIT_STATUS {
        after.push_str(&format!("\n  {code}: {meaning}"));
    }
    after.push_str(&format!(
        "\n{GUARD_SWITCH_VAR}=false runs the command without any lock (local development only)."
    ));
    Cli::command().after_help(after)
}

#[derive(Parser)]
#[command(
    name = "sentinel-guard",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    subcommand_value_name = "SUBCOMMAND",
    subcommand_help_heading = "Subcommands",
    about = "Run a command as a singleton: take a lock, start the command, stop it the moment the lock is lost"
)]
pub struct Cli {
    #[command(subcommand)]
    pub subcommand: Option<Subcommand>,

    #[command(flatten)]
    pub lock: LockArgs,

    /// Exit code when another instance holds the lock (the command is never started)
    #[arg(
        long,
        env = "SENTINEL_GUARD_HELD_EXIT_CODE",
        default_value_t = 1,
        value_name = "N"
    )]
    pub held_exit_code: u8,

    /// Time between the stop signal and SIGKILL whenever the guard stops the command (at most 1h)
    #[arg(long, env = "SENTINEL_GUARD_GRACE_PERIOD", default_value = "10s", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub grace_period: Duration,

    /// Signal that asks the command to stop: TERM, SIGTERM or 15
    #[arg(
        long,
        env = "SENTINEL_GUARD_STOP_SIGNAL",
        default_value = "SIGTERM",
        value_name = "SIG"
    )]
    pub stop_signal: String,

    /// When the guard's own parent process dies, act as if it had sent this signal (forwarded to the
    /// command, or a stop for TERM/INT), like tini -p; default: off
    #[arg(long, env = "SENTINEL_GUARD_PARENT_DEATH_SIGNAL", value_name = "SIG")]
    pub parent_death_signal: Option<String>,

    /// How often ownership of the lock is re-proved (100ms to 1h)
    #[arg(long, env = "SENTINEL_GUARD_CHECK_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub check_interval: Duration,

    /// Redis or etcd lease duration; a lease not renewed for this long expires (at most 1d; it must
    /// exceed --grace-period plus a renewal and its margin) [default: 30s]
    #[arg(long, env = "SENTINEL_GUARD_TTL", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub ttl: Option<Duration>,

    /// How often the Redis or etcd lease is renewed, at most 1d [default: ttl/3]
    #[arg(long, env = "SENTINEL_GUARD_RENEW_INTERVAL", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub renew_interval: Option<Duration>,

    /// Redis only: replicas that must acknowledge (WAIT) the acquisition, every renewal, every
    /// window claim and every run's recorded end within check-timeout, or the renewal counts as
    /// failed (the claim as not recorded: --if-unavailable; the end is said as not recorded); with 0
    /// a failover may lose the lease (0 to 16)
    #[arg(long, env = "SENTINEL_GUARD_REDIS_MIN_REPLICAS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16), value_name = "N")]
    pub redis_min_replicas: u32,

    /// Wait for the lock instead of exiting: forever, or up to DUR (at most 1y) and then exit with the held code
    #[arg(short = 'w', long, env = "SENTINEL_GUARD_WAIT", num_args = 0..=1, require_equals = true, default_missing_value = "forever", value_name = "DUR")]
    pub wait: Option<String>,

    /// With --wait: after a lock loss, stop the command and wait for the lock again as a standby
    /// instead of exiting 75
    #[arg(long, env = "SENTINEL_GUARD_REJOIN", value_parser = clap::builder::BoolishValueParser::new())]
    pub rejoin: bool,

    /// Start the command even where the guard can make no cgroup for it and is not PID 1; there a
    /// process of the command that leaves its process group (setsid, a double fork) outlives a guard
    /// killed by SIGKILL and may run beside the next holder's command. Refused (exit 2) otherwise
    #[arg(long, env = "SENTINEL_GUARD_ALLOW_NO_CGROUP", value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_no_cgroup: bool,

    /// After acquiring, hold the lock before starting the command when the previous holder's app may
    /// still be stopping (the lock was taken away: a KILL, a failover, a deleted key or file): `auto`
    /// waits the bound the previous holder recorded, and not at all after a clean hand-over; a
    /// duration waits that long instead (at most 1h; `0s` permits overlap)
    #[arg(
        long,
        env = "SENTINEL_GUARD_TAKEOVER_DELAY",
        default_value = "auto",
        value_name = "auto|DUR"
    )]
    pub takeover_delay: String,

    /// Where forwarded signals go: the command's whole process group, or the command alone
    #[arg(long, env = "SENTINEL_GUARD_FORWARD_TO", value_enum, default_value_t = ForwardTo::Group)]
    pub forward_to: ForwardTo,

    /// Rewrite the command's exit status, e.g. 143=0 so a clean `docker stop` reads as success (repeatable)
    #[arg(
        long,
        env = "SENTINEL_GUARD_EXIT_CODE_MAP",
        value_delimiter = ',',
        value_name = "FROM=TO"
    )]
    pub exit_code_map: Vec<String>,

    /// Stop the command gracefully after this long and exit 124 (watchdog for cron-style jobs; at most 1y)
    #[arg(long, env = "SENTINEL_GUARD_MAX_RUNTIME", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub max_runtime: Option<Duration>,

    /// Scheduled job, resident: at each window of DUR (on the backend's clock) one replica claims the
    /// window and runs the command; the guard stays up between runs (whole seconds, 1s to 1y)
    #[arg(long, env = "SENTINEL_GUARD_EVERY", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub every: Option<Duration>,

    /// Scheduled job, one shot (a cron line on every host): run the command if the current window of
    /// DUR is unclaimed, else exit 0 without running it (whole seconds, 1s to 1y)
    #[arg(long, env = "SENTINEL_GUARD_ONCE_PER", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub once_per: Option<Duration>,

    /// Shift the windows of --every/--once-per: --every 24h --window-offset 2h runs daily at 02:00 UTC
    /// (whole seconds, below the window) [default: 0s]
    #[arg(long, env = "SENTINEL_GUARD_WINDOW_OFFSET", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub window_offset: Option<Duration>,

    /// For --every/--once-per, when the backend cannot be reached or cannot record the claim: skip the
    /// window (a one-shot exits 69), or run the command WITHOUT a lock after a warning [default: skip]
    #[arg(
        long,
        env = "SENTINEL_GUARD_IF_UNAVAILABLE",
        value_enum,
        value_name = "POLICY"
    )]
    pub if_unavailable: Option<IfUnavailable>,

    /// Health check of the app, run by /bin/sh -c every --health-interval; after --health-retries
    /// failures in a row the guard stops the app, releases the lock and exits 76 (default: none)
    #[arg(long, env = "SENTINEL_GUARD_HEALTH_CMD", value_name = "CMD")]
    pub health_cmd: Option<String>,

    /// Time from the app's start, and from the end of one health check, to the next check (100ms to
    /// 1d) [default: 10s]
    #[arg(long, env = "SENTINEL_GUARD_HEALTH_INTERVAL", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub health_interval: Option<Duration>,

    /// A health check still running after this long is killed and counts as failed (100ms to 1h)
    /// [default: 5s]
    #[arg(long, env = "SENTINEL_GUARD_HEALTH_TIMEOUT", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub health_timeout: Option<Duration>,

    /// Failed health checks in a row that make the app unhealthy (1 to 1000) [default: 3]
    #[arg(long, env = "SENTINEL_GUARD_HEALTH_RETRIES", value_parser = clap::value_parser!(u32).range(1..=1000), value_name = "N")]
    pub health_retries: Option<u32>,

    /// Failures in this long after the app starts are not counted, unless a check has passed (at
    /// most 1d) [default: 0s]
    #[arg(long, env = "SENTINEL_GUARD_HEALTH_START_PERIOD", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub health_start_period: Option<Duration>,

    /// Serve /metrics, /healthz and /leader over HTTP on this address: HOST:PORT (a name is resolved once, at start), or :PORT for every interface, e.g. :9464 (default: off)
    #[arg(long, env = "SENTINEL_GUARD_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<String>,

    /// Log format on stderr; the level is set with SENTINEL_GUARD_LOG (tracing filter syntax)
    #[arg(long, env = "SENTINEL_GUARD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// The command to supervise, run without a shell
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Where the lock lives and how long to wait for it to answer: shared by the guard and `status`.
// No `Debug` here nor on what holds it: `url` is the raw --url, password and all.
#[derive(Args)]
pub struct LockArgs {
    /// Lock backend URL: mysql://user:pass@host:port/db, postgres[ql]://user:pass@host:port/db[?sslmode=...], redis[s]://[user:pass@]host:port[/db], redis[s]+sentinel://[user:pass@]host1:26379,host2:26379/master[/db], redis[s]+cluster://[user:pass@]host1:port,host2:port, etcd[s]://[user:pass@]host1:2379[,host2:2379,...][/prefix] or file:///abs/path.lock
    #[arg(short = 'u', long, env = "SENTINEL_GUARD_URL", hide_env_values = true)]
    pub url: Option<String>,

    /// Read the backend URL from this file (Docker/Kubernetes secrets): the URL alone on one line; blank lines and the whitespace around it are trimmed; a regular file of at most 4 MiB
    #[arg(long, env = "SENTINEL_GUARD_URL_FILE", value_name = "PATH")]
    pub url_file: Option<PathBuf>,

    /// Lock name: 1-64 characters of [A-Za-z0-9._:/-] (required)
    #[arg(short = 'n', long, env = "SENTINEL_GUARD_NAME")]
    pub name: Option<String>,

    /// A check slower than this means the lock is lost; bounds every Redis command (100ms to 10m)
    #[arg(long, env = "SENTINEL_GUARD_CHECK_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub check_timeout: Duration,

    /// How long to wait for the backend connection at start-up (at most 10m)
    #[arg(long, env = "SENTINEL_GUARD_CONNECT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub connect_timeout: Duration,

    /// PEM file of the certificate authorities a TLS backend's certificate must chain to, instead of
    /// the built-in roots (mysql:// with require_ssl=true, rediss://); a regular file of at most 4 MiB
    #[arg(long, env = "SENTINEL_GUARD_CA_FILE", value_name = "PATH")]
    pub ca_file: Option<PathBuf>,

    /// Redis only: prefix of the keys, <prefix>:{<name>}, <prefix>:{<name>}:fence, ...:clean, ...:released [default: sentinel-guard]
    #[arg(long, env = "SENTINEL_GUARD_REDIS_PREFIX", value_name = "P")]
    pub redis_prefix: Option<String>,
}

#[derive(clap::Subcommand)]
pub enum Subcommand {
    /// Show who holds the lock. Exit 0 = held, 3 = free, 69 = backend unreachable, 2 = usage
    Status(StatusArgs),
    /// From inside the app: is the lock still held? Exit 0 = held (for at least --min-validity),
    /// 75 = not held or not for long enough, 2 = not run under a guard
    Held(HeldArgs),
    /// Print the timeline the guarantees rest on for the guard's flags given after it (and the
    /// environment): how soon each fault is noticed, when the app is dead, when the backend can
    /// grant the lock elsewhere, when a standby's app may start. Exit 0, or 2 with the guard's own
    /// reason for a configuration it refuses
    Explain(ExplainArgs),
    /// Print the man page (roff) to stdout
    Man,
    /// Print a shell completion script to stdout
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    /// Output as one line of key=value pairs, or as one JSON object
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,
}

#[derive(Debug, Args)]
pub struct HeldArgs {
    /// Answer "held" only if the guard can still promise the lock for at least this long (at most 1d)
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration, value_name = "DUR")]
    pub min_validity: Duration,

    /// Output as one line of key=value pairs, or as the guard's JSON line
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,
}

#[derive(Args)]
pub struct ExplainArgs {
    /// Output as text or as one JSON object; before the guard's flags
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,

    /// The guard's flags, as given to run it (the command after `--` may be left out)
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "GUARD FLAGS"
    )]
    pub guard_args: Vec<OsString>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ForwardTo {
    Group,
    Child,
}
