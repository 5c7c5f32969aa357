//! What passes between the supervisor and the lock layer, which know nothing else of each other:
//! the proof that the app's tree is gone, which giving a lock back requires, and what the watchdog
//! does for a lock once the guard is dead. A leaf module: it imports nothing of the crate.

use std::os::fd::BorrowedFd;

/// Proof that nothing of the app is alive any more: only a finished teardown makes one
/// (`supervisor::teardown`), and giving a lock back consumes one, so the lock cannot be released
/// while any process of the app lives, nor twice.
#[must_use]
pub struct TreeGone(());

impl TreeGone {
    /// For the supervisor's teardown alone, once it has seen the whole tree gone.
    pub(crate) fn seen_by_teardown() -> TreeGone {
        TreeGone(())
    }
}

impl std::fmt::Debug for TreeGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TreeGone")
    }
}

/// What the watchdog does for the lock once the guard is dead and the app's group gone.
pub struct Farewell<'a> {
    /// An opaque message for the backend's farewell (may carry credentials: it travels only through
    /// the pipe, never the environment or the command line). Empty: nothing to say.
    pub message: Vec<u8>,
    /// A descriptor of the locked file, kept open by the watchdog so the lock outlives a killed guard
    /// until the app's group is gone.
    pub keep: Option<BorrowedFd<'a>>,
}

impl Farewell<'_> {
    pub fn none() -> Farewell<'static> {
        Farewell {
            message: Vec::new(),
            keep: None,
        }
    }
}
