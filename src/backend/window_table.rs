//! The scheduled jobs' table of claimed windows on the SQL backends (MySQL, PostgreSQL), written
//! once over a dialect. A backend gives its few words of its own (column types, time functions,
//! the proof that its lock's session still holds the lock) and runs statements on a session of its
//! own; the claim's steps, the table's life and what its errors mean are here.
//!
//! Statements carry their values as literals: lock names, holder ids and host names are restricted
//! to characters that need no quoting, and the rest are numbers.

use std::time::Duration;

use async_trait::async_trait;
use tracing::{info, warn};

use super::{ClaimAnswer, ClaimRequest, LockError, WindowStore};
use crate::config::Timings;
use crate::window::{Claim, RunEnd, RunExit, UnixMicros};

const TABLE: &str = "sentinel_guard_windows";

/// Rows kept per lock name: enough to outlast every window, few enough to stay small.
const KEPT: u32 = 100;

/// Text rows, as the servers' simple query protocols give them.
pub(super) type Rows = Vec<Vec<Option<String>>>;

/// Why a statement on the table failed.
pub(super) enum TableError {
    /// The table does not exist (yet).
    Missing,
    /// The server refused the statement (a missing grant, a read-only server): it will not mend
    /// by itself, and stops a scheduler. The server's words, without credentials.
    Refused(String),
    /// No answer, or the session ended: the backend is unreachable, which a job's
    /// `--if-unavailable` policy handles.
    Failed(LockError),
}

impl TableError {
    fn into_lock_error(self) -> LockError {
        match self {
            TableError::Missing => LockError::Refused(format!(
                "the table {TABLE} does not exist (dropped while in use?)"
            )),
            TableError::Refused(why) => LockError::Refused(why),
            TableError::Failed(e) => e,
        }
    }
}

/// A SQL server's side of the windows table.
#[async_trait]
pub(super) trait WindowDialect: Send + Sync {
    type Session: Send;

    /// The table, in the server's types.
    const CREATE: &'static str;
    /// The server's clock, as a timestamp.
    const NOW: &'static str;
    /// True only on a server that is still a writable primary: every write to the table carries
    /// it, so that none lands on a demoted server (a replica's own write would break its next
    /// failover).
    const WRITABLE: &'static str;

    /// A timestamp from whole seconds since the epoch.
    fn timestamp(unix_secs: i64) -> String;
    /// Microseconds since the epoch of a timestamp, as an integer.
    fn micros(timestamp: &str) -> String;

    /// The insert of `request`'s claim, which changes one row only while `session_id` (the
    /// lock's own session) still holds the lock for this guard and while the server's clock is
    /// inside the window; the primary key refuses a second claim.
    fn claim_sql(&self, request: &ClaimRequest<'_>, session_id: i64) -> String;

    /// What the guard's user must be granted on the table, as an administrator would run it.
    fn grant(&self) -> String;

    async fn open(&self, connect: Duration, answer: Duration) -> Result<Self::Session, LockError>;

    /// Runs `sql` (`what` names it in errors) within `limit`: its rows, and how many rows it
    /// changed.
    async fn run(
        &self,
        session: &mut Self::Session,
        what: &str,
        sql: &str,
        limit: Duration,
    ) -> Result<(Rows, u64), TableError>;

    async fn close(&self, session: Self::Session, limit: Duration);
}

/// The windows of a lock held on a SQL server, claimed on a session of their own (the lock's
/// session is busy with its ownership check); `session_id` is the lock's session as the server
/// numbers it, which every claim proves still holds the lock.
pub(super) struct SqlWindows<D> {
    pub dialect: D,
    pub session_id: i64,
}

#[async_trait]
impl<D: WindowDialect> WindowStore for SqlWindows<D> {
    async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        let (dialect, limit) = (&self.dialect, request.timings.check_timeout);
        let mut session = dialect.open(request.timings.connect_timeout, limit).await?;
        let answer = claim_on(dialect, &mut session, request, self.session_id).await;
        dialect.close(session, limit).await;
        answer
    }

    async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError> {
        let (dialect, limit) = (&self.dialect, request.timings.check_timeout);
        let mut session = dialect.open(request.timings.connect_timeout, limit).await?;
        let update = format!(
            "UPDATE {TABLE} SET finished_at = {now}, exit_code = {code} \
             WHERE name = '{name}' AND window_start = {start} AND holder = '{holder}' AND {writable}",
            now = D::NOW,
            writable = D::WRITABLE,
            code = exit.stored(),
            name = request.name.as_str(),
            start = D::timestamp(request.window.start / 1_000_000),
            holder = request.holder.id,
        );
        let done = dialect
            .run(
                &mut session,
                "UPDATE sentinel_guard_windows",
                &update,
                limit,
            )
            .await;
        dialect.close(session, limit).await;
        done.map(drop).map_err(TableError::into_lock_error)
    }
}

