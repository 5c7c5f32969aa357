//! Waiting for a lock and taking it. A lock that lives as long as a server session (MySQL's
//! `GET_LOCK`, PostgreSQL's advisory locks) is taken by one loop, `acquire_session`, over a
//! backend's single try (`SessionTry`); a lease (Redis, etcd) by another, `acquire_lease`, over
//! `LeaseTry`. Every backend's wait shares the pacing below: contention reported and logged without
//! flooding, retries with backoff, fail closed at start.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{Acquisition, HeldLock, HolderInfo, LockError, LockRequest, Observer, Patience};
use crate::config::RedactedUrl;
use crate::deadline::Deadline;
use crate::record::Previous;

/// A backend's part of taking a session lock; `acquire_session` is the loop around it.
pub(super) trait SessionTry {
    /// The server session the lock lives on: dropping it gives back whatever it was granted.
    type Session;
    /// What a grant said that `hold` needs (PostgreSQL: the backend that was granted the lock).
    type Grant;

    fn url(&self) -> &RedactedUrl;

    /// A new session, set up and checked for safety.
    async fn open(&self) -> Result<Self::Session, LockError>;

    /// Asks for the lock once, waiting up to `chunk` on the server, all within `budget`: the grant,
    /// or `None` while another holds it.
    async fn try_once(
        &self,
        session: &mut Self::Session,
        chunk: Duration,
        budget: Duration,
    ) -> Result<Option<Self::Grant>, LockError>;

    /// Makes a grant a held lock (the proof, the record, the watcher); `granted_by` is the latest
    /// instant the grant may have been made at. An error drops the session, which gives the lock
    /// back before any app started.
    async fn hold(
        &self,
        session: Self::Session,
        grant: Self::Grant,
        granted_by: Deadline,
    ) -> Result<HeldLock, LockError>;

    /// Who holds the lock, and whether the session may still be used after asking (`Err` says why
    /// not).
    async fn holder(&self, session: &mut Self::Session) -> (HolderInfo, Result<(), LockError>);

    /// Ends the session of a wait that was given up.
    async fn close(&self, session: Self::Session) {
        drop(session);
    }
}

/// Takes a session lock, waiting for it as long as `request.patience` allows. The server grants a
/// waiting session the lock the moment it is free; the wait is cut into chunks (`Contention`) so
/// that patience and the session's health are seen to regularly.
pub(super) async fn acquire_session<B: SessionTry>(
    backend: &B,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let patience = request.patience;
    let mut session = backend.open().await?;
    let mut contention = Contention::new(&**request.observer);
    let mut backoff = Backoff::new();
    loop {
        let chunk = contention.next_wait(patience);
        let sent = Deadline::now();
        let budget = chunk + request.timings.check_timeout;
        let error = match backend.try_once(&mut session, chunk, budget).await {
            // Granted, but read after a freeze: the server may have ended the silent session and
            // granted the lock elsewhere since. Dropping the session gives it back.
            Ok(Some(_)) if sent.elapsed() > budget => LockError::Unreachable(format!(
                "{}: the lock was granted after {}, too late to rely on; the session is closed",
                backend.url(),
                crate::vocab::show_duration(Duration::from_millis(
                    sent.elapsed().as_millis() as u64
                ))
            )),
            Ok(Some(grant)) => match backend.hold(session, grant, sent + chunk).await {
                Ok(held) => return Ok(Acquisition::Acquired(held)),
                // The session is gone with the lock it was granted: a new one, as after any failure.
                Err(error) => {
                    session = reopen(error, patience, &mut backoff, || backend.open()).await?;
                    continue;
                }
            },
            Ok(None) if patience.exhausted() => {
                let (holder, _) = backend.holder(&mut session).await;
                backend.close(session).await;
                return Ok(contention.give_up(holder));
            }
            Ok(None) if !contention.log_due() => {
                backoff.reset();
                continue;
            }
            Ok(None) => {
                let (holder, usable) = backend.holder(&mut session).await;
                contention.waiting(&holder);
                match usable {
                    Ok(()) => {
                        backoff.reset();
                        continue;
                    }
                    Err(error) => error,
                }
            }
            Err(error) => error,
        };
        // Fail closed at start; a standby whose own session failed reconnects with backoff. Closing
        // the failed session first gives back a lock it may have been granted.
        drop(session);
        session = reopen(error, patience, &mut backoff, || backend.open()).await?;
    }
}

