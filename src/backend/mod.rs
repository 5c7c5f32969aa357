//! The lock backends behind one small interface: acquire once, then watch for loss, then release.
//!
//! Each backend proves ownership its own way (a MySQL connection that holds `GET_LOCK`, a `flock`ed
//! file), but callers only see `Acquisition`, `HeldLock::lost` and `HeldLock::release`.

mod acquire;
mod etcd;
#[cfg(test)]
pub mod fake;
mod farewell;
mod file;
mod mysql;
mod postgres;
mod record_table;
mod redis;
mod renewing;
mod session_socket;
mod watched;
mod window_table;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use thiserror::Error;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::{LockName, Target, Timings};
use crate::deadline::Deadline;
use crate::handoff::Farewell;
use crate::handoff::TreeGone;
use crate::holder::Holder;
use crate::record::{Previous, RecordFacts};
use crate::vocab::{CheckOutcome, LossReason, ENV_FENCING_TOKEN};
use crate::window::{Claim, RunExit, Schedule, UnixMicros, Window, WindowOutcome};

pub use acquire::Backoff;
use acquire::{
    acquire_lease, acquire_session, Contention, Grant, LeaseAnswer, LeaseFailure, LeaseTry,
    SessionTry,
};

/// Why the lock could not be taken or used. Every variant means "the app must not run": exit 69,
/// but `NotALockFile`, a mistake in the invocation: exit 2.
#[derive(Debug, Error)]
pub enum LockError {
    /// The lock path names something the guard must not touch: a symbolic link, a directory, a
    /// file with someone else's content.
    #[error("{0}")]
    NotALockFile(String),
    #[error("lock backend unreachable: {0}")]
    Unreachable(String),
    #[error("lock backend refused the guard: {0}")]
    Refused(String),
    #[error("lock backend is unsafe for a singleton lock: {0}")]
    Unsafe(String),
}

/// A connection that failed: a certificate rustls did not trust is the backend refusing the guard,
/// said with what to do about it; anything else is an unreachable backend.
fn connect_failure(message: String) -> LockError {
    if message.contains("invalid peer certificate") {
        LockError::Refused(format!(
            "TLS certificate not trusted (give the CA that signed the server's certificate with --ca-file): {message}"
        ))
    } else {
        LockError::Unreachable(message)
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
                .with("started", started_at(h.started)),
            None => self,
        }
    }

    pub fn fields(&self) -> &[(&'static str, String)] {
        &self.0
    }
}

/// A holder's start, RFC 3339. The number comes from outside the guard (a lock file, a Redis value,
/// a query text on the server): one no clock can mean (from the year 10000 on) is shown as it is.
fn started_at(unix_secs: u64) -> String {
    if unix_secs < crate::vocab::RFC3339_END_SECS {
        humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix_secs),
        )
        .to_string()
    } else {
        unix_secs.to_string()
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

/// What the lock layer reports as it works. The guard turns it into metrics and the service
/// manager's status line; the backends know nothing of either.
pub trait Observer: Send + Sync {
    /// One ownership check ended; `took` leaves out any wait the check asks of the server on
    /// purpose (MySQL's `SLEEP`).
    fn check(&self, outcome: CheckOutcome, took: Duration);
    /// The lock was found held by another instance: once per acquisition, at first sight.
    fn held_elsewhere(&self);
    /// A wait for the lock held by `holder` began, or goes on (at most once a minute).
    fn waiting(&self, holder: &HolderInfo);
}

/// What every backend needs to know to take the lock.
pub struct LockRequest<'a> {
    pub name: &'a LockName,
    pub timings: &'a Timings,
    pub holder: &'a Holder,
    pub patience: Patience,
    /// Told of contention and of the held lock's ownership checks.
    pub observer: &'a Arc<dyn Observer>,
}

