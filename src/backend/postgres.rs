//! PostgreSQL session-level advisory lock (`pg_try_advisory_lock(bigint)`) on one dedicated
//! connection.
//!
//! As with MySQL, the session is the lock: the server frees it only when the session ends.
//! - Every setting that lets the server end a silent session on its own (`idle_session_timeout`,
//!   `tcp_user_timeout`, the TCP keepalive idle time) is set for the session to at least
//!   `Timings::session_timeout_secs` (a lock wait + check-interval + 2 x check-timeout + grace +
//!   margin), and read back; those that end a session
//!   whatever its client does (`client_connection_check_interval`, `statement_timeout`,
//!   `transaction_timeout`) are switched off. So the server frees the lock of a silent guard only
//!   after the guard has noticed the silence and stopped its app.
//! - Between ownership checks a server-side `pg_sleep` is always outstanding, so a
//!   `pg_terminate_backend` or a dead server is seen the instant the socket closes.
//! - Every statement runs as a simple query (no prepared statements) and the backend pid must stay
//!   the same: a pooler in transaction or statement mode hands statements to different backends,
//!   which breaks session locks, and is refused.

mod tls;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio::time::timeout;
use tokio_postgres::config::Host;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{CancelToken, Client, SimpleQueryMessage};
use tracing::{debug, info, warn};

use super::farewell::{Server, SessionFarewell};
use super::record_table;
use super::watched::{CheckTiming, SessionHeld, SessionLock, SessionWatcher, Verdict};
use super::{
    reopen, Acquisition, Backoff, ClaimAnswer, ClaimRequest, Contention, HeldLock, HolderInfo,
    LockError, LockRequest, WindowStore,
};
use crate::config::{LockName, PostgresTarget, Target, Timings};
use crate::deadline::Deadline;
use crate::holder::Holder;
use crate::record::{Fence, Previous, RecordFacts, RecordState};
use crate::window::{Claim, RunEnd, RunExit, UnixMicros};

use tls::Tls;

/// How often a cancel request is repeated until the check answers.
const INTERRUPT_RETRY: Duration = Duration::from_millis(20);
/// How long the guard waits for a cancel request that interrupts its own `pg_sleep` at release.
const INTERRUPT_TIMEOUT: Duration = Duration::from_secs(1);
/// PostgreSQL 14 brought `idle_session_timeout` and `client_connection_check_interval`: older
/// servers cannot be told which of their settings may end the session.
const MIN_SERVER_VERSION: u32 = 140_000;
/// PostgreSQL 17 brought `transaction_timeout`, which also ends a session whose single statement
/// (the check's `pg_sleep`) runs too long.
const TRANSACTION_TIMEOUT_SINCE: u32 = 170_000;

/// The advisory lock key of a lock name: the first 8 bytes of SHA-256("sentinel-guard:" + name),
/// as a big-endian signed 64-bit integer. Stable across versions and platforms, and computable by
/// a DBA: `SELECT ('x' || left(encode(sha256('sentinel-guard:billing'), 'hex'), 16))::bit(64)::bigint`.
pub fn lock_key(name: &LockName) -> i64 {
    let digest = Sha256::digest(format!("sentinel-guard:{name}"));
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The `pg_locks` row of a granted advisory lock on `key` in the current database: the two halves
/// of a bigint key are `classid` and `objid`, and `objsubid` 1 marks the one-bigint form.
fn lock_row(key: i64) -> String {
    let key = key as u64;
    format!(
        "locktype = 'advisory' AND granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND classid = '{high}'::oid AND objid = '{low}'::oid AND objsubid = 1",
        high = key >> 32,
        low = key & 0xffff_ffff,
    )
}

/// Whether this session's backend holds `key`.
fn held_here(key: i64) -> String {
    format!(
        "EXISTS (SELECT 1 FROM pg_locks WHERE {} AND pid = pg_backend_pid())",
        lock_row(key)
    )
}

/// `application_name` of a guard's session, so `pg_stat_activity` shows who holds what.
fn application_name(holder_id: &str) -> String {
    format!("sentinel-guard {holder_id}")
}

/// What a statement got: its rows as text (`None` for SQL NULL), or why none.
type Rows = Vec<Vec<Option<String>>>;

enum Failure {
    /// No answer within the limit; the statement may still be running.
    Timeout,
    Db(tokio_postgres::Error),
}

/// Runs `sql` (one or more statements, as a simple query) within `limit`.
async fn query(client: &Client, sql: &str, limit: Duration) -> Result<Rows, Failure> {
    let messages = timeout(limit, client.simple_query(sql))
        .await
        .map_err(|_| Failure::Timeout)?
        .map_err(Failure::Db)?;
    Ok(messages
        .into_iter()
        .filter_map(|message| match message {
            SimpleQueryMessage::Row(row) => Some(
                (0..row.len())
                    .map(|i| row.get(i).map(str::to_owned))
                    .collect(),
            ),
            _ => None,
        })
        .collect())
}

/// A column of a row as a number.
fn number<T: std::str::FromStr>(row: &[Option<String>], column: usize) -> Option<T> {
    row.get(column)?.as_deref()?.parse().ok()
}

fn is_true(row: &[Option<String>], column: usize) -> bool {
    row.get(column).and_then(Option::as_deref) == Some("t")
}

/// Whether the error means the session is gone (the server ended it, or the socket closed),
/// rather than that one statement failed.
fn session_ended(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        Some(code) => [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::IDLE_SESSION_TIMEOUT,
        ]
        .contains(code),
        None => true,
    }
}

