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

/// A fencing token as a record keeps it: the token, and the backend's clock (microseconds since the
/// epoch) when it was drawn. Every backend draws `max(previous token + 1, clock)`, so a token is
/// never below the clock it was drawn at, and a counter that lost its rows, its file or its keys
/// resumes above every token it gave out (unless the backend's clock went back meanwhile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    pub token: u64,
    pub drawn_us: u64,
}

impl Fence {
    /// The token that follows `previous`, drawn at `now_us`.
    pub fn next(previous: Option<Fence>, now_us: u64) -> Fence {
        Fence {
            token: previous
                .map_or(0, |p| p.token.saturating_add(1))
                .max(now_us),
            drawn_us: now_us,
        }
    }

    /// A record whose token is below the clock it says it was drawn at was not written by a
    /// holder: the counter was set back (by hand, a restore, a copied file). Its state proves
    /// nothing, and tokens drawn from it could repeat, so no holder starts on it.
    pub fn set_back(self) -> bool {
        self.token < self.drawn_us
    }

    /// What is wrong with a set-back record, for `set_back_error`.
    pub fn set_back_detail(self) -> String {
        format!(
            "its record holds token {} but says it was drawn when the clock read {} µs",
            self.token, self.drawn_us
        )
    }
}

/// Why no app is started on a record whose counter was set back: for `LockError::Unsafe`.
pub fn set_back_error(lock: &str, detail: &str, remedy: &str) -> String {
    format!(
        "the fencing counter of lock {lock} was set back: {detail}, so the record was not written \
         by a holder (edited, restored from a backup or copied); tokens drawn from it could repeat \
         and its state proves nothing, so the app is not started. {remedy}"
    )
}

/// What `status` shows of a lock's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordFacts {
    pub state: RecordState,
    pub token: u64,
}

impl RecordFacts {
    pub fn facts(self) -> Vec<(&'static str, String)> {
        vec![
            ("record_state", self.state.as_str().to_string()),
            ("fencing_token", self.token.to_string()),
        ]
    }
}

/// What a new holder knows of the one before it, from the record it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Previous {
    /// Nothing of the previous holder's app can be running: the record says so, or there was none
    /// before (why, for the log).
    Gone(&'static str),
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
        }
    }

    /// A record from another server than the one that granted this lock (a failover, a replica
    /// promoted, a restarted server), which may have lost newer writes: it proves nothing, and the
    /// previous holder's app may run for the larger of its recorded bound and ours.
    pub fn other_server(recorded: Duration, own_bound: Duration) -> Previous {
        Previous::MayRun {
            bound: recorded.max(own_bound),
            why: "other_server",
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

    #[test]
    fn tokens_grow_past_the_counter_and_the_clock_and_a_token_below_its_clock_is_set_back() {
        let first = Fence::next(None, 1_000);
        assert_eq!(first.token, 1_000);
        assert!(!first.set_back());
        // Drawn within the same microsecond as the last one: the counter decides.
        assert_eq!(Fence::next(Some(first), 1_000).token, 1_001);
        // The clock ahead of the counter (a lost row, a long pause): the clock decides.
        assert_eq!(Fence::next(Some(first), 5_000).token, 5_000);
        // Behind the clock that drew it: edited by hand.
        assert!(Fence {
            token: 5,
            drawn_us: 1_000
        }
        .set_back());
        let set_back = Fence {
            token: 5,
            drawn_us: 9,
        };
        let message = set_back_error("billing", &set_back.set_back_detail(), "delete it");
        assert!(message.contains("lock billing") && message.contains("token 5"));
    }
}
