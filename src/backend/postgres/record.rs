//! PostgreSQL's lock record (`record_table.rs`): read and written on the lock's own session right
//! after the grant, with the fencing token.

use super::*;

/// The table of lock records (see `record_table`), created on first use in the URL's database (its
/// default schema).
const LOCKS_TABLE: &str = "CREATE TABLE IF NOT EXISTS sentinel_guard_locks (\
name varchar(64) PRIMARY KEY, \
fence bigint NOT NULL, \
drawn_us bigint NOT NULL, \
holder varchar(64) NOT NULL, \
state varchar(16) NOT NULL, \
bound_ms bigint NOT NULL, \
incarnation text NOT NULL, \
updated_at timestamptz NOT NULL)";

/// The server that writes a row: its postmaster's start, to the microsecond, as a number (text
/// would follow the session's TimeZone and DateStyle). A promoted replica, a restarted server and a
/// restored one all started at another time. A crash of one backend reinitialises the server
/// without a new postmaster, and loses commits made with `synchronous_commit = off`: the `held`
/// record is written with `local` at least (a stronger setting is kept). The `released` one is not
/// waited for (`watcher.rs`): losing it only makes the next holder wait.
const INCARNATION: &str = "extract(epoch FROM pg_postmaster_start_time())::text";

/// Reads the lock record the previous holder left and writes this holder's, with the next fencing
/// token (`Fence::next` of the previous one and the clock `now_us` the proof read), in one statement
/// on the lock's own session right after the grant (before the app can start); returns the token
/// and whether this holder's record was written. Where the table cannot be seen (no grant, no
/// CREATE on first use), every acquisition waits its own bound, which a warning says once, with
/// what to grant, and the token is the clock. A table that can be read but not written would leave
/// an older holder's row to mislead the next one: that is refused.
pub(super) async fn take_record(
    session: &Session,
    target: &PostgresTarget,
    request: &LockRequest<'_>,
    now_us: u64,
) -> Result<(Previous, u64, bool), LockError> {
    let (name, holder) = (request.name.as_str(), &request.holder.id);
    let timings = request.timings;
    let own_bound = timings.worst_answer_to_deadline();
    let limit = timings.check_timeout;
    // The CTE's SELECT sees the row as it was before the upsert; a set-back row is left as it is.
    let sql = format!(
        "SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') \
         WHEN 'off' THEN 'local' ELSE current_setting('synchronous_commit') END, false); \
         WITH prev AS ({read}), up AS (INSERT INTO sentinel_guard_locks \
         (name, fence, drawn_us, holder, state, bound_ms, incarnation, updated_at) \
         SELECT '{name}', GREATEST(COALESCE((SELECT fence FROM prev) + 1, 0), {now_us}), {now_us}, \
         '{holder}', 'held', {bound}, {INCARNATION}, now() \
         WHERE NOT EXISTS (SELECT 1 FROM prev WHERE fence < drawn_us) \
         ON CONFLICT (name) DO UPDATE SET fence = EXCLUDED.fence, drawn_us = EXCLUDED.drawn_us, \
         holder = EXCLUDED.holder, state = 'held', bound_ms = EXCLUDED.bound_ms, \
         incarnation = EXCLUDED.incarnation, updated_at = EXCLUDED.updated_at RETURNING fence) \
         SELECT prev.*, (SELECT fence FROM up) FROM prev",
        read = record_table::read_sql(name, INCARNATION),
        bound = own_bound.as_millis(),
    );
    let mut created = false;
    loop {
        let failure = match query(&session.client, &sql, limit).await {
            Ok(rows) => return taken(&rows, name, own_bound),
            Err(failure) => failure,
        };
        match failure {
            Failure::Db(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) && !created => {
                created = true;
                match query(&session.client, LOCKS_TABLE, limit).await {
                    Ok(_) => info!(
                        event = "lock_table_created",
                        "created table sentinel_guard_locks for lock records"
                    ),
                    Err(Failure::Db(e)) if e.as_db_error().is_some() => {
                        record_unavailable(target, e);
                        return Ok((record_table::no_record(own_bound), now_us, false));
                    }
                    Err(failure) => {
                        return Err(target.failed(
                            "CREATE TABLE sentinel_guard_locks",
                            failure,
                            limit,
                        ))
                    }
                }
            }
            // Denied: if the table can still be read, an older holder's row would mislead the
            // next holder.
            Failure::Db(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
                let probe = format!("SELECT 1 FROM {} LIMIT 0", record_table::TABLE);
                if query(&session.client, &probe, limit).await.is_ok() {
                    let user = target.config.get_user().unwrap_or("<user>");
                    return Err(LockError::Unsafe(format!(
                        "{}: the lock records in sentinel_guard_locks can be read but not written ({}), \
                         so an older holder's record would mislead the next holder; \
                         GRANT INSERT, UPDATE ON sentinel_guard_locks TO {user}, or revoke SELECT",
                        target.url,
                        target.explain(e)
                    )));
                }
                record_unavailable(target, e);
                return Ok((record_table::no_record(own_bound), now_us, false));
            }
            // No table to be seen in the search path's schemas, or one of an older layout.
            Failure::Db(e)
                if [
                    SqlState::UNDEFINED_TABLE,
                    SqlState::UNDEFINED_COLUMN,
                    SqlState::INVALID_SCHEMA_NAME,
                ]
                .iter()
                .any(|code| e.code() == Some(code)) =>
            {
                record_unavailable(target, e);
                return Ok((record_table::no_record(own_bound), now_us, false));
            }
            failure => return Err(target.failed("the lock record", failure, limit)),
        }
    }
}