impl PostgresTarget {
    fn failed(&self, what: &str, failure: Failure, limit: Duration) -> LockError {
        match failure {
            Failure::Timeout => LockError::Unreachable(format!(
                "{}: no answer to {what} within {}",
                self.url,
                crate::vocab::show_duration(limit)
            )),
            Failure::Db(e) => self.error(e),
        }
    }

    fn error(&self, e: tokio_postgres::Error) -> LockError {
        // An untrusted certificate is said as on every backend: refused, naming --ca-file.
        super::connect_failure(self.explain(e))
    }

    /// A driver error, with the database's own message and code where there is one, and the cause
    /// (the driver's `Display` says only "db error", "error performing TLS handshake").
    fn explain(&self, e: tokio_postgres::Error) -> String {
        let text = match (e.as_db_error(), std::error::Error::source(&e)) {
            (Some(db), _) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
            (None, Some(cause)) => format!("{e}: {cause}"),
            (None, None) => e.to_string(),
        };
        format!("{}: {}", self.url, self.url.scrub(text))
    }
}

/// A connection and the backend serving it.
struct Session {
    client: Client,
    pid: i32,
}

/// Connects within `limit`; the connection's I/O runs as a task of its own until the client is
/// dropped or the server closes it.
async fn connect(
    target: &PostgresTarget,
    app_name: &str,
    limit: Duration,
) -> Result<Client, LockError> {
    let tls = Tls::new(&target.tls)
        .map_err(|e| LockError::Unreachable(format!("{}: {e}", target.url)))?;
    let mut config = target.config.clone();
    let mode = tls::driver_mode(&target.tls, config.get_hosts());
    config.application_name(app_name).ssl_mode(mode);
    match timeout(limit, config.connect(tls)).await {
        Err(_) => Err(LockError::Unreachable(format!(
            "no connection to {} within {}",
            target.url,
            crate::vocab::show_duration(limit)
        ))),
        // The server said no (a wrong password, an unknown database, too many clients).
        Ok(Err(e)) if e.as_db_error().is_some() => Err(LockError::Refused(target.explain(e))),
        Ok(Err(e)) => Err(target.error(e)),
        Ok(Ok((client, connection))) => {
            tokio::spawn(async move {
                let _ = connection.await;
            });
            Ok(client)
        }
    }
}

/// A setting that can end a session on the server's own schedule, and what the guard needs of it.
struct Setting {
    name: &'static str,
    /// The value set, in the setting's base unit; `0` switches it off.
    value: u64,
    /// Only a TCP connection has it (a Unix socket's peer cannot go silent).
    tcp_only: bool,
}

/// The settings that let the server end the session, and so free the lock, without the guard.
fn session_settings(version: u32, silent_secs: u64) -> Vec<Setting> {
    let mut settings = vec![
        Setting {
            name: "idle_session_timeout",
            value: silent_secs * 1000,
            tcp_only: false,
        },
        Setting {
            name: "tcp_user_timeout",
            value: silent_secs * 1000,
            tcp_only: true,
        },
        Setting {
            name: "tcp_keepalives_idle",
            value: silent_secs,
            tcp_only: true,
        },
        Setting {
            name: "client_connection_check_interval",
            value: 0,
            tcp_only: false,
        },
        Setting {
            name: "statement_timeout",
            value: 0,
            tcp_only: false,
        },
    ];
    if version >= TRANSACTION_TIMEOUT_SINCE {
        settings.push(Setting {
            name: "transaction_timeout",
            value: 0,
            tcp_only: false,
        });
    }
    settings
}

/// Connects and makes the session fit to hold the lock: a primary, recent enough, reached without
/// a transaction pooler, with every setting that could end the session kept beyond the guard's
/// detection bound plus grace.
async fn open_session(
    target: &PostgresTarget,
    timings: &Timings,
    app_name: &str,
) -> Result<Session, LockError> {
    let client = connect(target, app_name, timings.connect_timeout).await?;
    let bounded = timings.connect_timeout;
    let first =
        "SELECT pg_backend_pid(), pg_is_in_recovery(), current_setting('server_version_num'), \
                 inet_client_addr() IS NULL";
    let rows = query(&client, first, bounded)
        .await
        .map_err(|f| target.failed("the server check", f, bounded))?;
    let row = rows.first().map(Vec::as_slice).unwrap_or_default();
    let (Some(pid), Some(version)) = (number::<i32>(row, 0), number::<u32>(row, 2)) else {
        return Err(LockError::Unsafe(format!(
            "unexpected answer to the server check: {row:?}"
        )));
    };
    if is_true(row, 1) {
        return Err(LockError::Unsafe(
            "pg_is_in_recovery() is true: this is a hot standby, whose advisory locks are local to it; \
             point --url at the primary"
                .to_owned(),
        ));
    }
    if version < MIN_SERVER_VERSION {
        return Err(LockError::Unsafe(format!(
            "PostgreSQL {version} is older than 14: it lacks idle_session_timeout and \
             client_connection_check_interval, so the guard cannot bound when it ends a session"
        )));
    }
    let local = is_true(row, 3);
    let silent_secs = timings.session_timeout_secs();
    let settings: Vec<Setting> = session_settings(version, silent_secs)
        .into_iter()
        .filter(|s| !(local && s.tcp_only))
        .collect();
    let set: String = settings
        .iter()
        .map(|s| format!("SET {} = {}; ", s.name, s.value))
        .collect();
    query(&client, &set, bounded)
        .await
        .map_err(|f| target.failed("SET", f, bounded))?;
    let names: Vec<String> = settings.iter().map(|s| format!("'{}'", s.name)).collect();
    let read_back = format!(
        "SELECT pg_backend_pid(), name, setting FROM pg_settings WHERE name IN ({})",
        names.join(", ")
    );
    let rows = query(&client, &read_back, bounded)
        .await
        .map_err(|f| target.failed("the settings read-back", f, bounded))?;
    for row in &rows {
        same_backend(pid, number(row, 0))?;
    }
    for setting in &settings {
        let kept = rows
            .iter()
            .find(|row| row.get(1).and_then(Option::as_deref) == Some(setting.name))
            .and_then(|row| number::<u64>(row, 2));
        if kept != Some(setting.value) {
            let shown = kept.map_or_else(|| "unknown".to_owned(), |v| v.to_string());
            return Err(LockError::Unsafe(format!(
                "the server keeps {} at {shown} instead of {}, so it could end the session and free \
                 the lock before the guard stops the app ({} = lock wait + check-interval + \
                 2 x check-timeout + grace-period + margin {}s; a pooler in between?)",
                setting.name,
                setting.value,
                if setting.value == 0 { "off" } else { "at least" },
                silent_secs
            )));
        }
    }
    Ok(Session { client, pid })
}

