//! The lock record: what a holder writes beside its lock while it holds it, so the next holder can
//! tell a lock freed after the old app's death (released, the tree gone, a lease that ran out) from
//! one taken away while that app may still be stopping. A leaf module: the words every backend and
//! the guard share.

use std::time::Duration;

/// The state a lock record is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Written by the holder when it took the lock, before its app starts.
    Held,
    /// Written by the holder after its app's tree is gone, before it frees the lock.
    Released,
    /// Written by the watchdog of a guard that died holding the lock, once the app's tree is gone
    /// and before the lock is freed.
    TreeGone,
}

impl RecordState {
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::Held => "held",
            RecordState::Released => "released",
            RecordState::TreeGone => "tree_gone",
        }
    }

    pub fn parse(raw: &str) -> Option<RecordState> {
        [
            RecordState::Held,
            RecordState::Released,
            RecordState::TreeGone,
        ]
        .into_iter()
        .find(|state| state.as_str() == raw)
    }
}

/// What a new holder knows of the one before it, from the record it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Previous {
    /// Nothing of the previous holder's app can be running: the record says so, or there was none
    /// before (why, for the log).
    Gone(&'static str),
    /// The previous holder's lease ran out on the server's clock, after its guard's deadline: its
    /// app was stopped by then, unless its whole tree was frozen (then it dies within milliseconds
    /// of the thaw). `auto` starts at once; a fixed delay is still waited.
    Expired,
    /// The lock may have been taken away from a holder whose app is still stopping: it is dead at
    /// most `bound` after the lock was freed, so at most `bound` after this acquisition (why, for
    /// the log).
    MayRun { bound: Duration, why: &'static str },
}

impl Previous {
    /// Why, in one word, for the log.
    pub fn reason(self) -> &'static str {
        match self {
            Previous::Gone(why) | Previous::MayRun { why, .. } => why,
            Previous::Expired => "expired",
        }
    }

    /// What a record in `state` says, with `bound` the previous holder's recorded "app dead by"
    /// bound. A held record means the holder never said its tree was gone.
    pub fn from_record(state: RecordState, bound: Duration) -> Previous {
        match state {
            RecordState::Released => Previous::Gone("released"),
            RecordState::TreeGone => Previous::Gone("tree_gone"),
            RecordState::Held => Previous::MayRun {
                bound,
                why: "taken_away",
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_and_only_a_held_record_makes_a_new_holder_wait() {
        for state in [
            RecordState::Held,
            RecordState::Released,
            RecordState::TreeGone,
        ] {
            assert_eq!(RecordState::parse(state.as_str()), Some(state));
        }
        assert_eq!(RecordState::parse("free"), None);
        let bound = Duration::from_secs(12);
        assert_eq!(
            Previous::from_record(RecordState::Held, bound),
            Previous::MayRun {
                bound,
                why: "taken_away"
            }
        );
        assert!(matches!(
            Previous::from_record(RecordState::Released, bound),
            Previous::Gone(_)
        ));
        assert!(matches!(
            Previous::from_record(RecordState::TreeGone, bound),
            Previous::Gone(_)
        ));
    }
}