/// Takes the lock, waiting for it as long as `request.patience` allows. A backend that fails before
/// the first answer is an error (fail closed); a standby whose backend fails later retries with backoff.
pub async fn acquire(target: &Target, request: &LockRequest<'_>) -> Result<Acquisition, LockError> {
    match target {
        Target::Mysql(mysql) => mysql::acquire(mysql, request).await,
        Target::Postgres(postgres) => postgres::acquire(postgres, request).await,
        Target::Redis(redis) => redis::acquire(redis, request).await,
        Target::Etcd(etcd) => etcd::acquire(etcd, request).await,
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
        Target::Postgres(postgres) => postgres::status(postgres, name, connect, answer).await,
        Target::Redis(redis) => redis::status(redis, name, connect, answer).await,
        Target::Etcd(etcd) => etcd::status(etcd, name, connect, answer).await,
        Target::File(path) => file::status(path),
    }
}

/// The backend's clock, which numbers the windows of scheduled runs: every replica sees the same
/// windows whatever its own clock says. The file backend's clock is this host's.
pub async fn server_clock(target: &Target, timings: &Timings) -> Result<UnixMicros, LockError> {
    match target {
        Target::Mysql(mysql) => mysql::server_clock(mysql, timings).await,
        Target::Postgres(postgres) => postgres::server_clock(postgres, timings).await,
        Target::Redis(redis) => redis::server_clock(redis, timings).await,
        // Refused at start-up (`config::schedule`): etcd has no clock to ask.
        Target::Etcd(_) => Err(LockError::Refused(
            "etcd has no clock to number windows with".to_owned(),
        )),
        Target::File(_) => Ok(crate::window::local_now()),
    }
}

/// The last window claimed under `name`, if any: for `status`, and for telling a window claimed by
/// another replica from one skipped because the previous run still holds the lock.
pub async fn last_claim(
    target: &Target,
    name: &LockName,
    connect: Duration,
    answer: Duration,
) -> Result<Option<Claim>, LockError> {
    match target {
        Target::Mysql(mysql) => mysql::last_claim(mysql, name, connect, answer).await,
        Target::Postgres(postgres) => postgres::last_claim(postgres, name, connect, answer).await,
        Target::Redis(redis) => redis::last_claim(redis, name, connect, answer).await,
        Target::Etcd(_) => Ok(None),
        Target::File(path) => Ok(file::last_claim(path)),
    }
}

/// The lock's record (its state and last fencing token), read without taking the lock.
pub async fn last_record(
    target: &Target,
    name: &LockName,
    connect: Duration,
    answer: Duration,
) -> Result<Option<RecordFacts>, LockError> {
    match target {
        Target::Mysql(mysql) => mysql::last_record(mysql, name, connect, answer).await,
        Target::Postgres(postgres) => postgres::last_record(postgres, name, connect, answer).await,
        Target::Redis(redis) => redis::last_record(redis, name, connect, answer).await,
        Target::Etcd(etcd) => etcd::last_record(etcd, name, connect, answer).await,
        Target::File(path) => Ok(file::last_record(path)),
    }
}