/// A pooler in transaction or statement mode hands each statement to whichever backend is free.
fn same_backend(pid: i32, now: Option<i32>) -> Result<(), LockError> {
    if now == Some(pid) {
        return Ok(());
    }
    let now = now.map_or_else(|| "unknown".to_owned(), |p| p.to_string());
    Err(LockError::Unsafe(format!(
        "the backend changed between two statements (pid {pid}, then {now}): a connection pooler in \
         transaction or statement mode (PgBouncer, RDS Proxy, ...) is in between, and would drop or \
         share the session's advisory lock; connect directly, or through a pooler in session mode"
    )))
}

/// The statement that tries for the lock: at once, or waiting up to `chunk` on the server, which
/// grants it the moment the holder releases it or its session ends.
fn try_lock_sql(key: i64, chunk: Duration) -> String {
    if chunk.is_zero() {
        format!("SELECT pg_try_advisory_lock({key}), pg_backend_pid()")
    } else {
        format!(
            "SET lock_timeout = {}; SELECT true, pg_backend_pid() FROM pg_advisory_lock({key})",
            chunk.as_millis().max(1)
        )
    }
}

pub async fn acquire(
    target: &PostgresTarget,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let timings = request.timings;
    let patience = request.patience;
    let key = lock_key(request.name);
    let app_name = application_name(&request.holder.id);
    let mut session = open_session(target, timings, &app_name).await?;
    let mut contention = Contention::new(&**request.observer);
    let mut backoff = Backoff::new();
    loop {
        let chunk = contention.next_wait(patience);
        let sent = Deadline::now();
        let budget = chunk + timings.check_timeout;
        let got = query(&session.client, &try_lock_sql(key, chunk), budget).await;
        let granted = match &got {
            Ok(rows) => rows.first().is_some_and(|row| is_true(row, 0)),
            Err(_) => false,
        };
        let error = match got {
            // Granted, but read after a freeze: the server may have ended the silent session and
            // granted the lock elsewhere since. Dropping the connection gives it back.
            Ok(_) if granted && sent.elapsed() > budget => LockError::Unreachable(format!(
                "{}: the lock was granted after {}, too late to rely on; the session is closed",
                target.url,
                crate::vocab::show_duration(Duration::from_millis(
                    sent.elapsed().as_millis() as u64
                ))
            )),
            Ok(rows) if granted => {
                let proven =
                    match same_backend(session.pid, rows.first().and_then(|row| number(row, 1))) {
                        Ok(()) => prove(&session, target, request, key).await,
                        Err(pooler) => Err(pooler),
                    };
                let recorded = match proven {
                    Ok((now_us, ports)) => take_record(&session, target, request, now_us)
                        .await
                        .map(|(previous, token, recorded)| (token, ports, previous, recorded)),
                    Err(e) => Err(e),
                };
                match recorded {
                    Ok((token, ports, previous, recorded)) => {
                        info!(
                            event = "lock_acquired",
                            backend_pid = session.pid,
                            key,
                            fencing_token = token,
                            session_timeout_secs = timings.session_timeout_secs(),
                            previous = %previous.reason(),
                            "postgres lock acquired"
                        );
                        return Ok(Acquisition::Acquired(watch(
                            session,
                            target,
                            request,
                            (token, previous, recorded),
                            (sent + chunk, ports),
                        )));
                    }
                    Err(e) => e,
                }
            }
            Ok(_) if patience.exhausted() => {
                let holder = describe_holder(&session.client, key, timings.check_timeout).await;
                return Ok(contention.give_up(holder));
            }
            Ok(_) => {
                if contention.log_due() {
                    contention.waiting(
                        &describe_holder(&session.client, key, timings.check_timeout).await,
                    );
                }
                backoff.reset();
                continue;
            }
            // The chunk's lock_timeout ran out with the lock still held elsewhere.
            Err(Failure::Db(e)) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                if patience.exhausted() {
                    let holder = describe_holder(&session.client, key, timings.check_timeout).await;
                    return Ok(contention.give_up(holder));
                }
                backoff.reset();
                continue;
            }
            Err(failure) => target.failed("pg_advisory_lock", failure, budget),
        };
        // Fail closed at start; a standby whose own session failed reconnects with backoff. Closing
        // the failed session first gives back a lock it may have been granted.
        drop(session);
        session = reopen(error, patience, &mut backoff, || {
            open_session(target, timings, &app_name)
        })
        .await?;
    }
}

