//! A lock that no server holds, for the guard's unit tests: its watcher is a task like every
//! backend's (`WatchedLock`), fed by a channel instead of a server's answers. The test says when the
//! lock is lost, and learns whether and when the guard gave it back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    lose: mpsc::UnboundedSender<LockLoss>,
    given_back: Arc<AtomicBool>,
}

impl Control {
    /// The backend takes the lock away, as a `KILL` of its session would.
    pub fn take_away(&self) {
        let _ = self.lose.send(LockLoss {
            reason: LossReason::NotOwner,
            detail: "taken away by the test".to_owned(),
        });
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
/// `dead_by` unless the watcher moves that on.
pub fn acquired(previous: Previous, dead_by: Deadline) -> (HeldLock, Control) {
    let (lose, mut losses) = mpsc::unbounded_channel();
    let given_back = Arc::new(AtomicBool::new(false));
    let gave = given_back.clone();
    let watched = WatchedLock::spawn(dead_by, |mut ends| async move {
        tokio::select! {
            Some(loss) = losses.recv() => {
                ends.report(loss);
                // A lost lock is not ours to give back; the guard may still ask.
                let _ = (&mut ends.release).await;
            }
            _ = &mut ends.release => gave.store(true, Ordering::SeqCst),
        }
        Ok(())
    });
    let lock = HeldLock::new(FakeLock { watched, previous });
    (lock, Control { lose, given_back })
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
