//! A held lock whose ownership a background task keeps proving: the task reports a loss through a
//! watch channel and is asked to release through a oneshot. Shared by the networked backends.

use std::future::Future;

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::{LockError, LockLoss};
use crate::deadline::Deadline;

/// The watcher's side: where to report a loss, and the request to release.
pub struct WatcherEnds {
    pub lost: watch::Sender<Option<LockLoss>>,
    pub release: oneshot::Receiver<()>,
    pub release_coming: ReleaseComing,
    dead_by: watch::Sender<Deadline>,
}

/// Turns on when a release is coming (the app has ended and its tree is being torn down), so a
/// watcher can get ready for it meanwhile.
pub struct ReleaseComing(watch::Receiver<bool>);

impl ReleaseComing {
    /// Resolves once a release is known to be coming; at once every time after that.
    pub async fn wait(&mut self) {
        if self.0.wait_for(|coming| *coming).await.is_err() {
            // The lock's owner is gone without a word: only the release channel matters now.
            std::future::pending::<()>().await;
        }
    }
}

impl WatcherEnds {
    pub fn report(&self, loss: LockLoss) {
        let _ = self.lost.send(Some(loss));
    }

    /// Publishes by when the app must be dead if ownership is not proven again before then. A
    /// deadline that has passed is final: it is never replaced by a later one, so the guard acts on
    /// it even when a proof arrives after it (a thawed guard reading a late answer).
    pub fn app_dead_by(&self, at: Deadline) {
        self.dead_by.send_if_modified(|current| {
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
    dead_by: watch::Receiver<Deadline>,
    release: Option<oneshot::Sender<()>>,
    release_coming: watch::Sender<bool>,
    watcher: JoinHandle<Result<(), LockError>>,
}

impl WatchedLock {
    /// Starts `watcher` as a task in the caller's tracing span; `dead_by` is the app's first deadline.
    pub fn spawn<F, Fut>(dead_by: Deadline, watcher: F) -> WatchedLock
    where
        F: FnOnce(WatcherEnds) -> Fut,
        Fut: Future<Output = Result<(), LockError>> + Send + 'static,
    {
        let (lost_tx, lost) = watch::channel(None);
        let (dead_by_tx, dead_by) = watch::channel(dead_by);
        let (release, release_rx) = oneshot::channel();
        let (release_coming, release_coming_rx) = watch::channel(false);
        let task = watcher(WatcherEnds {
            lost: lost_tx,
            release: release_rx,
            release_coming: ReleaseComing(release_coming_rx),
            dead_by: dead_by_tx,
        });
        WatchedLock {
            lost,
            dead_by,
            release: Some(release),
            release_coming,
            watcher: tokio::spawn(task.in_current_span()),
        }
    }

    /// Says a release will follow once the app's tree is gone. Never blocks.
    pub fn release_coming(&self) {
        self.release_coming.send_replace(true);
    }

    /// The latest moment by which the app must be dead, as the watcher keeps moving it.
    pub fn app_deadline(&self) -> watch::Receiver<Deadline> {
        self.dead_by.clone()
    }

    /// The loss the watcher has reported, if any, without waiting.
    pub fn reported_loss(&self) -> Option<LockLoss> {
        self.lost.borrow().clone()
    }

    /// Resolves once the watcher reports the lock lost. Cancel-safe.
    pub async fn lost(&mut self) -> LockLoss {
        match self.lost.wait_for(Option::is_some).await {
            Ok(loss) => loss.clone().expect("waited for Some"),
            // The watcher only ends without a loss after a release, when nobody waits for loss.
            Err(_) => std::future::pending().await,
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
