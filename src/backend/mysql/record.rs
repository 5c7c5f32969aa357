//! MySQL's lock record (`record_table.rs`): read and written on the lock's own session right after
//! the grant, with the fencing token.

use super::*;

/// The table of lock records, created on first use in the URL's database: one row per lock name,
/// written by its holder on its own session (see `record.rs`).
const LOCKS_TABLE: &str = "CREATE TABLE IF NOT EXISTS sentinel_guard_locks (\
name VARCHAR(64) NOT NULL PRIMARY KEY, \
fence BIGINT UNSIGNED NOT NULL, \
drawn_us BIGINT UNSIGNED NOT NULL, \
holder VARCHAR(64) NOT NULL, \
state VARCHAR(16) NOT NULL, \
bound_ms BIGINT UNSIGNED NOT NULL, \
incarnation VARCHAR(320) NOT NULL, \
updated_at DATETIME(6) NOT NULL) ENGINE=InnoDB";

/// The server that writes a row: replication needs every server's `server_id` to differ, and the
/// host and port tell apart servers that keep the default one. A restart keeps it: committed rows
/// survive a restart only with InnoDB's default durability (`innodb_flush_log_at_trx_commit = 1`);
/// a server without it reads as a new incarnation at every acquisition, so its rows prove nothing.
/// Read with the row and written back as a literal: statement-based replication would evaluate the
/// expression again on each replica, which would then take the rows for its own.
const INCARNATION: &str = "CONCAT(@@hostname, ':', @@port, '#', @@server_id, \
     IF(@@global.innodb_flush_log_at_trx_commit = 1, '', CONCAT(' not durable ', UUID())))";

/// The server's clock in microseconds since the epoch, in UTC: a session time zone with daylight
/// saving time would step `UNIX_TIMESTAMP(NOW())` back an hour once a year. The same everywhere in
/// one statement.
const NOW_US: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// Server errors that mean no record can be kept here: no database named, no such database, no
/// grant to see the table, a table of an older layout. Any other error is a failed acquisition.
const NO_RECORD_HERE: [u16; 6] = [1044, 1046, 1049, 1142, 1143, 1054];

/// Reads the lock record the previous holder left and writes this holder's, with the next fencing
/// token, on the lock's own session right after the grant (before the app can start); returns the
/// token and whether the record was written. Where the table cannot be seen (no database in the
/// URL, no grant, no CREATE on first use), every acquisition waits its own bound, which a warning
/// says once, with what to grant, and the token is the server's clock. A table that can be read but
/// not written would leave an older holder's row to mislead the next one: that is refused.
pub(super) async fn take_record(
    conn: &mut Conn,
    target: &MysqlTarget,
    request: &LockRequest<'_>,
) -> Result<(Previous, u64, bool), LockError> {
    let (name, holder) = (request.name.as_str(), &request.holder.id);
    let timings = request.timings;
    let own_bound = timings.worst_answer_to_deadline();
    let limit = timings.check_timeout;
    let read = record_table::read_sql(name, INCARNATION);
    let write = |incarnation: &str| {
        format!(
        "INSERT INTO sentinel_guard_locks \
         (name, fence, drawn_us, holder, state, bound_ms, incarnation, updated_at) \
         VALUES ('{name}', LAST_INSERT_ID({NOW_US}), {NOW_US}, '{holder}', 'held', {}, '{incarnation}', NOW(6)) \
         ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(GREATEST(fence + 1, VALUES(drawn_us))), \
         drawn_us = VALUES(drawn_us), holder = VALUES(holder), state = 'held', \
         bound_ms = VALUES(bound_ms), incarnation = VALUES(incarnation), updated_at = VALUES(updated_at)",
        own_bound.as_millis()
    )
    };
    let mut created = false;
    let found = loop {
        let answer = conn.query_first::<Found, _>(&read);
        match timeout(limit, answer).await {
            Err(_) => return Err(no_answer(target, "SELECT FROM sentinel_guard_locks", limit)),
            Ok(Ok(Some(found))) => break found,
            Ok(Ok(None)) => {
                return Err(LockError::Unsafe(
                    "the lock record's SELECT returned no row".to_owned(),
                ))
            }
            Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_NO_SUCH_TABLE && !created => {
                created = true;
                match timeout(limit, conn.query_drop(LOCKS_TABLE)).await {
                    Ok(Ok(())) => info!(
                        event = "lock_table_created",
                        "created table sentinel_guard_locks for lock records"
                    ),
                    Ok(Err(mysql_async::Error::Server(e))) => {
                        return without_record(conn, target, &e, own_bound, limit).await
                    }
                    Ok(Err(e)) => return Err(setup_error(target, e)),
                    Err(_) => {
                        return Err(no_answer(
                            target,
                            "CREATE TABLE sentinel_guard_locks",
                            limit,
                        ))
                    }
                }
            }
            Ok(Err(mysql_async::Error::Server(e))) if NO_RECORD_HERE.contains(&e.code) => {
                return without_record(conn, target, &e, own_bound, limit).await
            }
            Ok(Err(e)) => return Err(setup_error(target, e)),
        }
    };
    let (found, server) = row_of(found);
    let previous =
        record_table::previous(name, found.as_ref(), own_bound).map_err(LockError::Unsafe)?;
    match timeout(limit, conn.query_drop(write(&server))).await {
        Err(_) => return Err(no_answer(target, "INSERT INTO sentinel_guard_locks", limit)),
        Ok(Err(mysql_async::Error::Server(e))) if NO_RECORD_HERE.contains(&e.code) => {
            let user = target.opts.user().unwrap_or("<user>");
            return Err(LockError::Unsafe(format!(
                "{}: the lock records in sentinel_guard_locks can be read but not written ({}), so \
                 an older holder's record would mislead the next holder; \
                 GRANT INSERT, UPDATE ON sentinel_guard_locks TO '{user}'@'%', or revoke SELECT",
                target.url,
                target.url.scrub(e)
            )));
        }
        Ok(Err(e)) => return Err(setup_error(target, e)),
        Ok(Ok(())) => {}
    }
    let token = conn.last_insert_id().ok_or_else(|| {
        LockError::Unsafe("the lock record's INSERT returned no fencing token".to_owned())
    })?;
    Ok((previous, token, true))
}