/// A backend's part of taking a lease; `acquire_lease` is the loop around it. Unlike a session
/// lock, a lease is asked for again and again: a server does not queue a waiter.
pub(super) trait LeaseTry {
    /// What a granted lease is kept alive through (a connection, the lease's id).
    type Lease;
    /// What the lock was found held at, to wait for its release from.
    type Found;

    /// Asks for the lease once. The request is safe to make again after a lost answer: a grant
    /// found again is the instance's own.
    async fn attempt(&mut self) -> Result<LeaseAnswer<Self::Lease, Self::Found>, LeaseFailure>;

    /// Makes a grant a held lock, kept alive from here on.
    fn hold(self, grant: Grant<Self::Lease>) -> HeldLock;

    /// Waits a while, as patience allows, and less if the lock is released meanwhile.
    async fn wait_for_release(&mut self, found: Self::Found, patience: Patience);

    /// Gives back what a wait that was given up had drawn for itself.
    async fn abandon(&mut self) {}
}

pub(super) enum LeaseAnswer<L, F> {
    Granted(Grant<L>),
    Held(HolderInfo, F),
}

/// A granted lease: what keeps it alive, its fencing token, what it found of the previous holder,
/// and when the request that granted it was sent (the lease counts from then).
pub(super) struct Grant<L> {
    pub lease: L,
    pub fence: i64,
    pub previous: Previous,
    pub sent: Deadline,
}

/// A failed attempt, whether retrying could mend it, and whether anything could have reached the
/// server (a refused connection carried nothing, so no reply of it can have been lost).
pub(super) struct LeaseFailure {
    pub error: LockError,
    pub permanent: bool,
    pub sent_nothing: bool,
}

/// Before the first answer, a failed attempt is tried again after this pause until
/// connect-timeout.
const LEASE_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Takes a lease, waiting for it as long as `request.patience` allows.
pub(super) async fn acquire_lease<B: LeaseTry>(
    mut backend: B,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let patience = request.patience;
    let fail_closed_at = Instant::now() + request.timings.connect_timeout;
    let mut answered = false;
    // Whether an earlier attempt may have been sent, whose lease a lost reply would leave.
    let mut maybe_sent = false;
    let mut contention = Contention::new(&**request.observer);
    // A grant whose answer was lost is found again by the next attempt only while it lasts (Redis
    // answers it as it was granted, so a clean hand-over stays instant; run out, it is a lease that
    // expired, and the hand-over waits). The rest of the failed attempt, the next one's connect and
    // its answer all come between: the pause leaves room for them, as far as a second allows.
    let timings = request.timings;
    let mut backoff = Backoff::up_to(
        timings
            .ttl
            .saturating_sub(timings.connect_timeout + 3 * timings.check_timeout),
    );
    loop {
        let failure = match backend.attempt().await {
            Ok(LeaseAnswer::Granted(grant)) => {
                return Ok(Acquisition::Acquired(backend.hold(grant)))
            }
            Ok(LeaseAnswer::Held(holder, found)) => {
                if patience.exhausted() {
                    backend.abandon().await;
                    return Ok(contention.give_up(holder));
                }
                answered = true;
                backoff.reset();
                if contention.log_due() {
                    contention.waiting(&holder);
                }
                backend.wait_for_release(found, patience).await;
                continue;
            }
            Err(failure) => failure,
        };
        if failure.permanent {
            return Err(failure.error);
        }
        if answered {
            if patience.exhausted() {
                return Err(failure.error);
            }
            backoff.pause(&failure.error, patience).await;
        } else {
            // Before the first answer the guard fails closed, but the attempt is safe to make again:
            // a reply lost to a timeout is simply asked again until connect-timeout. A refused
            // first connection lost nothing: it fails at once, as on every backend.
            let nothing_sent = failure.sent_nothing && !maybe_sent;
            maybe_sent |= !failure.sent_nothing;
            if nothing_sent || Instant::now() + LEASE_RETRY_PAUSE >= fail_closed_at {
                return Err(failure.error);
            }
            debug!(error = %failure.error, "acquisition attempt failed; retrying");
            tokio::time::sleep(LEASE_RETRY_PAUSE).await;
        }
    }
}

/// A lock found held by another instance: reported once per acquisition (at first sight, so a
/// waiting standby shows up while it waits), and logged with its holder when the wait starts, then
/// at most once a minute.
pub struct Contention<'a> {
    observer: &'a dyn Observer,
    last_log: Option<Instant>,
    counted: bool,
}

const WAIT_LOG_EVERY: Duration = Duration::from_secs(60);

