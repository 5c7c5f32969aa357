//! A held lock whose ownership a background task keeps proving: the task reports a loss through a
//! watch channel and is asked to release through a oneshot. Shared by the networked backends; the
//! session backends (MySQL, PostgreSQL) also share the task itself (`SessionWatcher`).

use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot::error::TryRecvError;
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::JoinHandle;
use tracing::{debug, Instrument};

use async_trait::async_trait;

use super::{
    ClaimAnswer, ClaimRequest, Held, LockError, LockLoss, LockRequest, Observer, WindowStore,
};
use crate::deadline::Deadline;
use crate::handoff::Farewell;
use crate::record::Previous;
use crate::vocab::CheckOutcome;
use crate::vocab::LossReason;
use crate::window::RunExit;

/// The watcher's side: where to report a loss, and the request to release.
pub struct WatcherEnds {
    pub lost: watch::Sender<Option<LockLoss>>,
    pub release: oneshot::Receiver<()>,
    app_deadline: watch::Sender<Deadline>,
}

impl WatcherEnds {
    pub fn report(&self, loss: LockLoss) {
        let _ = self.lost.send(Some(loss));
    }

    /// Publishes by when the app must be dead if ownership is not proven again before then. A
    /// deadline that has passed is final: it is never replaced by a later one, so the guard acts on
    /// it even when a proof arrives after it (a thawed guard reading a late answer).
    pub fn move_app_deadline(&self, at: Deadline) {
        self.app_deadline.send_if_modified(|current| {
            if current.has_passed() || *current == at {
                return false;
            }
            *current = at;
            true
        });
    }
}

pub struct WatchedLock {
    lost: watch::Receiver<Option<LockLoss>>,
    app_deadline: watch::Receiver<Deadline>,
    release: Option<oneshot::Sender<()>>,
    watcher: JoinHandle<Result<(), LockError>>,
}

impl WatchedLock {
    /// Starts `watcher` as a task in the caller's tracing span; `app_deadline` is the app's first deadline.
    pub fn spawn<F, Fut>(app_deadline: Deadline, watcher: F) -> WatchedLock
    where
        F: FnOnce(WatcherEnds) -> Fut,
        Fut: Future<Output = Result<(), LockError>> + Send + 'static,
    {
        let (lost_tx, lost) = watch::channel(None);
        let (app_deadline_tx, app_deadline) = watch::channel(app_deadline);
        let (release, release_rx) = oneshot::channel();
        let task = watcher(WatcherEnds {
            lost: lost_tx,
            release: release_rx,
            app_deadline: app_deadline_tx,
        });
        WatchedLock {
            lost,
            app_deadline,
            release: Some(release),
            watcher: tokio::spawn(task.in_current_span()),
        }
    }

    /// The latest moment by which the app must be dead, as the watcher keeps moving it.
    pub fn app_deadline(&self) -> watch::Receiver<Deadline> {
        self.app_deadline.clone()
    }

    /// The watcher's reports of a loss, read without waiting.
    pub fn loss_reports(&self) -> watch::Receiver<Option<LockLoss>> {
        self.lost.clone()
    }

    /// Resolves once the watcher reports the lock lost. Cancel-safe.
    pub async fn lost(&mut self) -> LockLoss {
        // The channel's guard is let go before any wait: the future must be Send.
        let loss = match self.lost.wait_for(Option::is_some).await {
            Ok(loss) => loss.clone(),
            Err(_) => None,
        };
        match loss {
            Some(loss) => loss,
            // The watcher only ends without a loss after a release, when nobody waits for loss.
            None => std::future::pending().await,
        }
    }

    pub async fn release(mut self) -> Result<(), LockError> {
        if let Some(release) = self.release.take() {
            let _ = release.send(());
        }
        match self.watcher.await {
            Ok(result) => result,
            Err(e) => Err(LockError::Unreachable(format!("lock watcher failed: {e}"))),
        }
    }
}

/// The timing of a session's ownership checks.
pub struct CheckTiming {
    /// check-interval (the server-side sleep) + check-timeout.
    pub budget: Duration,
    /// The server-side sleep alone: not counted as the check's duration.
    pub sleep: Duration,
    pub grace: Duration,
    pub observer: Arc<dyn Observer>,
}

