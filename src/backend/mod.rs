//! The lock backends behind one small interface: acquire once, then watch for loss, then release.
//!
//! Each backend proves ownership its own way (a MySQL connection that holds `GET_LOCK`, a `flock`ed
//! file), but callers only see `Acquisition`, `HeldLock::lost` and `HeldLock::release`.

mod file;
mod mysql;
mod redis;
mod watched;

use std::fmt;

use thiserror::Error;

use crate::config::{LockName, Target, Timings};
use crate::holder::Holder;

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
    /// Another instance holds the lock; the text describes it as well as the backend allows.
    HeldElsewhere(String),
}

/// What every backend needs to know to take the lock.
pub struct LockRequest<'a> {
    pub name: &'a LockName,
    pub timings: &'a Timings,
    pub holder: &'a Holder,
}

/// Makes one attempt to take the lock, without waiting for it to become free.
pub async fn try_acquire(
    target: &Target,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    match target {
        Target::Mysql(mysql) => mysql::try_acquire(mysql, request).await,
        Target::Redis(redis) => redis::try_acquire(redis, request).await,
        Target::File(path) => file::try_acquire(path, request),
    }
}

pub enum HeldLock {
    Mysql(mysql::MysqlLock),
    Redis(redis::RedisLock),
    File(file::FileLock),
}

impl HeldLock {
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
