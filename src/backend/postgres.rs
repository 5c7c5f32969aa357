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
use super::window_table::{self, Rows, SqlWindows, TableError, WindowDialect};
use super::{
    acquire_session, Acquisition, ClaimRequest, HeldLock, HolderInfo, LockError, LockRequest,
    SessionTry,
};
use crate::config::{LockName, PostgresTarget, RedactedUrl, Target, Timings};
use crate::deadline::Deadline;
use crate::holder::Holder;
use crate::record::{Fence, Previous, RecordFacts, RecordState};
use crate::window::{Claim, UnixMicros};

use tls::Tls;

mod record;
mod watcher;
mod windows;
pub use record::last_record;
use record::take_record;
pub use watcher::end_session;
use watcher::watch;
pub use windows::{last_claim, server_clock, PostgresWindows};

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

enum Failure {
    /// No answer within the limit; the statement may still be running.
    Timeout,
    Db(tokio_postgres::Error),
}

/// Runs `sql` (one or more statements, as a simple query) within `limit`: its rows as text
/// (`None` for SQL NULL).
async fn query(client: &Client, sql: &str, limit: Duration) -> Result<Rows, Failure> {
    statement(client, sql, limit).await.map(|(rows, _)| rows)
}

/// `query`, with how many rows the last statement changed.
async fn statement(client: &Client, sql: &str, limit: Duration) -> Result<(Rows, u64), Failure> {
    let messages = timeout(limit, client.simple_query(sql))
        .await
        .map_err(|_| Failure::Timeout)?
        .map_err(Failure::Db)?;
    let (mut rows, mut changed) = (Vec::new(), 0);
    for message in messages {
        match message {
            SimpleQueryMessage::Row(row) => rows.push(
                (0..row.len())
                    .map(|i| row.get(i).map(str::to_owned))
                    .collect(),
            ),
            SimpleQueryMessage::CommandComplete(count) => changed = count,
            _ => {}
        }
    }
    Ok((rows, changed))
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
    let attempt = PostgresTry {
        target,
        request,
        key: lock_key(request.name),
        app_name: application_name(&request.holder.id),
    };
    acquire_session(&attempt, request).await
}

/// PostgreSQL's part of taking the lock: an advisory lock on a session of the guard's own.
struct PostgresTry<'a> {
    target: &'a PostgresTarget,
    request: &'a LockRequest<'a>,
    key: i64,
    app_name: String,
}

impl SessionTry for PostgresTry<'_> {
    type Session = Session;
    /// The backend that answered the grant, which must be the session's own.
    type Grant = Option<i32>;

    fn url(&self) -> &RedactedUrl {
        &self.target.url
    }

    async fn open(&self) -> Result<Session, LockError> {
        open_session(self.target, self.request.timings, &self.app_name).await
    }

    async fn try_once(
        &self,
        session: &mut Session,
        chunk: Duration,
        budget: Duration,
    ) -> Result<Option<Option<i32>>, LockError> {
        match query(&session.client, &try_lock_sql(self.key, chunk), budget).await {
            Ok(rows) => Ok(rows
                .first()
                .filter(|row| is_true(row, 0))
                .map(|row| number(row, 1))),
            // The chunk's lock_timeout ran out with the lock still held elsewhere.
            Err(Failure::Db(e)) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => Ok(None),
            Err(failure) => Err(self.target.failed("pg_advisory_lock", failure, budget)),
        }
    }

    async fn hold(
        &self,
        session: Session,
        answered_by: Option<i32>,
        granted_by: Deadline,
    ) -> Result<HeldLock, LockError> {
        let (target, request) = (self.target, self.request);
        same_backend(session.pid, answered_by)?;
        let (now_us, ports) = prove(&session, target, request, self.key).await?;
        let (previous, token, recorded) = take_record(&session, target, request, now_us).await?;
        info!(
            event = "lock_acquired",
            backend_pid = session.pid,
            key = self.key,
            fencing_token = token,
            session_timeout_secs = request.timings.session_timeout_secs(),
            previous = %previous.reason(),
            "postgres lock acquired"
        );
        Ok(watch(
            session,
            target,
            request,
            (token, previous, recorded),
            (granted_by, ports),
        ))
    }

    async fn holder(&self, session: &mut Session) -> (HolderInfo, Result<(), LockError>) {
        let limit = self.request.timings.check_timeout;
        (
            describe_holder(&session.client, self.key, limit).await,
            Ok(()),
        )
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