/// How an attempt to claim a window under the held lock ended.
pub enum ClaimAnswer {
    /// The window is ours to run: recorded durably, so no replica, this one included, runs it again.
    Ours,
    /// The last claim keeps the window from being claimed (`Claim::blocks`): claimed elsewhere, or
    /// busy.
    Blocked(WindowOutcome, Claim),
    /// The backend's clock is no longer (or not yet) in the window, or the lock stopped being ours
    /// before the claim (why, in words): nothing was recorded by this answer (a first send whose
    /// answer was lost may have been: the next claim of the window takes it as its own); the
    /// scheduler looks at the clock again.
    NotNow(&'static str),
    /// The claim may be stored, but not durably enough to keep another replica from claiming the
    /// window again after a failover (why, in words): the window is not run, here or by a retry.
    Unkept(&'static str),
}

impl ClaimAnswer {
    /// `Blocked` when the last recorded claim keeps `window` from being claimed (`Claim::blocks`).
    fn blocked_by(last: Option<&Claim>, window: &Window) -> Option<ClaimAnswer> {
        let last = last?;
        let outcome = last.blocks(window)?;
        Some(ClaimAnswer::Blocked(outcome, last.clone()))
    }
}

/// What a claim needs beyond the held lock.
pub struct ClaimRequest<'a> {
    pub name: &'a LockName,
    pub schedule: &'a Schedule,
    pub window: &'a Window,
    pub holder: &'a Holder,
    pub timings: &'a Timings,
}

/// The lock's key on the backend where it differs from its name: PostgreSQL's advisory lock key,
/// which a DBA looks for in `pg_locks`.
pub fn lock_key(target: &Target, name: &LockName) -> Option<i64> {
    match target {
        Target::Postgres(_) => Some(postgres::lock_key(name)),
        Target::Mysql(_) | Target::Redis(_) | Target::Etcd(_) | Target::File(_) => None,
    }
}

/// One backend's held lock: what `HeldLock` asks of every backend, each method on purpose without a
/// default. A new backend implements it in its own file (its `acquire`, `status` and the rest are
/// still dispatched on `Target` below).
#[async_trait]
pub trait Held: WindowStore {
    /// What the lock record found at acquisition says of the previous holder's app.
    fn previous(&self) -> Previous;

    /// The fencing token drawn for this acquisition, where the backend draws one.
    fn fencing_token(&self) -> Option<String>;

    /// Whether the previous holder released the lock on a topology where that record survives a
    /// failover: the one case a fixed `--takeover-delay` is skipped (Redis and etcd).
    fn released_cleanly(&self) -> bool;

    /// By when the app must be dead if the guard hears nothing more from the backend, for the
    /// guard's deadline timer and the watchdog that acts if the guard itself freezes. `None`: the
    /// lock cannot pass to anyone while the guard is frozen (a file lock: the kernel keeps the
    /// frozen guard's flock).
    fn app_deadline(&self) -> Option<watch::Receiver<Deadline>>;

    /// What the watchdog does for this lock if the guard dies holding it, once the app is gone.
    fn farewell(&self) -> Farewell<'_>;

    /// Where a task of the lock reports a loss, to be read without waiting: the guard before it
    /// starts the app, the app's socket whenever it answers.
    fn loss_reports(&self) -> Option<watch::Receiver<Option<LockLoss>>>;

    /// Resolves once the lock is no longer ours. Cancel-safe: may be polled again after a drop.
    async fn lost(&mut self) -> LockLoss;

    /// A release will follow once the app's tree is gone (see `HeldLock::release_coming`): the
    /// moment to get ready for it, never blocking.
    fn release_coming(&self);

    async fn give_back(self: Box<Self>) -> Result<(), LockError>;
}

/// Where scheduled runs record their windows under a held lock: every held lock is one (`Held`); the
/// session backends keep theirs in a table on a connection of its own, as the lock's connection is
/// busy with its check.
#[async_trait]
pub trait WindowStore: Send {
    /// Claims `request.window`, in one step that also proves the lock is still ours and that the
    /// backend's clock is inside the window.
    async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError>;

    /// Records how the run of a claimed window ended; only called while the lock is still ours.
    async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError>;
}

/// A held lock, whatever the backend.
pub struct HeldLock(Box<dyn Held>);

impl HeldLock {
    pub fn new(lock: impl Held + 'static) -> HeldLock {
        HeldLock(Box::new(lock))
    }

    pub fn released_cleanly(&self) -> bool {
        self.0.released_cleanly()
    }

    pub fn previous(&self) -> Previous {
        self.0.previous()
    }

    pub fn app_deadline(&self) -> Option<watch::Receiver<Deadline>> {
        self.0.app_deadline()
    }

    pub fn farewell(&self) -> Farewell<'_> {
        self.0.farewell()
    }

