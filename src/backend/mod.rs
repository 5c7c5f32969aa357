//! The lock backends behind one small interface: acquire once, then watch for loss, then release.
//!
//! Each backend proves ownership its own way (a MySQL connection that holds `GET_LOCK`, a `flock`ed
//! file), but callers only see `Acquisition`, `HeldLock::lost` and `HeldLock::release`.

mod file;
mod mysql;
mod redis;
mod watched;

pub use mysql::OrphanSession;

use std::fmt;
use std::time::Duration;

use thiserror::Error;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::config::{LockName, Target, Timings};
use crate::holder::Holder;
use crate::metrics::{AcquireOutcome, Metrics};

/// Why the lock could not be taken or used. Every variant means "the app must not run": exit 69.
#[derive(Debug, Error)]
pub enum LockError {
    #[error("lock backend unreachable: {0}")]
    Unreachable(String),
    #[error("lock backend refused the guard: {0}")]
    Refused(String),
    #[error("lock backend is unsafe for a singleton lock: {0}")]
    Unsafe(String),
}

/// Why a held lock stopped being ours. The names appear in logs as `reason=...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReason {
    /// The server closed the connection that held the lock (`KILL`, restart, crash).
    ConnectionClosed,
    /// The backend answered that someone else, or no one, holds the lock.
    NotOwner,
    /// The backend did not answer a check within check-interval + check-timeout.
    CheckTimeout,
    /// The backend answered a check with an error.
    CheckFailed,
    /// No Redis renewal was confirmed in time: the lease could run out before a stopping app is dead.
    LeaseExpiring,
    /// The lock file's path no longer exists.
    LockFileDeleted,
    /// The lock file's path now names a different file than the one locked.
    LockFileReplaced,
}

impl LossReason {
    pub const ALL: [LossReason; 7] = [
        LossReason::ConnectionClosed,
        LossReason::NotOwner,
        LossReason::CheckTimeout,
        LossReason::CheckFailed,
        LossReason::LeaseExpiring,
        LossReason::LockFileDeleted,
        LossReason::LockFileReplaced,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::ConnectionClosed => "connection_closed",
            LossReason::NotOwner => "not_owner",
            LossReason::CheckTimeout => "check_timeout",
            LossReason::CheckFailed => "check_failed",
            LossReason::LeaseExpiring => "lease_expiring",
            LossReason::LockFileDeleted => "lock_file_deleted",
            LossReason::LockFileReplaced => "lock_file_replaced",
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A lost lock, with what the backend said about it.
#[derive(Debug, Clone)]
pub struct LockLoss {
    pub reason: LossReason,
    pub detail: String,
}

pub enum Acquisition {
    Acquired(HeldLock),
    /// Another instance holds the lock (and went on holding it for as long as we were willing to wait).
    HeldElsewhere(HolderInfo),
}

/// Who holds a lock, as far as the backend can tell: `key=value` facts in a fixed order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HolderInfo(Vec<(&'static str, String)>);

impl HolderInfo {
    pub fn with(mut self, key: &'static str, value: impl ToString) -> HolderInfo {
        self.0.push((key, value.to_string()));
        self
    }

    /// Adds the guard identity a holder publishes next to its lock, when it could be read.
    pub fn with_guard(self, guard: Option<Holder>) -> HolderInfo {
        match guard {
            Some(h) => self
                .with("holder_id", h.id)
                .with("host", h.host)
                .with("pid", h.pid)
                .with("started", h.started),
            None => self,
        }
    }

    pub fn fields(&self) -> &[(&'static str, String)] {
        &self.0
    }
}

impl fmt::Display for HolderInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (key, value)) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            if value.contains(' ') {
                write!(f, "{sep}{key}={value:?}")?;
            } else {
                write!(f, "{sep}{key}={value}")?;
            }
        }
        Ok(())
    }
}

/// How long to wait for a held lock: `--wait[=DUR]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Patience {
    /// Give up at once (the default): the instance that loses exits with the held code.
    None,
    Until(Instant),
    Forever,
}

impl Patience {
    /// How long a single wait may last from now: zero once patience has run out.
    pub fn remaining(self) -> Option<Duration> {
        match self {
            Patience::None => Some(Duration::ZERO),
            Patience::Until(deadline) => Some(deadline.saturating_duration_since(Instant::now())),
            Patience::Forever => None,
        }
    }

    pub fn exhausted(self) -> bool {
        self.remaining() == Some(Duration::ZERO)
    }

    /// `limit`, shortened to what patience has left.
    pub fn cap(self, limit: Duration) -> Duration {
        self.remaining().map_or(limit, |left| left.min(limit))
    }
}

/// A lock found held by another instance: counted once per acquisition as `acquire{outcome="held"}`
/// (at first sight, so a waiting standby shows up while it waits), and logged with its holder when
/// the wait starts, then at most once a minute.
pub struct Contention<'a> {
    metrics: &'a Metrics,
    last_log: Option<Instant>,
    counted: bool,
}

const WAIT_LOG_EVERY: Duration = Duration::from_secs(60);