impl CheckTiming {
    pub fn of(request: &LockRequest<'_>) -> CheckTiming {
        CheckTiming {
            budget: request.timings.detection_bound(),
            sleep: request.timings.check_interval,
            grace: request.timings.grace_period,
            observer: Arc::clone(request.observer),
        }
    }
}

/// What a check's answer says about ownership, before its timing is considered.
pub enum Verdict {
    Owned,
    NotOwner(String),
    /// The server is no longer a writable primary (demoted in place by a switchover): its lock says
    /// nothing any more, since the new primary grants the name to anyone.
    Demoted(String),
    /// The session is gone: the server ended it, or the socket closed.
    Closed(String),
    Failed(String),
    NoAnswer,
}

enum Check {
    Owned,
    Lost(LockLoss),
}

/// A lock that lives as long as one server session (MySQL `GET_LOCK`, a PostgreSQL advisory lock),
/// proven by a check that is always outstanding: a server-side sleep, then an ownership test, so a
/// session ended by the server is seen the instant its socket closes, not at the next check.
pub trait SessionWatcher: Send + Sync + 'static {
    type Conn: Send + 'static;
    type Answer: Send;

    fn timing(&self) -> &CheckTiming;

    /// Sends the check and waits for its answer, at most the timing's budget.
    fn check<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
    ) -> impl Future<Output = Self::Answer> + Send + 'a;

    fn verdict(&self, answer: Self::Answer) -> Verdict;

    /// What `interrupt` sends its request over: a connection to the server that takes a while to
    /// open, and so is opened while the app's tree is torn down rather than after.
    type Interrupter: Send + 'static;

    /// Opens an interrupter, `None` where it cannot. Runs as a task of its own once a release is
    /// coming, so it needs nothing of the watcher.
    fn open_interrupter(&self) -> impl Future<Output = Option<Self::Interrupter>> + Send + 'static;

    /// Cuts the outstanding check's sleep short, so a release is not delayed by up to a check
    /// interval, and returns the check's answer. `ahead` is the interrupter opened while the app's
    /// tree was torn down; without one the interrupt opens what it needs itself, after the tree is
    /// gone. Best effort: the sleep may simply run out.
    fn interrupt<'a, F>(
        &'a self,
        check: Pin<&'a mut F>,
        ahead: Option<Self::Interrupter>,
    ) -> impl Future<Output = Self::Answer> + Send + 'a
    where
        F: Future<Output = Self::Answer> + Send + 'a;

    /// Gives the lock back and closes the session (which frees the lock even where that failed).
    fn release(&self, conn: Self::Conn) -> impl Future<Output = Result<(), LockError>> + Send + '_;

    /// `release`, for a session whose last check had no answer in time. A driver that would read
    /// that answer as the next statement's (MySQL's: a row of another shape aborts a release build)
    /// closes the session without a word, which frees the lock as surely, and leaves the record
    /// `held`, so the next holder waits the takeover bound. One that keeps answers apart releases.
    fn abandon(&self, conn: Self::Conn) -> impl Future<Output = Result<(), LockError>> + Send + '_;
}

/// An answer counts only if it came within the budget of being sent: a guard frozen past it reads a
/// true answer about a moment that no longer holds.
fn judge(timing: &CheckTiming, verdict: Verdict, sent: Deadline) -> Check {
    let lost = |reason, detail: String| Check::Lost(LockLoss { reason, detail });
    let took = sent.elapsed();
    match verdict {
        Verdict::Owned if took > timing.budget => lost(
            LossReason::CheckTimeout,
            format!(
                "the check answered after {}, beyond its {} budget",
                crate::vocab::show_duration(Duration::from_millis(took.as_millis() as u64)),
                crate::vocab::show_duration(timing.budget)
            ),
        ),
        Verdict::Owned => Check::Owned,
        Verdict::NotOwner(detail) => lost(LossReason::NotOwner, detail),
        Verdict::Demoted(detail) => lost(LossReason::PrimaryDemoted, detail),
        Verdict::Closed(detail) => lost(LossReason::ConnectionClosed, detail),
        Verdict::Failed(detail) => lost(LossReason::CheckFailed, detail),
        Verdict::NoAnswer => lost(
            LossReason::CheckTimeout,
            format!(
                "no answer within {}",
                crate::vocab::show_duration(timing.budget)
            ),
        ),
    }
}