/// Proves, in a statement of its own, that the backend that was granted the lock is this session's
/// and holds it (a transaction pooler fails this), and reads the server's clock in microseconds,
/// drawn while the lock is held, which the fencing token is at least (`Fence::next`). The
/// statement carries the guard's identity for `pg_stat_activity`.
async fn prove(
    session: &Session,
    target: &PostgresTarget,
    request: &LockRequest<'_>,
    key: i64,
) -> Result<(u64, Option<(u16, u16)>), LockError> {
    let limit = request.timings.check_timeout;
    let sql = format!(
        "SET lock_timeout = 0; SELECT pg_backend_pid(), {held}, \
         (extract(epoch FROM clock_timestamp()) * 1000000)::bigint, \
         inet_client_port() /* sentinel-guard {holder} */",
        held = held_here(key),
        holder = request.holder,
    );
    let sent = Deadline::now();
    let rows = query(&session.client, &sql, limit)
        .await
        .map_err(|f| target.failed("the ownership proof", f, limit))?;
    let row = rows.first().map(Vec::as_slice).unwrap_or_default();
    same_backend(session.pid, number(row, 0))?;
    if !is_true(row, 1) {
        return Err(LockError::Unsafe(format!(
            "the lock granted to backend {} is not in pg_locks: a pooler in between?",
            session.pid
        )));
    }
    if sent.elapsed() > limit {
        return Err(LockError::Unreachable(format!(
            "{}: the ownership proof answered too late to rely on; the session is closed",
            target.url
        )));
    }
    let token = number(row, 2)
        .ok_or_else(|| LockError::Unsafe(format!("the server's clock read {:?}", row.get(2))))?;
    // The client port as the server sees it (none over a Unix socket), and the server's: what
    // finds the session's socket for the watchdog's copy.
    let server = target.config.get_ports().first().copied().unwrap_or(5432);
    Ok((token, number(row, 3).map(|client| (client, server))))
}

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
/// without a new postmaster, and loses commits made with `synchronous_commit = off`: the record is
/// written with `local` at least (a stronger setting is kept).
const INCARNATION: &str = "extract(epoch FROM pg_postmaster_start_time())::text";