impl Contention<'_> {
    pub fn new(metrics: &Metrics) -> Contention<'_> {
        Contention {
            metrics,
            last_log: None,
            counted: false,
        }
    }

    /// Whether the "still waiting" line is due; true until the lock was first found held.
    pub fn log_due(&self) -> bool {
        self.last_log
            .is_none_or(|at| at.elapsed() >= WAIT_LOG_EVERY)
    }

    pub fn waiting(&mut self, holder: &HolderInfo) {
        self.count();
        self.last_log = Some(Instant::now());
        info!(event = "lock_waiting", holder = %holder, "lock is held by another instance; waiting");
    }

    /// Patience has run out with the lock still held elsewhere.
    pub fn give_up(mut self, holder: HolderInfo) -> Acquisition {
        self.count();
        Acquisition::HeldElsewhere(holder)
    }

    fn count(&mut self) {
        if !self.counted {
            self.counted = true;
            self.metrics.acquire(AcquireOutcome::Held);
        }
    }
}

/// Retry pacing for a standby whose own backend connection failed: never a busy loop.
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(250);
    const MAX: Duration = Duration::from_secs(30);

    pub fn new() -> Backoff {
        Backoff {
            next: Backoff::FIRST,
        }
    }

    pub fn reset(&mut self) {
        self.next = Backoff::FIRST;
    }

    /// Logs the failure and sleeps for the current step, within what patience has left.
    pub async fn pause(&mut self, error: &LockError, patience: Patience) {
        let pause = patience.cap(self.next);
        warn!(event = "backend_retry", error = %error, retry_in = %humantime::format_duration(pause), "lock backend failed while waiting; retrying");
        tokio::time::sleep(pause).await;
        self.next = (self.next * 2).min(Backoff::MAX);
    }
}

/// What every backend needs to know to take the lock.
pub struct LockRequest<'a> {
    pub name: &'a LockName,
    pub timings: &'a Timings,
    pub holder: &'a Holder,
    pub patience: Patience,
    /// Where acquisition outcomes and the held lock's ownership checks are recorded.
    pub metrics: &'a Metrics,
}

/// Takes the lock, waiting for it as long as `request.patience` allows. A backend that fails before
/// the first answer is an error (fail closed); a standby whose backend fails later retries with backoff.
pub async fn acquire(target: &Target, request: &LockRequest<'_>) -> Result<Acquisition, LockError> {
    match target {
        Target::Mysql(mysql) => mysql::acquire(mysql, request).await,
        Target::Redis(redis) => redis::acquire(redis, request).await,
        Target::File(path) => file::acquire(path, request).await,
    }
}

/// Who holds `name` right now, without taking or disturbing the lock. `None`: it is free.
/// `connect` bounds connecting, `answer` each query.
pub async fn status(
    target: &Target,
    name: &LockName,
    connect: Duration,
    answer: Duration,
) -> Result<Option<HolderInfo>, LockError> {
    match target {
        Target::Mysql(mysql) => mysql::status(mysql, name, connect, answer).await,
        Target::Redis(redis) => redis::status(redis, name, connect, answer).await,
        Target::File(path) => file::status(path),
    }
}

pub enum HeldLock {
    Mysql(mysql::MysqlLock),
    Redis(redis::RedisLock),
    File(file::FileLock),
}

impl HeldLock {
    /// Whether the previous holder is known to have released the lock itself, after its app was
    /// dead. Only Redis can tell; elsewhere the server may have dropped a holder whose app still stops.
    pub fn previous_release_was_clean(&self) -> bool {
        match self {
            HeldLock::Redis(lock) => lock.previous_release_was_clean(),
            HeldLock::Mysql(_) | HeldLock::File(_) => false,
        }
    }

    /// By when the app must be dead if the guard hears nothing more from the backend, for the
    /// watchdog that acts if the guard itself freezes. `None` for a file lock: the kernel keeps a
    /// frozen guard's flock, so no one else can take it meanwhile.
    pub fn app_deadline(&self) -> Option<tokio::sync::watch::Receiver<Instant>> {
        match self {
            HeldLock::Mysql(lock) => Some(lock.app_deadline()),
            HeldLock::Redis(lock) => Some(lock.app_deadline()),
            HeldLock::File(_) => None,
        }
    }

    /// The server session the watchdog ends if the guard dies holding the lock; only MySQL keeps a
    /// dead client's lock for a while (Redis leases and file locks need nothing).
    pub fn orphan_session(&self) -> Option<&OrphanSession> {
        match self {
            HeldLock::Mysql(lock) => Some(lock.orphan_session()),
            HeldLock::Redis(_) | HeldLock::File(_) => None,
        }
    }

    /// What the app learns about this acquisition beyond name, backend and holder id.
    pub fn app_env(&self) -> Vec<(&'static str, String)> {
        match self {
            HeldLock::Redis(lock) => vec![(
                "SENTINEL_GUARD_FENCING_TOKEN",
                lock.fencing_token().to_string(),
            )],
            HeldLock::Mysql(_) | HeldLock::File(_) => Vec::new(),
        }
    }

    /// Resolves once the lock is no longer ours. Cancel-safe: may be polled again after a drop.
    pub async fn lost(&mut self) -> LockLoss {
        match self {
            HeldLock::Mysql(lock) => lock.lost().await,
            HeldLock::Redis(lock) => lock.lost().await,
            HeldLock::File(lock) => lock.lost().await,
        }
    }

    /// Gives the lock back. Only called once nothing of the app is alive.
    pub async fn release(self) -> Result<(), LockError> {
        match self {
            HeldLock::Mysql(lock) => lock.release().await,
            HeldLock::Redis(lock) => lock.release().await,
            HeldLock::File(lock) => lock.release(),
        }
    }
}