/// The previous holder's record and the new fencing token, from the answer of `take_record`'s
/// statement.
fn taken(rows: &Rows, name: &str, own_bound: Duration) -> Result<(Previous, u64, bool), LockError> {
    // The upsert's row follows set_config's.
    let row = rows.last().map(Vec::as_slice).unwrap_or_default();
    let found = row
        .first()
        .cloned()
        .flatten()
        .map(|state| record_table::Row {
            state,
            bound_ms: number(row, 1).unwrap_or(0),
            fence: Fence {
                token: number(row, 2).unwrap_or(0),
                drawn_us: number(row, 3).unwrap_or(0),
            },
            same_server: row.get(4).cloned().flatten().is_some_and(|written| {
                row.get(5).and_then(Option::as_deref) == Some(written.as_str())
            }),
        });
    let previous =
        record_table::previous(name, found.as_ref(), own_bound).map_err(LockError::Unsafe)?;
    let token = number(row, 6).ok_or_else(|| {
        LockError::Unsafe(format!(
            "the lock record's upsert returned {:?}",
            row.get(6)
        ))
    })?;
    Ok((previous, token, true))
}

/// Says once why no lock record can be kept, and what an administrator grants to make clean
/// hand-overs instant again.
fn record_unavailable(target: &PostgresTarget, e: tokio_postgres::Error) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        let user = target.config.get_user().unwrap_or("<user>");
        warn!(
            event = "lock_record_unavailable",
            error = %target.explain(e),
            "no lock record can be kept, so every acquisition waits the takeover bound before starting the app; \
             run once as an administrator in the URL's database: {LOCKS_TABLE}; \
             GRANT SELECT, INSERT, UPDATE ON sentinel_guard_locks TO {user};"
        );
    });
}

/// The lock's record, without taking the lock: `None` where there is none, or none can be seen.
pub async fn last_record(
    target: &PostgresTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<RecordFacts>, LockError> {
    let client = connect(target, "sentinel-guard status", connect_limit).await?;
    match query(&client, &record_table::facts_sql(name.as_str()), answer).await {
        Ok(rows) => Ok(rows
            .first()
            .and_then(|row| record_table::facts(row.first()?.as_deref()?, number(row, 1)?))),
        Err(Failure::Db(e))
            if [SqlState::UNDEFINED_TABLE, SqlState::INSUFFICIENT_PRIVILEGE]
                .iter()
                .any(|code| e.code() == Some(code)) =>
        {
            Ok(None)
        }
        Err(failure) => Err(target.failed("SELECT FROM sentinel_guard_locks", failure, answer)),
    }
}