/// Reads the lock record the previous holder left and writes this holder's, with the next fencing
/// token (`Fence::next` of the previous one and the clock `now_us` the proof read), in one statement
/// on the lock's own session right after the grant (before the app can start); returns the token
/// and whether this holder's record was written. Where the table cannot be seen (no grant, no
/// CREATE on first use), every acquisition waits its own bound, which a warning says once, with
/// what to grant, and the token is the clock. A table that can be read but not written would leave
/// an older holder's row to mislead the next one: that is refused.
async fn take_record(
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
            Ok(rows) => {
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
                let previous = record_table::previous(name, found.as_ref(), own_bound)
                    .map_err(LockError::Unsafe)?;
                let token = number(row, 6).ok_or_else(|| {
                    LockError::Unsafe(format!(
                        "the lock record's upsert returned {:?}",
                        row.get(6)
                    ))
                })?;
                return Ok((previous, token, true));
            }
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

/// Who holds `name` now, without taking it.
pub async fn status(
    target: &PostgresTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<HolderInfo>, LockError> {
    let client = connect(target, "sentinel-guard status", connect_limit).await?;
    let rows = query(&client, &holder_sql(lock_key(name)), answer)
        .await
        .map_err(|f| target.failed("the pg_locks query", f, answer))?;
    Ok(rows.first().map(|row| describe(row)))
}

/// The holder of `key`: its backend, account, client and the guard identity its session shows.
fn holder_sql(key: i64) -> String {
    format!(
        "SELECT l.pid, a.usename, COALESCE(host(a.client_addr), 'local'), a.application_name, a.query \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE {}",
        lock_row(key)
    )
}

fn describe(row: &[Option<String>]) -> HolderInfo {
    let text = |i: usize| row.get(i).cloned().flatten().unwrap_or_default();
    let info = HolderInfo::default()
        .with("backend_pid", text(0))
        .with("user", text(1))
        .with("client", text(2));
    // The full identity is in the last statement's comment, visible to the holder's own role (and
    // to pg_read_all_stats); everyone sees its application_name.
    match Holder::parse(&text(4)) {
        Some(guard) => info.with_guard(Some(guard)),
        None => match text(3).strip_prefix("sentinel-guard ") {
            Some(id) => info.with("holder_id", id),
            None => info.with("application_name", text(3)),
        },
    }
}

/// Says who holds `key`, as far as this account can see.
async fn describe_holder(client: &Client, key: i64, limit: Duration) -> HolderInfo {
    match query(client, &holder_sql(key), limit).await {
        Ok(rows) => match rows.first() {
            Some(row) => describe(row),
            None => {
                HolderInfo::default().with("holder", "unknown (released while being looked up)")
            }
        },
        Err(_) => HolderInfo::default().with("holder", "unknown (the lookup failed)"),
    }
}

/// `pg_terminate_backend` of the dead guard's backend, from a new session, if that backend still
/// holds the lock and is the dead guard's (its `application_name` names the holder id; pids are
/// reused). Run in the watchdog.
pub fn end_session(farewell: &SessionFarewell) -> Result<String, String> {
    let target = match farewell.target()? {
        Target::Postgres(target) => target,
        _ => return Err("not a postgres:// URL".to_owned()),
    };
    farewell.on_runtime(async {
        let client = connect(&target, "sentinel-guard watchdog", farewell.timeout)
            .await
            .map_err(|e| e.to_string())?;
        let pid = farewell.session_id;
        // The tree is gone (the watchdog says farewell only then): a record still held by the dead
        // guard says so. One the next holder wrote is not the dead guard's, and is left alone.
        let mark = record_table::mark_sql(&farewell.name, &farewell.holder_id, RecordState::TreeGone);
        if query(&client, &mark, farewell.timeout).await.is_err() {
            debug!("the dead guard's lock record could not be marked tree_gone");
        }
        let sql = format!(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE {} AND l.pid = {pid} AND a.application_name = '{}'",
            lock_row(lock_key(
                &LockName::parse(&farewell.name).map_err(|e| e.to_string())?
            )),
            application_name(&farewell.holder_id),
        );
        match query(&client, &sql, farewell.timeout).await {
            Err(Failure::Timeout) => Err(format!(
                "no answer within {}",
                crate::vocab::show_duration(farewell.timeout)
            )),
            Err(Failure::Db(e)) => Err(target.explain(e)),
            Ok(rows) if rows.first().is_some_and(|row| is_true(row, 0)) => {
                Ok(format!("ended backend {pid}"))
            }
            Ok(rows) if rows.is_empty() => Ok(format!(
                "left backend {pid} alone: it no longer holds the dead guard's lock"
            )),
            Ok(_) => Err(format!("pg_terminate_backend({pid}) did not end it")),
        }
    })
}

/// A held advisory lock: a task owns the connection and keeps proving ownership until it is told
/// to release or finds the lock gone.
fn watch(
    session: Session,
    target: &PostgresTarget,
    request: &LockRequest<'_>,
    (fencing_token, previous, recorded): (u64, Previous, bool),
    asked: (Deadline, Option<(u16, u16)>),
) -> HeldLock {
    let key = lock_key(request.name);
    let farewell = SessionFarewell {
        server: Server::Postgres,
        url: target.secret.clone(),
        session_id: u64::from(session.pid as u32),
        revision: 0,
        name: request.name.as_str().to_owned(),
        holder_id: request.holder.id.clone(),
        timeout: request.timings.connect_timeout,
        ca_file: target.tls.ca_file.clone(),
    }
    .encode();
    let watcher = Watcher {
        pid: session.pid,
        key,
        target: target.clone(),
        cancel: session.client.cancel_token(),
        check_sql: check_sql(request, key),
        released_sql: recorded.then(|| {
            record_table::mark_sql(
                request.name.as_str(),
                &request.holder.id,
                RecordState::Released,
            )
        }),
        timing: CheckTiming::of(request),
    };
    let windows = PostgresWindows {
        pid: session.pid,
        target: Box::new(target.clone()),
    };
    HeldLock::new(SessionHeld {
        session: SessionLock::spawn(
            watcher,
            session.client,
            farewell,
            Some(fencing_token),
            asked,
        ),
        previous,
        windows,
    })
}

/// What scheduled runs need to claim windows under a held advisory lock.
pub struct PostgresWindows {
    /// Where scheduled runs record their windows, on a connection of their own: the lock's
    /// connection is busy with the ownership check.
    target: Box<PostgresTarget>,
    /// The lock's backend, which a window claim proves still holds the key.
    pid: i32,
}

/// The table of claimed windows, created on first use in the URL's database (its default schema).
const WINDOWS_TABLE: &str = "CREATE TABLE IF NOT EXISTS sentinel_guard_windows (\
name varchar(64) NOT NULL, \
window_start timestamptz NOT NULL, \
holder varchar(64) NOT NULL, \
host varchar(255) NOT NULL, \
claimed_at timestamptz NOT NULL, \
finished_at timestamptz NULL, \
exit_code smallint NULL, \
PRIMARY KEY (name, window_start))";

/// Rows kept per lock name: enough to outlast every window, few enough to stay small.
const WINDOWS_KEPT: u32 = 100;

/// Microseconds since the epoch of a timestamp expression, exactly (`extract` is numeric).
fn micros(expression: &str) -> String {
    format!("(extract(epoch FROM {expression}) * 1000000)::bigint")
}

#[async_trait]
impl WindowStore for PostgresWindows {
    /// Inserts the window's row only while the lock's own backend holds the key (and is this
    /// guard's, by its `application_name`: pids are reused) and while the server's clock is inside
    /// the window; the primary key refuses a second claim. Lock names, holder ids and host names
    /// are restricted to characters that need no quoting.
    async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        let (target, limit) = (&self.target, request.timings.check_timeout);
        let client = windows_session(target, request).await?;
        let name = request.name.as_str();
        let window = request.window;
        let last = read_last_claim(&client, target, name, limit).await?;
        if let Some(blocked) = ClaimAnswer::blocked_by(last.as_ref(), window) {
            return Ok(blocked);
        }
        let (start, end) = (window.start / 1_000_000, window.end / 1_000_000);
        // This window's own claim, whose command never started: it holds nothing, and its row
        // goes for the new one (no proof needed to remove what blocks nothing).
        if last
            .as_ref()
            .is_some_and(|last| last.window_start == window.start)
        {
            let delete = format!(
                "DELETE FROM sentinel_guard_windows \
                 WHERE name = '{name}' AND window_start = to_timestamp({start}) AND exit_code < 0"
            );
            query(&client, &delete, limit).await.map_err(|f| {
                windows_error(target, "DELETE FROM sentinel_guard_windows", f, limit)
            })?;
        }
        let insert = format!(
            "INSERT INTO sentinel_guard_windows (name, window_start, holder, host, claimed_at) \
             SELECT '{name}', to_timestamp({start}), '{holder}', '{host}', clock_timestamp() \
             WHERE EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE {lock} AND l.pid = {pid} AND a.application_name = '{app}') \
             AND clock_timestamp() >= to_timestamp({start}) AND clock_timestamp() < to_timestamp({end}) \
             ON CONFLICT DO NOTHING RETURNING 1",
            holder = request.holder.id,
            host = request.holder.host,
            lock = lock_row(lock_key(request.name)),
            pid = self.pid,
            app = application_name(&request.holder.id),
        );
        let inserted = match query(&client, &insert, limit).await {
            Err(Failure::Db(e)) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => {
                create_windows_table(&client, target, limit).await?;
                query(&client, &insert, limit).await
            }
            other => other,
        }
        .map_err(|f| windows_error(target, "INSERT INTO sentinel_guard_windows", f, limit))?;
        if inserted.is_empty() {
            return Ok(ClaimAnswer::NotNow(
                "the lock's backend no longer holds the key, or the server's clock is outside the window",
            ));
        }
        let prune = format!(
            "DELETE FROM sentinel_guard_windows WHERE name = '{name}' AND window_start < \
             (SELECT window_start FROM sentinel_guard_windows WHERE name = '{name}' \
             ORDER BY window_start DESC OFFSET {} LIMIT 1)",
            WINDOWS_KEPT - 1
        );
        if query(&client, &prune, limit).await.is_err() {
            warn!(
                event = "windows_prune_failed",
                "cannot delete old rows of sentinel_guard_windows"
            );
        }
        Ok(ClaimAnswer::Ours)
    }

    async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError> {
        let (target, limit) = (&self.target, request.timings.check_timeout);
        let client = windows_session(target, request).await?;
        let update = format!(
            "UPDATE sentinel_guard_windows SET finished_at = clock_timestamp(), exit_code = {code} \
             WHERE name = '{name}' AND window_start = to_timestamp({start}) AND holder = '{holder}'",
            name = request.name.as_str(),
            start = request.window.start / 1_000_000,
            holder = request.holder.id,
            code = exit.stored(),
        );
        query(&client, &update, limit)
            .await
            .map(drop)
            .map_err(|f| windows_error(target, "UPDATE sentinel_guard_windows", f, limit))
    }
}

/// A connection for the windows table, named after the guard in `pg_stat_activity`.
async fn windows_session(
    target: &PostgresTarget,
    request: &ClaimRequest<'_>,
) -> Result<Client, LockError> {
    let app_name = format!("sentinel-guard windows {}", request.holder.id);
    connect(target, &app_name, request.timings.connect_timeout).await
}

/// A server's error on the windows table (a missing grant, a read-only server) will not mend by
/// itself: a refusal, which stops a scheduler; silence or a closed session is the backend being
/// unreachable, which the job's `--if-unavailable` policy handles.
fn windows_error(
    target: &PostgresTarget,
    what: &str,
    failure: Failure,
    limit: Duration,
) -> LockError {
    match failure {
        Failure::Db(e) if e.as_db_error().is_some() && !session_ended(&e) => {
            LockError::Refused(target.explain(e))
        }
        failure => target.failed(what, failure, limit),
    }
}

/// Creates the windows table, or says exactly what an administrator must run once.
async fn create_windows_table(
    client: &Client,
    target: &PostgresTarget,
    limit: Duration,
) -> Result<(), LockError> {
    match query(client, WINDOWS_TABLE, limit).await {
        Ok(_) => {
            info!(
                event = "windows_table_created",
                "created table sentinel_guard_windows for scheduled runs"
            );
            Ok(())
        }
        Err(Failure::Db(e)) if e.as_db_error().is_some() => {
            let user = target.config.get_user().unwrap_or("<user>");
            Err(LockError::Refused(format!(
                "{}; cannot create the table of scheduled windows. Run this once as an administrator in \
                 the URL's database: {WINDOWS_TABLE}; and grant the guard's user: \
                 GRANT SELECT, INSERT, UPDATE, DELETE ON sentinel_guard_windows TO \"{user}\";",
                target.explain(e)
            )))
        }
        Err(failure) => Err(target.failed("CREATE TABLE sentinel_guard_windows", failure, limit)),
    }
}

/// The newest claimed window of `name`; `None` without the table (nothing was ever scheduled).
async fn read_last_claim(
    client: &Client,
    target: &PostgresTarget,
    name: &str,
    limit: Duration,
) -> Result<Option<Claim>, LockError> {
    let select = format!(
        "SELECT {start}, holder, host, {claimed}, {finished}, exit_code \
         FROM sentinel_guard_windows WHERE name = '{name}' ORDER BY window_start DESC LIMIT 1",
        start = micros("window_start"),
        claimed = micros("claimed_at"),
        finished = micros("finished_at"),
    );
    let rows = match query(client, &select, limit).await {
        Err(Failure::Db(e)) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => return Ok(None),
        rows => {
            rows.map_err(|f| windows_error(target, "SELECT FROM sentinel_guard_windows", f, limit))?
        }
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
        end: match (number::<i64>(row, 4), number::<i64>(row, 5)) {
            (Some(finished_at), Some(code)) => Some(RunEnd::from_stored(code, finished_at)),
            _ => None,
        },
    }))
}