async fn claim_on<D: WindowDialect>(
    dialect: &D,
    session: &mut D::Session,
    request: &ClaimRequest<'_>,
    session_id: i64,
) -> Result<ClaimAnswer, LockError> {
    let limit = request.timings.check_timeout;
    let (name, window) = (request.name.as_str(), request.window);
    // Only the lock's holder writes claims, so what is read here stays true until the insert,
    // which proves the lock again.
    let last = read_last(dialect, session, name, limit).await?;
    if let Some(blocked) = ClaimAnswer::blocked_by(last.as_ref(), window) {
        return Ok(blocked);
    }
    // This window's own claim, whose command never started: it holds nothing, and its row goes
    // for the new one (no proof needed to remove what blocks nothing).
    if last
        .as_ref()
        .is_some_and(|last| last.window_start == window.start)
    {
        let delete = format!(
            "DELETE FROM {TABLE} WHERE name = '{name}' AND window_start = {} AND exit_code < 0 \
             AND {}",
            D::timestamp(window.start / 1_000_000),
            D::WRITABLE
        );
        dialect
            .run(
                session,
                "DELETE FROM sentinel_guard_windows",
                &delete,
                limit,
            )
            .await
            .map_err(TableError::into_lock_error)?;
    }
    let insert = dialect.claim_sql(request, session_id);
    let changed = match dialect
        .run(
            session,
            "INSERT INTO sentinel_guard_windows",
            &insert,
            limit,
        )
        .await
    {
        Err(TableError::Missing) => {
            create_table(dialect, session, limit).await?;
            dialect
                .run(
                    session,
                    "INSERT INTO sentinel_guard_windows",
                    &insert,
                    limit,
                )
                .await
        }
        other => other,
    }
    .map_err(TableError::into_lock_error)?
    .1;
    if changed != 1 {
        return Ok(ClaimAnswer::NotNow(
            "the lock's session no longer holds the lock, or the server's clock is outside the window",
        ));
    }
    prune(dialect, session, name, limit).await;
    Ok(ClaimAnswer::Ours)
}

/// Creates the table, or says exactly what an administrator must run once.
async fn create_table<D: WindowDialect>(
    dialect: &D,
    session: &mut D::Session,
    limit: Duration,
) -> Result<(), LockError> {
    match dialect.run(session, "CREATE TABLE sentinel_guard_windows", D::CREATE, limit).await {
        Ok(_) => {
            info!(
                event = "windows_table_created",
                "created table sentinel_guard_windows for scheduled runs"
            );
            Ok(())
        }
        Err(TableError::Refused(why)) => Err(LockError::Refused(format!(
            "{why}; cannot create the table of scheduled windows. Run this once as an administrator \
             in the URL's database: {}; and grant the guard's user: {}",
            D::CREATE,
            dialect.grant()
        ))),
        Err(e) => Err(e.into_lock_error()),
    }
}

/// Keeps the newest rows of `name`; a failure only leaves more rows behind, so it is logged, not
/// fatal. The newest rows are read through a derived table: MySQL refuses a subquery on the table
/// a DELETE changes.
async fn prune<D: WindowDialect>(
    dialect: &D,
    session: &mut D::Session,
    name: &str,
    limit: Duration,
) {
    let delete = format!(
        "DELETE FROM {TABLE} WHERE name = '{name}' AND window_start < \
         (SELECT window_start FROM (SELECT window_start FROM {TABLE} WHERE name = '{name}' \
         ORDER BY window_start DESC LIMIT 1 OFFSET {}) AS kept) AND {}",
        KEPT - 1,
        D::WRITABLE
    );
    if let Err(e) = dialect
        .run(
            session,
            "DELETE FROM sentinel_guard_windows",
            &delete,
            limit,
        )
        .await
    {
        warn!(
            event = "windows_prune_failed",
            error = %e.into_lock_error(),
            "cannot delete old rows of sentinel_guard_windows"
        );
    }
}

/// The newest claimed window of `name`; `None` without the table (nothing was ever scheduled).
async fn read_last<D: WindowDialect>(
    dialect: &D,
    session: &mut D::Session,
    name: &str,
    limit: Duration,
) -> Result<Option<Claim>, LockError> {
    let select = format!(
        "SELECT {}, holder, host, {}, {}, exit_code FROM {TABLE} \
         WHERE name = '{name}' ORDER BY window_start DESC LIMIT 1",
        D::micros("window_start"),
        D::micros("claimed_at"),
        D::micros("finished_at"),
    );
    let rows = match dialect
        .run(
            session,
            "SELECT FROM sentinel_guard_windows",
            &select,
            limit,
        )
        .await
    {
        Err(TableError::Missing) => return Ok(None),
        ran => ran.map_err(TableError::into_lock_error)?.0,
    };
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let text = |column: usize| row.get(column).cloned().flatten().unwrap_or_default();
    Ok(Some(Claim {
        window_start: number(row, 0).unwrap_or_default(),
        holder_id: text(1),
        host: text(2),
        claimed_at: number(row, 3).unwrap_or_default(),
        end: match (number(row, 4), number(row, 5)) {
            (Some(finished_at), Some(code)) => Some(RunEnd::from_stored(code, finished_at)),
            _ => None,
        },
    }))
}

fn number(row: &[Option<String>], column: usize) -> Option<i64> {
    row.get(column)?.as_deref()?.parse().ok()
}

/// The newest claimed window of `name`, for `status` and the scheduler.
pub(super) async fn last_claim<D: WindowDialect>(
    dialect: &D,
    name: &str,
    connect: Duration,
    answer: Duration,
) -> Result<Option<Claim>, LockError> {
    let mut session = dialect.open(connect, answer).await?;
    let last = read_last(dialect, &mut session, name, answer).await;
    dialect.close(session, answer).await;
    last
}

/// The server's clock, in microseconds since the epoch: what windows are counted on.
pub(super) async fn server_clock<D: WindowDialect>(
    dialect: &D,
    timings: &Timings,
) -> Result<UnixMicros, LockError> {
    let limit = timings.check_timeout;
    let mut session = dialect.open(timings.connect_timeout, limit).await?;
    let select = format!("SELECT {}", D::micros(D::NOW));
    let now = dialect
        .run(&mut session, "the server's clock", &select, limit)
        .await;
    dialect.close(session, limit).await;
    let (rows, _) = now.map_err(TableError::into_lock_error)?;
    rows.first()
        .and_then(|row| number(row, 0))
        .ok_or_else(|| LockError::Unsafe("the server returned no time".to_owned()))
}