    /// What the app learns about this acquisition beyond name, backend and holder id.
    pub fn app_env(&self) -> Vec<(&'static str, String)> {
        self.fencing_token()
            .map(|token| (ENV_FENCING_TOKEN, token))
            .into_iter()
            .collect()
    }

    pub fn loss_reports(&self) -> Option<watch::Receiver<Option<LockLoss>>> {
        self.0.loss_reports()
    }

    /// This acquisition's fencing token, where the backend keeps one.
    pub fn fencing_token(&self) -> Option<String> {
        self.0.fencing_token()
    }

    /// Whether the lock is already known to be lost, without waiting: checked right before the app
    /// is started, so it never starts on a lock that is gone, nor on one whose deadline has passed.
    pub fn known_lost(&self) -> Option<LockLoss> {
        let reported = self.0.loss_reports().and_then(|rx| rx.borrow().clone());
        reported.or_else(|| {
            let deadline = *self.app_deadline()?.borrow();
            deadline.has_passed().then(|| LockLoss {
                reason: LossReason::DeadlinePassed,
                detail: "the lock's deadline passed before the app was started".to_owned(),
            })
        })
    }

    /// Resolves once the lock is no longer ours. Cancel-safe: may be polled again after a drop.
    pub async fn lost(&mut self) -> LockLoss {
        self.0.lost().await
    }

    pub async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        self.0.claim(request).await
    }

    pub async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError> {
        self.0.record_end(request, exit).await
    }

    /// Says the lock will be given back once the app's tree is gone, so a session backend opens the
    /// connection that ends its check's sleep (MySQL's side connection, the stream for PostgreSQL's
    /// cancel request) while the tree is torn down instead of after. Never blocks: it comes right
    /// after the teardown's first signal.
    pub fn release_coming(&self) {
        self.0.release_coming()
    }

    /// Gives back a lock under which no app was ever started (a stop during the takeover delay, a
    /// command that could not be spawned). Once one is, the lock is a `ServingLock`, which only
    /// the proof that the app's tree is gone gives back.
    pub async fn release_unused(self) -> Result<(), LockError> {
        self.0.give_back().await
    }

    /// The lock, now that an app runs under it.
    pub fn serving(self) -> ServingLock {
        ServingLock(self)
    }
}

/// A held lock under which an app was started: everything a `HeldLock` does while the app runs,
/// and given back only with the proof that nothing of the app is alive.
pub struct ServingLock(HeldLock);

impl ServingLock {
    pub async fn release(self, _gone: TreeGone) -> Result<(), LockError> {
        let ServingLock(HeldLock(lock)) = self;
        lock.give_back().await
    }
}

impl std::ops::Deref for ServingLock {
    type Target = HeldLock;

    fn deref(&self) -> &HeldLock {
        &self.0
    }
}

impl std::ops::DerefMut for ServingLock {
    fn deref_mut(&mut self) -> &mut HeldLock {
        &mut self.0
    }
}

/// Runs, in the watchdog of a guard that died holding a lock, the farewell message the backend
/// handed it (see `HeldLock::farewell`).
pub fn say_farewell(message: &[u8]) -> Result<String, String> {
    let farewell = farewell::SessionFarewell::decode(message)
        .ok_or_else(|| "the farewell message is not one this program writes".to_owned())?;
    match farewell.server {
        farewell::Server::Mysql => mysql::end_session(&farewell),
        farewell::Server::Postgres => postgres::end_session(&farewell),
        farewell::Server::Etcd => etcd::end_session(&farewell),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holders_start_from_outside_never_panics() {
        assert_eq!(started_at(0), "1970-01-01T00:00:00Z");
        assert_eq!(started_at(1_796_029_255), "2026-11-30T09:00:55Z");
        assert_eq!(started_at(253_402_300_800), "253402300800");
        assert_eq!(started_at(u64::MAX), u64::MAX.to_string());
    }
}