/// `clock_timestamp()` in microseconds.
pub async fn server_clock(
    target: &PostgresTarget,
    timings: &Timings,
) -> Result<UnixMicros, LockError> {
    let client = connect(target, "sentinel-guard clock", timings.connect_timeout).await?;
    let select = format!("SELECT {}", micros("clock_timestamp()"));
    let rows = query(&client, &select, timings.check_timeout)
        .await
        .map_err(|f| target.failed("SELECT clock_timestamp()", f, timings.check_timeout))?;
    rows.first()
        .and_then(|row| number(row, 0))
        .ok_or_else(|| LockError::Unsafe("the server returned no time".to_owned()))
}

/// The newest claimed window of `name`, for `status` and the scheduler.
pub async fn last_claim(
    target: &PostgresTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<Claim>, LockError> {
    let client = connect(target, "sentinel-guard status", connect_limit).await?;
    read_last_claim(&client, target, name.as_str(), answer).await
}

/// The query that proves ownership: the sleep first (a function scan), then the lock test, so the
/// answer says the lock was still this backend's when the sleep ended, and that the server is still
/// a primary (not in recovery). The comment names the guard in `pg_stat_activity`.
fn check_sql(request: &LockRequest<'_>, key: i64) -> String {
    format!(
        "SELECT pg_backend_pid(), {held}, pg_is_in_recovery() FROM pg_sleep({sleep:.3}) \
         /* sentinel-guard {holder} */",
        held = held_here(key),
        sleep = request.timings.check_interval.as_secs_f64(),
        holder = request.holder,
    )
}

struct Watcher {
    pid: i32,
    key: i64,
    target: PostgresTarget,
    cancel: CancelToken,
    check_sql: String,
    /// Marks the lock record released, where one was written.
    released_sql: Option<String>,
    timing: CheckTiming,
}

type CheckResult = Result<Rows, Failure>;

impl SessionWatcher for Watcher {
    type Conn = Client;
    type Answer = CheckResult;

    fn timing(&self) -> &CheckTiming {
        &self.timing
    }

    fn check<'a>(
        &'a self,
        client: &'a mut Client,
    ) -> impl Future<Output = CheckResult> + Send + 'a {
        query(client, &self.check_sql, self.timing.budget)
    }

    fn verdict(&self, answer: CheckResult) -> Verdict {
        match answer {
            Ok(rows) if rows.first().is_some_and(|row| is_true(row, 2)) => Verdict::Demoted(
                "pg_is_in_recovery() is true: the server is no longer a primary".to_owned(),
            ),
            Ok(rows)
                if rows
                    .first()
                    .is_some_and(|row| number(row, 0) == Some(self.pid) && is_true(row, 1)) =>
            {
                Verdict::Owned
            }
            Ok(rows) => Verdict::NotOwner(format!(
                "backend {} no longer holds key {} ({:?})",
                self.pid,
                self.key,
                rows.first()
            )),
            Err(Failure::Timeout) => Verdict::NoAnswer,
            Err(Failure::Db(e)) if session_ended(&e) => Verdict::Closed(self.target.explain(e)),
            Err(Failure::Db(e)) => Verdict::Failed(self.target.explain(e)),
        }
    }

    /// A stream to the server for one cancel request.
    type Interrupter = CancelStream;

    fn open_interrupter(&self) -> impl Future<Output = Option<CancelStream>> + Send + 'static {
        CancelStream::open(self.target.clone())
    }

    /// The protocol's cancel request (a short connection that needs no credentials), repeated until
    /// the check answers: the first one can reach the server before the check itself does. The first
    /// goes over the stream opened ahead, if there is one; the repeats, and a first one whose stream
    /// the server has closed meanwhile (it waits `authentication_timeout` for a request), connect
    /// anew. If one cannot be sent, the sleep simply runs out.
    async fn interrupt<'a, F>(
        &'a self,
        mut check: Pin<&'a mut F>,
        ahead: Option<CancelStream>,
    ) -> CheckResult
    where
        F: Future<Output = CheckResult> + Send + 'a,
    {
        if let Some(CancelStream { stream, tls }) = ahead {
            let cancelled =
                timeout(INTERRUPT_TIMEOUT, self.cancel.cancel_query_raw(stream, tls)).await;
            if matches!(cancelled, Ok(Ok(()))) {
                if let Ok(result) = timeout(INTERRUPT_RETRY, check.as_mut()).await {
                    return result;
                }
            }
        }
        let Ok(tls) = Tls::new(&self.target.tls) else {
            return check.await;
        };
        loop {
            let cancelled = timeout(INTERRUPT_TIMEOUT, self.cancel.cancel_query(tls.clone())).await;
            if !matches!(cancelled, Ok(Ok(()))) {
                debug!(
                    backend_pid = self.pid,
                    "could not cancel the check sleep; waiting for it to end"
                );
                return check.await;
            }
            if let Ok(result) = timeout(INTERRUPT_RETRY, check.as_mut()).await {
                return result;
            }
        }
    }

    fn release(&self, client: Client) -> impl Future<Output = Result<(), LockError>> + Send + '_ {
        self.give_back(client)
    }

    /// The driver matches each answer to its own request, so a late one misleads nothing.
    fn abandon(&self, client: Client) -> impl Future<Output = Result<(), LockError>> + Send + '_ {
        self.give_back(client)
    }
}

