//! The lock record of the SQL backends (MySQL, PostgreSQL): one row per lock name in the table
//! `sentinel_guard_locks` of the URL's database, written by the holder on its lock's own session, and
//! by the watchdog of a guard that died holding it.
//!
//! A row proves something only on the server that wrote it: a failover to a replica that missed the
//! newest writes, or a restart that lost them, can show an older holder's `released` row while the
//! last holder's app still stops. Each row therefore carries the writing server's incarnation (an
//! expression of the dialect's own), and a row from another is no proof.

use std::time::Duration;

use super::LockRequest;
use crate::record::{set_back_error, Fence, Previous, RecordFacts, RecordState};

pub const TABLE: &str = "sentinel_guard_locks";

/// The previous holder's row (its state, bound, token, the clock it was drawn at and the server
/// that wrote it), and the server now (`incarnation`, the dialect's expression for it): one row,
/// with the row's columns empty when there is none.
pub fn read_sql(name: &str, incarnation: &str) -> String {
    format!(
        "SELECT state, bound_ms, fence, drawn_us, incarnation, {incarnation} \
         FROM (SELECT 1) AS one LEFT JOIN {TABLE} ON name = '{name}'"
    )
}

/// The row as `status` shows it.
pub fn facts_sql(name: &str) -> String {
    format!("SELECT state, fence FROM {TABLE} WHERE name = '{name}'")
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

/// What the release runs to mark this holder's row released, where acquisition wrote one.
pub fn released_sql(request: &LockRequest<'_>, recorded: bool) -> Option<String> {
    recorded.then(|| {
        mark_sql(
            request.name.as_str(),
            &request.holder.id,
            RecordState::Released,
        )
    })
}

/// A row as `read_sql` returns it.
pub struct Row {
    pub state: String,
    pub bound_ms: u64,
    pub fence: Fence,
    pub same_server: bool,
}

/// What the row found says of the previous holder: no row, or one this program cannot read, is no
/// record, and the previous holder's app may run for up to `own_bound`. `Err` with why, and what
/// to do, when the row of lock `name` was not written by a holder (`Fence::set_back`).
pub fn previous(name: &str, found: Option<&Row>, own_bound: Duration) -> Result<Previous, String> {
    let Some(row) = found else {
        return Ok(no_record(own_bound));
    };
    if row.fence.set_back() {
        return Err(set_back_error(
            name,
            &row.fence.set_back_detail(),
            &set_back_remedy(name),
        ));
    }
    let bound = Duration::from_millis(row.bound_ms);
    Ok(match RecordState::parse(&row.state) {
        None => no_record(own_bound),
        Some(_) if !row.same_server => Previous::other_server(bound, own_bound),
        Some(state) => Previous::from_record(state, bound),
    })
}

pub fn no_record(own_bound: Duration) -> Previous {
    Previous::MayRun {
        bound: own_bound,
        why: "no_record",
    }
}

/// `facts_sql`'s answer, for `status`; a state this program does not know is no record.
pub fn facts(state: &str, token: u64) -> Option<RecordFacts> {
    Some(RecordFacts {
        state: RecordState::parse(state)?,
        token,
    })
}

/// What to do about a set-back counter, for the error.
fn set_back_remedy(name: &str) -> String {
    format!(
        "If the counter was reset on purpose, delete the record (DELETE FROM {TABLE} WHERE name = \
         '{name}') while no guard holds the lock: the next holder starts a new one above the clock"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(state: &str, fence: u64, same_server: bool) -> Row {
        Row {
            state: state.to_string(),
            bound_ms: 3000,
            fence: Fence {
                token: fence,
                drawn_us: 100,
            },
            same_server,
        }
    }

    #[test]
    fn a_row_of_this_server_says_what_its_state_says_and_anything_else_proves_nothing() {
        let own = Duration::from_secs(12);
        assert_eq!(
            previous("n", Some(&row("released", 100, true)), own),
            Ok(Previous::Gone("released"))
        );
        assert_eq!(
            previous("n", Some(&row("held", 100, true)), own),
            Ok(Previous::MayRun {
                bound: Duration::from_secs(3),
                why: "taken_away"
            })
        );
        // Replicated from, or left by, another incarnation of the server.
        assert_eq!(
            previous("n", Some(&row("released", 100, false)), own),
            Ok(Previous::MayRun {
                bound: own,
                why: "other_server"
            })
        );
        assert_eq!(
            previous("n", Some(&row("odd", 100, true)), own),
            Ok(no_record(own))
        );
        assert_eq!(previous("n", None, own), Ok(no_record(own)));
        assert!(previous("n", Some(&row("released", 5, true)), own).is_err());
        assert!(mark_sql("n", "h", RecordState::TreeGone).contains("state = 'tree_gone'"));
    }
}