impl Contention<'_> {
    pub fn new(observer: &dyn Observer) -> Contention<'_> {
        Contention {
            observer,
            last_log: None,
            counted: false,
        }
    }

    /// Whether the "still waiting" line is due; true until the lock was first found held.
    pub fn log_due(&self) -> bool {
        self.last_log
            .is_none_or(|at| at.elapsed() >= WAIT_LOG_EVERY)
    }

    /// How long the next server-side wait for the lock (MySQL `GET_LOCK`, PostgreSQL
    /// `pg_advisory_lock`) may last: none while the "still waiting" line is due, so a standby names
    /// the holder at once; else a chunk of at most `MAX_LOCK_WAIT_CHUNK`, so patience and the session's health are
    /// re-checked regularly. The server grants a waiter the lock the moment it is free.
    pub fn next_wait(&self, patience: Patience) -> Duration {
        if self.log_due() {
            Duration::ZERO
        } else {
            patience.cap(crate::config::MAX_LOCK_WAIT_CHUNK)
        }
    }

    pub fn waiting(&mut self, holder: &HolderInfo) {
        self.count();
        self.last_log = Some(Instant::now());
        info!(event = "lock_waiting", holder = %holder, "lock is held by another instance; waiting");
        self.observer.waiting(holder);
    }

    /// Patience has run out with the lock still held elsewhere.
    pub fn give_up(mut self, holder: HolderInfo) -> Acquisition {
        self.count();
        Acquisition::HeldElsewhere(holder)
    }

    fn count(&mut self) {
        if !self.counted {
            self.counted = true;
            self.observer.held_elsewhere();
        }
    }
}

/// Retry pacing for a standby whose own backend connection failed: never a busy loop.
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(250);
    /// The lowest ceiling: however short the lease, a long outage is retried (and logged) at most
    /// once a second.
    const MIN_CEILING: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(30);

    pub fn new() -> Backoff {
        Backoff::up_to(Backoff::MAX)
    }

    /// Pauses that grow no longer than `max`, within `Backoff::MIN_CEILING` and `Backoff::MAX`.
    pub fn up_to(max: Duration) -> Backoff {
        Backoff {
            next: Backoff::FIRST,
            max: max.clamp(Backoff::MIN_CEILING, Backoff::MAX),
        }
    }

    pub fn reset(&mut self) {
        self.next = Backoff::FIRST;
    }

    /// Logs the failure and sleeps for the current step, within what patience has left.
    pub async fn pause(&mut self, error: &LockError, patience: Patience) {
        let pause = patience.cap(self.step());
        warn!(event = "backend_retry", error = %error, retry_in = %crate::vocab::show_duration(pause), "lock backend failed while waiting; retrying");
        tokio::time::sleep(pause).await;
    }

    /// The current pause; the next one is twice as long, up to the ceiling.
    fn step(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(self.max);
        pause
    }
}

/// Reopens the session of a standby whose own session failed, with backoff, until patience runs out;
/// at start (no patience) and on an unsafe server, the error is final: fail closed.
pub async fn reopen<S, F, Fut>(
    mut error: LockError,
    patience: Patience,
    backoff: &mut Backoff,
    mut open: F,
) -> Result<S, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<S, LockError>>,
{
    if patience == Patience::None || matches!(error, LockError::Unsafe(_)) {
        return Err(error);
    }
    loop {
        if patience.exhausted() {
            return Err(error);
        }
        backoff.pause(&error, patience).await;
        match open().await {
            Ok(session) => return Ok(session),
            Err(unsafe_server @ LockError::Unsafe(_)) => return Err(unsafe_server),
            Err(e) => error = e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pauses(mut backoff: Backoff) -> Vec<u64> {
        (0..10).map(|_| backoff.step().as_millis() as u64).collect()
    }

    #[test]
    fn pauses_double_up_to_their_ceiling_which_is_never_below_a_second() {
        assert_eq!(
            pauses(Backoff::up_to(Duration::from_secs(2))),
            [250, 500, 1000, 2000, 2000, 2000, 2000, 2000, 2000, 2000]
        );
        assert_eq!(
            pauses(Backoff::up_to(Duration::ZERO)),
            [250, 500, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000]
        );
        assert_eq!(
            pauses(Backoff::up_to(Duration::from_secs(86_400)))[9],
            30_000
        );
        assert_eq!(pauses(Backoff::new()), pauses(Backoff::up_to(Backoff::MAX)));
    }
}