/// A TCP stream to the lock session's server, and the TLS the cancel request will be sent with: what
/// `CancelToken::cancel_query` would open itself, opened before the request is due.
struct CancelStream {
    stream: TcpStream,
    tls: tls::Connect,
}

impl CancelStream {
    /// Follows the driver's `connect` and `cancel_query`: the host's address (`hostaddr` before
    /// `host`), its port (5432 by default), and a TLS connector for the host's name (made before
    /// connecting, as the driver makes it) with the session's `sslmode` and CA file. Only a URL of
    /// one TCP host says which server the session is on: with several hosts the one the driver
    /// reached is not known here, and a Unix socket costs nothing to open at release, so there is
    /// no stream ahead then.
    async fn open(target: PostgresTarget) -> Option<CancelStream> {
        let config = &target.config;
        let (hosts, addrs) = (config.get_hosts(), config.get_hostaddrs());
        if hosts.len().max(addrs.len()) != 1 {
            return None;
        }
        let hostname = match hosts.first() {
            Some(Host::Tcp(name)) => Some(name.as_str()),
            _ => None,
        };
        let addr = match (addrs.first(), hostname) {
            (Some(addr), _) => addr.to_string(),
            (None, Some(name)) => name.to_owned(),
            (None, None) => return None,
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let mut make_tls = Tls::new(&target.tls).ok()?;
        let tls = MakeTlsConnect::<TcpStream>::make_tls_connect(
            &mut make_tls,
            hostname.unwrap_or_default(),
        )
        .ok()?;
        let stream = timeout(INTERRUPT_TIMEOUT, TcpStream::connect((addr.as_str(), port)))
            .await
            .ok()?
            .ok()?;
        Some(CancelStream { stream, tls })
    }
}

impl Watcher {
    async fn give_back(&self, client: Client) -> Result<(), LockError> {
        // The record first, while the lock is still ours: the next holder starts at once. Only
        // called once the app's tree is gone.
        if let Some(sql) = &self.released_sql {
            if let Err(failure) = query(&client, sql, self.timing.budget).await {
                let error = match failure {
                    Failure::Db(e) => self.target.explain(e),
                    Failure::Timeout => "no answer".to_owned(),
                };
                warn!(event = "lock_record_failed", error = %error, "cannot mark the lock record released; the next holder waits the takeover bound");
            }
        }
        let sql = format!("SELECT pg_advisory_unlock({})", self.key);
        match query(&client, &sql, self.timing.budget).await {
            Ok(rows) if rows.first().is_some_and(|row| is_true(row, 0)) => info!(
                event = "lock_released",
                backend_pid = self.pid,
                "postgres lock released"
            ),
            Ok(rows) => warn!(
                event = "release_failed",
                backend_pid = self.pid,
                result = ?rows.first(),
                "pg_advisory_unlock did not confirm; closing the connection frees the lock"
            ),
            Err(Failure::Db(e)) => warn!(
                event = "release_failed",
                backend_pid = self.pid,
                error = %self.target.explain(e),
                "pg_advisory_unlock failed; closing the connection frees the lock"
            ),
            Err(Failure::Timeout) => warn!(
                event = "release_failed",
                backend_pid = self.pid,
                "pg_advisory_unlock timed out; closing the connection frees the lock"
            ),
        }
        // Dropping the client ends the session, which frees the lock even where the unlock failed.
        drop(client);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_are_the_documented_sha256_prefix() {
        // SELECT ('x' || left(encode(sha256('sentinel-guard:billing'), 'hex'), 16))::bit(64)::bigint
        let digest = Sha256::digest(b"sentinel-guard:billing");
        let expected = i64::from_be_bytes(digest[..8].try_into().unwrap());
        assert_eq!(lock_key(&LockName::parse("billing").unwrap()), expected);
        assert_ne!(
            lock_key(&LockName::parse("billing").unwrap()),
            lock_key(&LockName::parse("billing2").unwrap())
        );
    }

    #[test]
    fn session_settings_cover_every_way_the_server_ends_a_session() {
        let names = |v| {
            session_settings(v, 18)
                .into_iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
        };
        assert!(names(150_000).contains(&"idle_session_timeout"));
        assert!(!names(160_000).contains(&"transaction_timeout"));
        assert!(names(170_000).contains(&"transaction_timeout"));
        let idle = session_settings(150_000, 18)
            .into_iter()
            .find(|s| s.name == "idle_session_timeout")
            .unwrap();
        assert_eq!(idle.value, 18_000);
    }
}
