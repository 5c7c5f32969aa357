//! A lock that no server holds, for the guard's unit tests: its watcher is a task like every
//! backend's (`WatchedLock`), fed by a channel instead of a server's answers. The test says when the
//! lock is lost, and learns whether and when the guard gave it back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};

use super::watched::WatchedLock;
use super::{ClaimAnswer, ClaimRequest, Held, HeldLock, LockError, LockLoss, WindowStore};
use crate::deadline::Deadline;
use crate::handoff::Farewell;
use crate::record::Previous;
use crate::vocab::LossReason;
use crate::window::RunExit;

/// The test's end of a fake lock.
pub struct Control {
    watcher: mpsc::UnboundedSender<Said>,
    given_back: Arc<AtomicBool>,
    at_release: AtRelease,
}

/// What the test runs as the lock is given back, before it is.
type AtRelease = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// What the test makes the fake's watcher say.
enum Said {
    Lost(LockLoss),
    AppDeadline(Deadline),
}

impl Control {
    /// The backend takes the lock away, as a `KILL` of its session would.
    pub fn take_away(&self) {
        let _ = self.watcher.send(Said::Lost(LockLoss {
            reason: LossReason::NotOwner,
            detail: "taken away by the test".to_owned(),
        }));
    }

    /// The watcher moves the app's deadline to `at`, as a proof of ownership (or its absence) would.
    pub fn move_app_deadline(&self, at: Deadline) {
        let _ = self.watcher.send(Said::AppDeadline(at));
    }

    /// Runs `check` as the guard gives the lock back, before it is given back.
    pub fn on_release(&self, check: impl FnOnce() + Send + 'static) {
        *self.at_release.lock().unwrap() = Some(Box::new(check));
    }

    /// Whether the guard gave the lock back.
    pub fn given_back(&self) -> bool {
        self.given_back.load(Ordering::SeqCst)
    }
}

const NO_WINDOWS: &str = "the fake lock keeps no windows";

struct FakeLock {
    watched: WatchedLock,
    previous: Previous,
}

/// A lock just acquired, whose record says `previous` of the holder before; its app must be dead by
/// `app_deadline` unless the watcher moves that on.
pub fn acquired(previous: Previous, app_deadline: Deadline) -> (HeldLock, Control) {
    let (watcher, mut said) = mpsc::unbounded_channel();
    let given_back = Arc::new(AtomicBool::new(false));
    let gave = given_back.clone();
    let at_release: AtRelease = Arc::default();
    let before_release = Arc::clone(&at_release);
    let give_back = move || {
        if let Some(check) = before_release.lock().unwrap().take() {
            check();
        }
        gave.store(true, Ordering::SeqCst);
    };
    let watched = WatchedLock::spawn(app_deadline, |mut ends| async move {
        loop {
            tokio::select! {
                Some(what) = said.recv() => match what {
                    Said::AppDeadline(at) => ends.move_app_deadline(at),
                    Said::Lost(loss) => {
                        ends.report(loss);
                        // A lost lock is not ours to give back: a guard that asks is seen to (a
                        // lock dropped unasked ends the wait with an error).
                        if (&mut ends.release).await.is_ok() {
                            give_back();
                        }
                        return Ok(());
                    }
                },
                _ = &mut ends.release => {
                    give_back();
                    return Ok(());
                }
            }
        }
    });
    let lock = HeldLock::new(FakeLock { watched, previous });
    (
        lock,
        Control {
            watcher,
            given_back,
            at_release,
        },
    )
}

#[async_trait]
impl Held for FakeLock {
    fn previous(&self) -> Previous {
        self.previous
    }

    fn fencing_token(&self) -> Option<String> {
        Some("1".to_owned())
    }

    fn released_cleanly(&self) -> bool {
        false
    }

    fn app_deadline(&self) -> Option<watch::Receiver<Deadline>> {
        Some(self.watched.app_deadline())
    }

    fn farewell(&self) -> Farewell<'_> {
        Farewell::none()
    }

    fn loss_reports(&self) -> Option<watch::Receiver<Option<LockLoss>>> {
        Some(self.watched.loss_reports())
    }

    async fn lost(&mut self) -> LockLoss {
        self.watched.lost().await
    }

    fn release_coming(&self) {}

    async fn give_back(self: Box<Self>) -> Result<(), LockError> {
        self.watched.release().await
    }
}

#[async_trait]
impl WindowStore for FakeLock {
    async fn claim(&mut self, _request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        Err(LockError::Unreachable(NO_WINDOWS.to_owned()))
    }

    async fn record_end(
        &mut self,
        _request: &ClaimRequest<'_>,
        _exit: RunExit,
    ) -> Result<(), LockError> {
        Err(LockError::Unreachable(NO_WINDOWS.to_owned()))
    }
}