/// An interrupter being opened in the background. Dropping it aborts the opening, or closes what
/// was opened: a release that needs no interruption leaves it unused.
struct Opening<T>(JoinHandle<Option<T>>);

impl<T: Send + 'static> Opening<T> {
    fn start(open: impl Future<Output = Option<T>> + Send + 'static) -> Opening<T> {
        Opening(tokio::spawn(open.in_current_span()))
    }

    /// The interrupter once it is open; `None` if it could not be.
    async fn opened(mut self) -> Option<T> {
        (&mut self.0).await.ok().flatten()
    }
}

impl<T> Drop for Opening<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keeps proving ownership until told to release or the lock is lost. Once `release_coming` is
/// notified, the interrupter that the release will need is opened meanwhile.
async fn watch_session<W: SessionWatcher>(
    watcher: W,
    mut conn: W::Conn,
    mut ends: WatcherEnds,
    (release_coming, asked): (Arc<Notify>, Deadline),
) -> Result<(), LockError> {
    let timing = watcher.timing();
    // The latest moment a question may be counted from: the server may have sent its last answer
    // as early as the question before, and counts the session idle from then. A question sent
    // later than the answer's budget (the runtime busy, the guard frozen) is counted from here, so
    // a delay in asking never moves the deadline past the server's session timeout.
    let mut proven_until = asked + timing.budget.saturating_sub(timing.sleep);
    let mut opening: Option<Opening<W::Interrupter>> = None;
    loop {
        // If this check is not answered in time, the guard stops the app within the grace period.
        // A release asked for between checks needs no sleep interrupted.
        if !matches!(ends.release.try_recv(), Err(TryRecvError::Empty)) {
            return watcher.release(conn).await;
        }
        let sent = Deadline::now();
        ends.move_app_deadline(sent.min(proven_until) + timing.budget + timing.grace);
        // For a check cut short by a release: whether it was answered (see below).
        let (check, release) = {
            let check = watcher.check(&mut conn);
            tokio::pin!(check);
            loop {
                tokio::select! {
                    biased;
                    answer = &mut check => {
                        break (judge(timing, watcher.verdict(answer), sent), None);
                    }
                    // Ahead of the release, which always comes after it: seen at once, the release
                    // takes its interrupter from the opening, as when the teardown leaves it time.
                    () = release_coming.notified(), if opening.is_none() => {
                        opening = Some(Opening::start(watcher.open_interrupter()));
                    }
                    _ = &mut ends.release => {
                        let ahead = match opening.take() {
                            Some(opening) => opening.opened().await,
                            None => None,
                        };
                        debug!(
                            opened_ahead = ahead.is_some(),
                            "interrupting the check to release the lock"
                        );
                        let verdict = watcher.verdict(watcher.interrupt(check, ahead).await);
                        let answered = !matches!(verdict, Verdict::NoAnswer);
                        break (judge(timing, verdict, sent), Some(answered));
                    }
                }
            }
        };
        // An interrupted check says nothing about how fast the server answers.
        if release.is_none() {
            let outcome = match &check {
                Check::Owned => CheckOutcome::Ok,
                Check::Lost(loss) if loss.reason == LossReason::CheckTimeout => {
                    CheckOutcome::Timeout
                }
                Check::Lost(_) => CheckOutcome::Error,
            };
            timing
                .observer
                .check(outcome, sent.elapsed().saturating_sub(timing.sleep));
        }
        match (check, release) {
            (Check::Owned, None) => {
                proven_until = sent + timing.budget;
                continue;
            }
            // Interrupting the check can fail it; release all the same, which logs how the
            // session ended.
            (_, Some(true)) => return watcher.release(conn).await,
            (_, Some(false)) => return watcher.abandon(conn).await,
            (Check::Lost(loss), None) => {
                let closed = loss.reason == LossReason::ConnectionClosed;
                ends.report(loss);
                if !closed {
                    // Closing the session would free the lock on the server at once, while the app
                    // may still be inside its grace period: the session stays open, unused, until
                    // the guard is done with the lock (after teardown). The server's session
                    // timeouts still bound how long it keeps a silent one.
                    let _ = (&mut ends.release).await;
                }
                return Ok(());
            }
        }
    }
}

