//! The lock record of the SQL backends (MySQL, PostgreSQL): one row per lock name in the table
//! `sentinel_guard_locks` of the URL's database, written by the holder on its lock's own session, and
//! by the watchdog of a guard that died holding it.

use std::time::Duration;

use crate::record::{Previous, RecordState};

pub const TABLE: &str = "sentinel_guard_locks";

/// The previous holder's row: its state and bound.
pub fn read_sql(name: &str) -> String {
    format!("SELECT state, bound_ms FROM {TABLE} WHERE name = '{name}'")
}

/// Moves this holder's row, and only while it is still held by it, to `state`. Names and holder ids
/// need no quoting (validated characters, hex).
pub fn mark_sql(name: &str, holder_id: &str, state: RecordState) -> String {
    format!(
        "UPDATE {TABLE} SET state = '{}', updated_at = CURRENT_TIMESTAMP(6) \
         WHERE name = '{name}' AND holder = '{holder_id}' AND state = 'held'",
        state.as_str()
    )
}

/// What the row found says of the previous holder; no row, or one this program cannot read, is no
/// record: the previous holder's app may run for up to `own_bound`.
pub fn previous(found: Option<(&str, u64)>, own_bound: Duration) -> Previous {
    match found.and_then(|(state, bound)| Some((RecordState::parse(state)?, bound))) {
        Some((state, bound)) => Previous::from_record(state, Duration::from_millis(bound)),
        None => no_record(own_bound),
    }
}

pub fn no_record(own_bound: Duration) -> Previous {
    Previous::MayRun {
        bound: own_bound,
        why: "no_record",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_says_what_its_state_says_and_anything_else_is_no_record() {
        let own = Duration::from_secs(12);
        assert_eq!(
            previous(Some(("released", 5)), own),
            Previous::Gone("released")
        );
        assert_eq!(
            previous(Some(("held", 3000)), own),
            Previous::MayRun {
                bound: Duration::from_secs(3),
                why: "taken_away"
            }
        );
        assert_eq!(previous(Some(("odd", 1)), own), no_record(own));
        assert_eq!(previous(None, own), no_record(own));
        assert!(mark_sql("n", "h", RecordState::TreeGone).contains("state = 'tree_gone'"));
    }
}
