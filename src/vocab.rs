//! The words logs, metrics and exit codes share: why a lock stopped being ours, and how the app
//! ended. A leaf module: it imports nothing of the crate, so every other module may use it.

use std::fmt;

use nix::libc;
use nix::sys::signal::Signal;

/// The guard's own exit codes (sysexits where one fits); `outcome::Outcome::exit_code` is the one
/// table that maps a run's end to them.
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_UNAVAILABLE: u8 = 69;
pub const EXIT_INTERNAL: u8 = 70;
pub const EXIT_LOCK_LOST: u8 = 75;
pub const EXIT_UNHEALTHY: u8 = 76;
pub const EXIT_MAX_RUNTIME: u8 = 124;
pub const EXIT_NOT_EXECUTABLE: u8 = 126;
pub const EXIT_NOT_FOUND: u8 = 127;

/// A duration as every message and log line shows it: humantime's units from days down, rounded to
/// the millisecond (to the nanosecond below one), so `--ttl 1s` renews every `333ms`, not
/// `333ms 333us 333ns`, and a year's bound reads `365d 6h`, not in humantime's months of 30.44 days.
/// `humantime::parse_duration` reads it back.
pub fn show_duration(duration: std::time::Duration) -> String {
    const MS: u128 = 1_000_000;
    let nanos = duration.as_nanos();
    if nanos < MS {
        return match nanos {
            0 => "0s".to_owned(),
            n if n % 1_000 == 0 => format!("{}us", n / 1_000),
            n => format!("{n}ns"),
        };
    }
    let mut ms = (nanos + MS / 2) / MS;
    let mut parts = Vec::new();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ] {
        if ms >= size {
            parts.push(format!("{}{unit}", ms / size));
            ms %= size;
        }
    }
    parts.join(" ")
}

/// The first second RFC 3339 cannot write (the year 10000), past which a time read from outside the
/// guard is shown as its number instead.
pub const RFC3339_END_SECS: u64 = 253_402_300_800;

/// The variables the guard sets in the app's environment (what each means: `cli::APP_ENV`).
pub const ENV_NAME: &str = "SENTINEL_GUARD_NAME";
pub const ENV_BACKEND: &str = "SENTINEL_GUARD_BACKEND";
pub const ENV_HOLDER_ID: &str = "SENTINEL_GUARD_HOLDER_ID";
pub const ENV_FENCING_TOKEN: &str = "SENTINEL_GUARD_FENCING_TOKEN";
pub const ENV_WINDOW: &str = "SENTINEL_GUARD_WINDOW";
pub const ENV_WINDOW_START: &str = "SENTINEL_GUARD_WINDOW_START";
pub const ENV_SOCKET: &str = "SENTINEL_GUARD_SOCKET";

/// What each exit code means, in the words `--help` and the man page print (README.md's table says
/// the same at length; a test holds the three together). The codes besides the app's own are the
/// constants above, `--held-exit-code`'s default, and the scheduler's 0.
pub const EXIT_STATUS: &[(&str, &str)] = &[
    (
        "the app's code",
        "the app ran and ended (128+N if it died of signal N), after --exit-code-map",
    ),
    (
        "0",
        "scheduled jobs: --once-per found the window already claimed or busy, or a signal stopped \
         --every between runs; the command was not run",
    ),
    (
        "1",
        "(--held-exit-code) another instance holds the lock, the wait for it ended, or a signal came \
         before the app started; the app was never started",
    ),
    ("2", "usage or configuration error; nothing was contacted"),
    (
        "69",
        "the backend is unreachable, refused the guard or is unsafe (or its fencing counter was set \
         back); the app was never started",
    ),
    ("70", "the guard could not set itself up"),
    (
        "75",
        "the lock was lost; the app was stopped (or never started)",
    ),
    (
        "76",
        "--health-cmd failed --health-retries times in a row; the app was stopped and the lock \
         released",
    ),
    ("124", "--max-runtime expired; the app was stopped"),
    ("126", "the command cannot be executed"),
    (
        "127",
        "the command (or its #! interpreter) is not found",
    ),
];

/// `--health-cmd`: what its checks have shown of the app, in logs (`state=...`) and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    /// No check has passed yet, and failures in the start period are not counted.
    Starting,
    Healthy,
    /// Some failures in a row, fewer than `--health-retries`.
    Failing,
    /// `--health-retries` failures in a row: the guard steps down.
    Unhealthy,
}

impl HealthState {
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Starting => "starting",
            HealthState::Healthy => "healthy",
            HealthState::Failing => "failing",
            HealthState::Unhealthy => "unhealthy",
        }
    }
}

/// `checks_total{outcome}`: how one ownership check (MySQL query, Redis renewal, lock file stat) ended.
#[derive(Debug, Clone, Copy)]
pub enum CheckOutcome {
    Ok,
    Error,
    Timeout,
}

impl CheckOutcome {
    pub const ALL: [CheckOutcome; 3] =
        [CheckOutcome::Ok, CheckOutcome::Error, CheckOutcome::Timeout];

    pub fn as_str(self) -> &'static str {
        match self {
            CheckOutcome::Ok => "ok",
            CheckOutcome::Error => "error",
            CheckOutcome::Timeout => "timeout",
        }
    }
}