/// The record's columns as `record_table::read_sql` selects them: state, bound_ms, fence, drawn_us,
/// the server that wrote it, and this server.
type Found = (
    Option<String>,
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<String>,
    String,
);

/// The previous holder's record, if any, and this server's name as a literal may hold it.
fn row_of(found: Found) -> (Option<record_table::Row>, String) {
    let (state, bound_ms, token, drawn_us, written_by, server) = found;
    let row = state.map(|state| record_table::Row {
        state,
        bound_ms: bound_ms.unwrap_or(0),
        fence: Fence {
            token: token.unwrap_or(0),
            drawn_us: drawn_us.unwrap_or(0),
        },
        same_server: written_by.as_deref() == Some(server.as_str()),
    });
    // Host names are letters, digits, dots and dashes; anything else is kept out of the literal.
    let server = server
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || ".-_:# ".contains(*c))
        .collect();
    (row, server)
}

/// No record can be kept on this server (`e` says why, once): the previous holder's app may run for
/// this holder's own bound, and the token is the server's clock.
async fn without_record(
    conn: &mut Conn,
    target: &MysqlTarget,
    e: &mysql_async::ServerError,
    own_bound: Duration,
    limit: Duration,
) -> Result<(Previous, u64, bool), LockError> {
    record_unavailable(target, e);
    let clock = format!("SELECT {NOW_US}");
    let token = match timeout(limit, conn.query_first::<u64, _>(&clock)).await {
        Err(_) => return Err(no_answer(target, "the server's clock", limit)),
        Ok(Err(e)) => return Err(setup_error(target, e)),
        Ok(Ok(token)) => token,
    };
    let token =
        token.ok_or_else(|| LockError::Unsafe("the server's clock read empty".to_owned()))?;
    Ok((record_table::no_record(own_bound), token, false))
}

/// Says once why no lock record can be kept, and what an administrator grants to make clean
/// hand-overs instant again.
fn record_unavailable(target: &MysqlTarget, e: &mysql_async::ServerError) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        let db = target.opts.db_name().unwrap_or("<database>");
        let user = target.opts.user().unwrap_or("<user>");
        warn!(
            event = "lock_record_unavailable",
            error = %target.url.scrub(e),
            "no lock record can be kept, so every acquisition waits the takeover bound before starting the app; \
             name a database in the URL, and run once as an administrator: {LOCKS_TABLE}; \
             GRANT SELECT, INSERT, UPDATE ON `{db}`.`sentinel_guard_locks` TO '{user}'@'%';"
        );
    });
}

/// The lock's record, without taking the lock: `None` where there is none, or none can be seen.
pub async fn last_record(
    target: &MysqlTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<RecordFacts>, LockError> {
    if target.opts.db_name().is_none() {
        return Ok(None);
    }
    let mut conn = connect(target, connect_limit).await?;
    let read = record_table::facts_sql(name.as_str());
    let found = timeout(answer, conn.query_first::<(String, u64), _>(&read)).await;
    let _ = timeout(answer, conn.disconnect()).await;
    match found {
        Err(_) => Err(no_answer(
            target,
            "SELECT FROM sentinel_guard_locks",
            answer,
        )),
        Ok(Ok(row)) => Ok(row.and_then(|(state, token)| record_table::facts(&state, token))),
        Ok(Err(mysql_async::Error::Server(e)))
            if e.code == ER_NO_SUCH_TABLE || NO_RECORD_HERE.contains(&e.code) =>
        {
            Ok(None)
        }
        Ok(Err(e)) => Err(setup_error(target, e)),
    }
}