/// A held session lock: its watcher task, the watchdog's farewell, and the fencing token where the
/// backend has one.
pub struct SessionLock {
    watched: WatchedLock,
    /// Tells the watcher a release will follow (see `release_coming`).
    release_coming: Arc<Notify>,
    farewell: Vec<u8>,
    /// A copy of the session's socket, which the watchdog keeps until the app's group is gone
    /// (`session_socket`); none where it could not be found.
    socket: Option<OwnedFd>,
    fencing_token: Option<u64>,
}

impl SessionLock {
    /// `asked` is when the statement that was granted the lock was sent, plus the longest it may
    /// have waited on the server for the lock: the server may count the session idle from any
    /// moment after the send, so the first deadline is counted from it, as a check's is from the
    /// check's send plus its sleep, and not from now (a guard frozen between the grant and this line
    /// must not start its app on a full grace period). The session timeout covers that wait
    /// (`Timings::session_timeout_secs`). `ports` are the session's client port, as the server reports it, and the
    /// server's port: they find the socket the watchdog keeps a copy of.
    pub fn spawn<W: SessionWatcher>(
        watcher: W,
        conn: W::Conn,
        farewell: Vec<u8>,
        fencing_token: Option<u64>,
        (asked, ports): (Deadline, Option<(u16, u16)>),
    ) -> SessionLock {
        let socket = ports.and_then(|(client, server)| super::session_socket::copy(client, server));
        if socket.is_none() {
            debug!("no copy of the session's socket for the watchdog; the server's own detection frees the lock of a dead guard");
        }
        let app_deadline = asked + watcher.timing().budget + watcher.timing().grace;
        let release_coming = Arc::new(Notify::new());
        let coming = release_coming.clone();
        SessionLock {
            watched: WatchedLock::spawn(app_deadline, |ends| {
                watch_session(watcher, conn, ends, (coming, asked))
            }),
            release_coming,
            farewell,
            socket,
            fencing_token,
        }
    }

    pub fn farewell(&self) -> Farewell<'_> {
        Farewell {
            message: self.farewell.clone(),
            keep: self.socket.as_ref().map(AsFd::as_fd),
        }
    }

    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    pub async fn lost(&mut self) -> LockLoss {
        self.watched.lost().await
    }

    pub fn loss_reports(&self) -> watch::Receiver<Option<LockLoss>> {
        self.watched.loss_reports()
    }

    /// Says a release will follow once the app's tree is gone, so the watcher opens its interrupter
    /// meanwhile. Never blocks.
    pub fn release_coming(&self) {
        self.release_coming.notify_one();
    }

    pub async fn release(self) -> Result<(), LockError> {
        self.watched.release().await
    }

    pub fn app_deadline(&self) -> watch::Receiver<Deadline> {
        self.watched.app_deadline()
    }
}

/// A held session lock (MySQL, PostgreSQL): the session that proves it, what acquisition found, and
/// the backend's store for scheduled windows.
pub struct SessionHeld<W> {
    pub session: SessionLock,
    pub previous: Previous,
    pub windows: W,
}

#[async_trait]
impl<W: WindowStore> WindowStore for SessionHeld<W> {
    async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        self.windows.claim(request).await
    }

    async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError> {
        self.windows.record_end(request, exit).await
    }
}

#[async_trait]
impl<W: WindowStore> Held for SessionHeld<W> {
    fn previous(&self) -> Previous {
        self.previous
    }

    fn fencing_token(&self) -> Option<String> {
        self.session.fencing_token().map(|token| token.to_string())
    }

    fn released_cleanly(&self) -> bool {
        false
    }

    fn app_deadline(&self) -> Option<watch::Receiver<Deadline>> {
        Some(self.session.app_deadline())
    }

    /// MySQL and PostgreSQL keep a dead client's lock until they notice: the watchdog ends the
    /// session.
    fn farewell(&self) -> Farewell<'_> {
        self.session.farewell()
    }

    fn loss_reports(&self) -> Option<watch::Receiver<Option<LockLoss>>> {
        Some(self.session.loss_reports())
    }

    async fn lost(&mut self) -> LockLoss {
        self.session.lost().await
    }

    fn release_coming(&self) {
        self.session.release_coming()
    }

    async fn give_back(self: Box<Self>) -> Result<(), LockError> {
        self.session.release().await
    }
}