/// Why a held lock stopped being ours, or why the guard could no longer vouch for it. The names
/// appear in logs as `reason=...` and as the `reason` label of `lock_lost_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReason {
    /// The server closed the connection that held the lock (`KILL`, restart, crash).
    ConnectionClosed,
    /// The backend answered that someone else, or no one, holds the lock.
    NotOwner,
    /// The server holding the lock is no longer a writable primary (MySQL `read_only`, PostgreSQL in
    /// recovery, Redis a replica): a switchover demoted it in place, and the new primary can grant
    /// the lock to anyone.
    PrimaryDemoted,
    /// The backend did not answer a check within check-interval + check-timeout, or answered later.
    CheckTimeout,
    /// The backend answered a check with an error.
    CheckFailed,
    /// No Redis renewal was confirmed in time: the lease could run out before a stopping app is dead.
    LeaseExpiring,
    /// The lock file's path no longer exists.
    LockFileDeleted,
    /// The lock file's path now names a different file than the one locked.
    LockFileReplaced,
    /// The lock's deadline passed before ownership was proven again (the guard or its whole
    /// container was frozen, the host suspended): the app is SIGKILLed at once, with no grace.
    DeadlinePassed,
    /// The guard was unresponsive while its lock ran out, and its watchdog stopped the app.
    GuardFrozen,
    /// The watchdog, the app's dead man's switch, is gone: the app must not run without it.
    WatchdogDied,
}

impl LossReason {
    pub const ALL: [LossReason; 11] = [
        LossReason::ConnectionClosed,
        LossReason::NotOwner,
        LossReason::PrimaryDemoted,
        LossReason::CheckTimeout,
        LossReason::CheckFailed,
        LossReason::LeaseExpiring,
        LossReason::LockFileDeleted,
        LossReason::LockFileReplaced,
        LossReason::DeadlinePassed,
        LossReason::GuardFrozen,
        LossReason::WatchdogDied,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::ConnectionClosed => "connection_closed",
            LossReason::NotOwner => "not_owner",
            LossReason::PrimaryDemoted => "primary_demoted",
            LossReason::CheckTimeout => "check_timeout",
            LossReason::CheckFailed => "check_failed",
            LossReason::LeaseExpiring => "lease_expiring",
            LossReason::LockFileDeleted => "lock_file_deleted",
            LossReason::LockFileReplaced => "lock_file_replaced",
            LossReason::DeadlinePassed => "deadline_passed",
            LossReason::GuardFrozen => "guard_frozen",
            LossReason::WatchdogDied => "watchdog_died",
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppStatus {
    Exited(u8),
    Signaled(i32),
}

impl AppStatus {
    /// The shell's convention: the exit code, or 128+N for death by signal N.
    pub fn code(self) -> u8 {
        match self {
            AppStatus::Exited(code) => code,
            AppStatus::Signaled(signal) => 128u8.wrapping_add(signal as u8),
        }
    }

    /// From a raw `wait` status; `None` for a stop or continue report.
    pub fn from_wait(raw: i32) -> Option<AppStatus> {
        if libc::WIFEXITED(raw) {
            Some(AppStatus::Exited(libc::WEXITSTATUS(raw) as u8))
        } else if libc::WIFSIGNALED(raw) {
            Some(AppStatus::Signaled(libc::WTERMSIG(raw)))
        } else {
            None
        }
    }
}

impl fmt::Display for AppStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AppStatus::Exited(code) => write!(f, "exited with code {code}"),
            AppStatus::Signaled(signal) => write!(f, "killed by {}", signal_name(*signal)),
        }
    }
}

/// `SIGTERM`, or `SIGRTMIN+N` for the real-time signals nix cannot name.
pub fn signal_name(signal: i32) -> String {
    match Signal::try_from(signal) {
        Ok(named) => named.as_str().to_owned(),
        Err(_) => format!("SIGRTMIN+{}", signal - libc::SIGRTMIN()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_show_rounded_in_units_humantime_reads_back() {
        use std::time::Duration;
        for (duration, shown) in [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(1) / 3, "333ms"),
            (Duration::from_millis(11_600), "11s 600ms"),
            (Duration::from_secs(365 * 86_400), "365d"),
            (Duration::from_secs(31_557_600), "365d 6h"),
            (Duration::from_micros(250), "250us"),
            (Duration::from_nanos(1_500_000), "2ms"),
        ] {
            assert_eq!(show_duration(duration), shown);
            let back = humantime::parse_duration(shown).unwrap();
            assert!(
                back.abs_diff(duration) < Duration::from_millis(1),
                "{shown}"
            );
        }
    }

    #[test]
    fn every_exit_code_of_the_guard_is_in_the_exit_status_table() {
        let codes: Vec<&str> = EXIT_STATUS.iter().map(|(code, _)| *code).collect();
        for code in [
            EXIT_USAGE,
            EXIT_UNAVAILABLE,
            EXIT_INTERNAL,
            EXIT_LOCK_LOST,
            EXIT_MAX_RUNTIME,
            EXIT_NOT_EXECUTABLE,
            EXIT_NOT_FOUND,
            0,
            1,
        ] {
            assert!(codes.contains(&code.to_string().as_str()), "exit {code}");
        }
    }
}
