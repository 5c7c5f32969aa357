//! MySQL/MariaDB `GET_LOCK` on one dedicated connection.
//!
//! The lock lives exactly as long as the connection that took it, so the connection is the lock:
//! - a session `wait_timeout` bounds how long the server keeps the lock of a silent connection, and is
//!   set so the server frees it only after the guard has noticed the silence and killed its app;
//! - between ownership checks a server-side `SLEEP` is always outstanding, so a `KILL` of the connection
//!   or a dead server is seen the instant the socket closes, not at the next check.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, OptsBuilder};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use super::farewell::{Server, SessionFarewell};
use super::record_table;
use super::watched::{CheckTiming, SessionHeld, SessionLock, SessionWatcher, Verdict};
use super::window_table::{self, Rows, SqlWindows, TableError, WindowDialect};
use super::{
    acquire_session, connect_failure, Acquisition, ClaimRequest, HeldLock, HolderInfo, LockError,
    LockRequest, SessionTry,
};
use crate::config::{LockName, MysqlTarget, RedactedUrl, Target, Timings};
use crate::deadline::Deadline;
use crate::holder::Holder;
use crate::record::{Fence, Previous, RecordFacts, RecordState};
use crate::window::{Claim, UnixMicros};

mod record;
mod session_end;
mod watcher;
mod windows;
pub use record::last_record;
use record::take_record;
pub use session_end::end_session;
use session_end::runs_our_check;
use watcher::watch;
use windows::ER_NO_SUCH_TABLE;
pub use windows::{last_claim, server_clock, MysqlWindows};

/// Server error codes that mean the server ended our session rather than refused one statement.
const ER_SERVER_SHUTDOWN: u16 = 1053;
const ER_CONNECTION_KILLED: u16 = 1927;
/// How often the side connection repeats `KILL QUERY` until the check answers.
const INTERRUPT_RETRY: Duration = Duration::from_millis(20);
/// How long the guard waits for a side connection that interrupts its own `SLEEP` at release.
const INTERRUPT_TIMEOUT: Duration = Duration::from_secs(1);
/// The largest packet the driver accepts, told instead of read from the server.
const DRIVER_PACKET_LIMIT: usize = 4 << 20;
/// The driver's idea of the server's `wait_timeout` (only its pool uses it; the guard has none).
const DRIVER_WAIT_TIMEOUT: usize = 28_800;
/// The server settings that make `GET_LOCK` unsafe as a singleton lock (`refuse_unsafe`). `SHOW`
/// names only the variables a server has: Galera's, Group Replication's and NDB's exist only where
/// they are built in or loaded.
const SAFETY_QUERY: &str = "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('read_only', \
     'super_read_only', 'wsrep_on', 'group_replication_single_primary_mode', 'ndb_version_string')";
/// `SAFETY_QUERY` on MariaDB, whose servers all have both variables (Galera support is built in;
/// it has neither `super_read_only`, Group Replication nor NDB), in the same rows: `SHOW` fills a
/// table of every variable the server has first, most of a millisecond on the path to the app's
/// start. A build without `wsrep_on` refuses it as unknown, and the session is set up one
/// statement at a time with `SAFETY_QUERY`. The values' width is given: a union's column takes the
/// first row's, and `CAST(.. AS CHAR)` of `read_only` is one character wide (`OFF` read `O`).
/// The version is guessed from its number: a server that only numbers itself like MariaDB (a
/// proxy's configured version) says so in the last row, and is asked `SAFETY_QUERY` after all.
const MARIADB_SAFETY_QUERY: &str = "SELECT 'read_only', CAST(@@global.read_only AS CHAR(64)) \
     UNION ALL SELECT 'wsrep_on', CAST(@@global.wsrep_on AS CHAR(64)) \
     UNION ALL SELECT 'mariadb', IF(@@version LIKE '%MariaDB%', 'yes', 'no')";

/// Whether an error says the server has ended the session (or the socket closed), rather than
/// refused one statement.
fn session_ended(e: &mysql_async::Error) -> bool {
    match e {
        mysql_async::Error::Server(s) => {
            matches!(s.code, ER_CONNECTION_KILLED | ER_SERVER_SHUTDOWN)
        }
        mysql_async::Error::Io(_) | mysql_async::Error::Driver(_) => true,
        _ => false,
    }
}

async fn connect(target: &MysqlTarget, connect_timeout: Duration) -> Result<Conn, LockError> {
    // Connect exactly where the URL says: the driver would otherwise switch to a local socket it
    // discovers on its own, which may be a different server. Given a packet limit and a wait timeout
    // of its own, the driver skips the query that reads the server's (a round trip on every start):
    // the guard's statements and answers are a few kilobytes, and it sets the session's
    // `wait_timeout` itself.
    let opts = OptsBuilder::from_opts(target.opts.clone())
        .prefer_socket(false)
        .max_allowed_packet(
            target
                .opts
                .max_allowed_packet()
                .or(Some(DRIVER_PACKET_LIMIT)),
        )
        .wait_timeout(target.opts.wait_timeout().or(Some(DRIVER_WAIT_TIMEOUT)));
    match timeout(connect_timeout, Conn::new(opts)).await {
        Err(_) => Err(LockError::Unreachable(format!(
            "no connection to {} within {}",
            target.url,
            crate::vocab::show_duration(connect_timeout)
        ))),
        Ok(Err(mysql_async::Error::Server(e))) => Err(LockError::Refused(format!(
            "{}: {}",
            target.url,
            target.url.scrub(e)
        ))),
        Ok(Err(e)) => Err(connect_failure(format!(
            "{}: {}",
            target.url,
            said_once(&target.url.scrub(e))
        ))),
        Ok(Ok(conn)) => Ok(conn),
    }
}

/// Any failure while setting up or taking the lock: the app is never started on such a server.
fn setup_error(target: &MysqlTarget, e: mysql_async::Error) -> LockError {
    LockError::Unreachable(format!(
        "{}: {}",
        target.url,
        said_once(&target.url.scrub(e))
    ))
}

/// The driver's message without the words its error layers each put first ("Input/output error:
/// Input/output error: Connection refused" reads "Input/output error: Connection refused").
fn said_once(message: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in message.split(": ") {
        if parts.last() != Some(&part) {
            parts.push(part);
        }
    }
    parts.join(": ")
}

/// Connects and makes the session fit to hold the lock: a safe server, and a `wait_timeout` that frees
/// the lock of a silent session only after this guard has stopped its app.
async fn open_session(target: &MysqlTarget, timings: &Timings) -> Result<Session, LockError> {
    let mut conn = connect(target, timings.connect_timeout).await?;
    let bounded = timings.connect_timeout;
    let wanted = timings.session_timeout_secs();
    // One bound for the whole set-up, however many statements it takes.
    let settled = timeout(bounded, async {
        match settle_at_once(&mut conn, wanted).await {
            Ok(answer) => Ok(answer),
            // The server family was guessed wrong, or a read was refused: one by one, each
            // statement says what it needs, and the process list read is optional.
            Err(mysql_async::Error::Server(e)) if SET_UP_ONE_BY_ONE.contains(&e.code) => {
                debug!(event = "session_setup_one_by_one", code = e.code, "the session's settings in one round trip were refused; setting them one by one");
                settle_one_by_one(&mut conn, target, wanted).await
            }
            Err(e) => Err(setup_error(target, e)),
        }
    });
    let (vars, kept, host) = settled
        .await
        .map_err(|_| no_answer(target, "the session settings", bounded))??;
    refuse_unsafe(vars)?;
    if kept != Some(wanted) {
        let kept = kept.map_or_else(|| "no value".to_owned(), |secs| format!("{secs}s"));
        return Err(LockError::Unsafe(format!(
            "the server keeps wait_timeout at {kept} instead of {wanted}s, so it could free the lock \
             of a silent connection before the guard stops the app (a proxy in between?)"
        )));
    }
    let ports = session_ports(host.as_deref(), target);
    Ok(Session { conn, ports })
}

/// A session of the guard's own, set up, and where its socket is (`session_ports`).
struct Session {
    conn: Conn,
    ports: Option<(u16, u16)>,
}

/// The server variables `SAFETY_QUERY` returns, the session's `wait_timeout` as read back, and the
/// session's `HOST` as the process list shows it.
type Settled = (Vec<(String, String)>, Option<u64>, Option<String>);

/// The session's own line of the process list: its client address and port.
const SESSION_HOST: &str =
    "SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = CONNECTION_ID()";

/// The session's settings, the server's safety and the setting read back in one round trip (the
/// driver allows several statements per query). A server-wide statement time limit would end the
/// check's deliberate `SLEEP` and look like a lost lock, so it is zeroed for the session; its name
/// depends on the server family (MariaDB's `max_statement_time`, MySQL's `max_execution_time`),
/// guessed from the version: MariaDB numbers itself 10 and up, MySQL 5, 8 and 9. A wrong guess is an
/// unknown variable, and nothing of the query has run; so is a MariaDB built without `wsrep_on`,
/// after the SET, which the one-by-one set-up makes again.
async fn settle_at_once(conn: &mut Conn, wanted: u64) -> Result<Settled, mysql_async::Error> {
    let mariadb = conn.server_version().0 >= 10;
    let (limit, safety) = if mariadb {
        ("max_statement_time", MARIADB_SAFETY_QUERY)
    } else {
        ("max_execution_time", SAFETY_QUERY)
    };
    let mut answer = conn
        .query_iter(format!(
            "SET SESSION wait_timeout = {wanted}, {limit} = 0, autocommit = 1; {safety}; \
             SELECT @@session.wait_timeout, ({SESSION_HOST})"
        ))
        .await?;
    // The SET's empty result, then the two that answer.
    answer.collect::<mysql_async::Row>().await?;
    let vars = answer.collect::<(String, String)>().await?;
    let read_back = answer.collect::<(Option<u64>, Option<String>)>().await?;
    answer.drop_result().await?;
    let (kept, host) = read_back.into_iter().next().unwrap_or_default();
    let said_mariadb = vars
        .iter()
        .any(|(name, value)| name == "mariadb" && value == "yes");
    if mariadb && !said_mariadb {
        return Ok((conn.query(SAFETY_QUERY).await?, kept, host));
    }
    Ok((vars, kept, host))
}

/// `settle_at_once`, one statement at a time, each statement time limit tried on its own.
async fn settle_one_by_one(
    conn: &mut Conn,
    target: &MysqlTarget,
    wanted: u64,
) -> Result<Settled, LockError> {
    let failed = |e| setup_error(target, e);
    let vars = conn.query(SAFETY_QUERY).await.map_err(failed)?;
    // Autocommit: the lock record is written on this session, and must be seen at once.
    let set = format!("SET SESSION wait_timeout = {wanted}, autocommit = 1");
    conn.query_drop(set).await.map_err(failed)?;
    let kept = conn
        .query_first("SELECT @@session.wait_timeout")
        .await
        .map_err(failed)?;
    for variable in ["max_statement_time", "max_execution_time"] {
        match conn.query_drop(format!("SET SESSION {variable} = 0")).await {
            Err(mysql_async::Error::Server(e)) if e.code == ER_UNKNOWN_SYSTEM_VARIABLE => {}
            Err(e) => return Err(setup_error(target, e)),
            Ok(()) => {}
        }
    }
    // Read last, when no statement limit is left to cut it short. The client port lets the
    // watchdog keep a copy of this session's socket, so that a guard that dies frees the lock only
    // once the app's tree is gone; a server that will not show its process list still holds the
    // lock safely while the guard lives, and the lost protection is said.
    let host = match conn.query_first::<Option<String>, _>(SESSION_HOST).await {
        Ok(host) => host.flatten(),
        Err(mysql_async::Error::Server(e)) => {
            warn!(event = "session_port_unknown", code = e.code, error = %target.url.scrub(&e.message), "cannot read this session's client port from the process list; should the guard die, the server may free the lock before the app's tree is gone");
            None
        }
        Err(e) => return Err(setup_error(target, e)),
    };
    Ok((vars, kept, host))
}

/// What makes the session's settings in one round trip fail where one statement at a time can
/// still succeed: the other server family's setting, a read refused or missing (the process list).
const SET_UP_ONE_BY_ONE: [u16; 6] = [ER_UNKNOWN_SYSTEM_VARIABLE, 1044, 1109, 1142, 1146, 1227];

/// One statement of a session's set-up, `what` within `limit`: no answer and an error are both
/// the server's failure to set up.
async fn set_up<T>(
    (target, what, limit): (&MysqlTarget, &str, Duration),
    statement: impl Future<Output = Result<T, mysql_async::Error>>,
) -> Result<T, LockError> {
    timeout(limit, statement)
        .await
        .map_err(|_| no_answer(target, what, limit))?
        .map_err(|e| setup_error(target, e))
}

/// MySQL's "Unknown system variable": the other server family's setting.
const ER_UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;

fn no_answer(target: &MysqlTarget, what: &str, limit: Duration) -> LockError {
    LockError::Unreachable(format!(
        "{}: no answer to {what} within {}",
        target.url,
        crate::vocab::show_duration(limit)
    ))
}

pub async fn acquire(
    target: &MysqlTarget,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    acquire_session(&MysqlTry { target, request }, request).await
}

/// MySQL's part of taking the lock: `GET_LOCK` on a session of the guard's own.
struct MysqlTry<'a> {
    target: &'a MysqlTarget,
    request: &'a LockRequest<'a>,
}

impl SessionTry for MysqlTry<'_> {
    type Session = Session;
    /// The session's id, as `CONNECTION_ID()` says it.
    type Grant = u64;

    fn url(&self) -> &RedactedUrl {
        &self.target.url
    }

    async fn open(&self) -> Result<Session, LockError> {
        open_session(self.target, self.request.timings).await
    }

    async fn try_once(
        &self,
        session: &mut Session,
        chunk: Duration,
        budget: Duration,
    ) -> Result<Option<u64>, LockError> {
        let (target, conn) = (self.target, &mut session.conn);
        // A text query: a prepared statement would cost a round trip more, and names are limited
        // to characters that need no quoting.
        // With the server's role read in the same statement: a standby's session lives for as long
        // as it waits, and a server demoted meanwhile grants the name locally while the new
        // primary grants it to anyone.
        // And the session's id as the server counts it: the handshake's is only its low 32 bits.
        let asked = conn.query_first::<(Option<i64>, Option<i64>, u64), _>(format!(
            "SELECT GET_LOCK('{}', {:.3}), CAST(@@global.read_only AS CHAR) NOT IN ('0', 'OFF'), \
             CONNECTION_ID()",
            self.request.name.as_str(),
            chunk.as_secs_f64()
        ));
        match timeout(budget, asked).await {
            Err(_) => Err(no_answer(target, "GET_LOCK", budget)),
            Ok(Err(e)) => Err(setup_error(target, e)),
            // Dropping the session gives back a lock it may have been granted; reopening it finds
            // the server refused.
            Ok(Ok(Some((_, read_only, _)))) if read_only != Some(0) => Err(LockError::Unsafe(format!(
                "{}: @@global.read_only is ON: the server was demoted from primary while the guard waited; point --url at the primary",
                target.url
            ))),
            Ok(Ok(Some((Some(1), _, session_id)))) => Ok(Some(session_id)),
            Ok(Ok(Some((Some(0), _, _)))) => Ok(None),
            Ok(Ok(answer)) => Err(LockError::Unsafe(format!(
                "{}: GET_LOCK answered {} instead of 0 or 1",
                target.url,
                match answer {
                    None => "no row".to_owned(),
                    Some((None, _, _)) => "NULL".to_owned(),
                    Some((Some(other), _, _)) => other.to_string(),
                }
            ))),
        }
    }

    async fn hold(
        &self,
        session: Session,
        session_id: u64,
        granted_by: Deadline,
    ) -> Result<HeldLock, LockError> {
        let (target, request) = (self.target, self.request);
        let Session { mut conn, ports } = session;
        // A record that cannot be taken, or a session cut off mid-statement, is a failed
        // acquisition: closing the session gives the lock back before any app started.
        let record = take_record(&mut conn, target, request).await?;
        info!(
            event = "lock_acquired",
            connection_id = session_id,
            wait_timeout_secs = request.timings.session_timeout_secs(),
            server_version = %version(&conn),
            fencing_token = record.1,
            previous = %record.0.reason(),
            "mysql lock acquired"
        );
        Ok(watch(
            conn,
            session_id,
            target,
            request,
            (granted_by, ports),
            record,
        ))
    }

    async fn holder(&self, session: &mut Session) -> (HolderInfo, Result<(), LockError>) {
        let limit = self.request.timings.check_timeout;
        let (holder, answered) =
            describe_holder(&mut session.conn, self.request.name.as_str(), limit).await;
        let usable = if answered {
            Ok(())
        } else {
            Err(no_answer(self.target, "the holder's description", limit))
        };
        (holder, usable)
    }

    async fn close(&self, session: Session) {
        let _ = timeout(
            self.request.timings.check_timeout,
            session.conn.disconnect(),
        )
        .await;
    }
}

/// The session's client port as the server sees it (from its `HOST`, `address:port`), and the
/// server's port: what finds the session's socket for the watchdog's copy. None where the server
/// does not say (the copy is then not made).
fn session_ports(host: Option<&str>, target: &MysqlTarget) -> Option<(u16, u16)> {
    let client = host?.rsplit(':').next()?.parse().ok()?;
    Some((client, target.opts.tcp_port()))
}

/// Who holds `name` now, without taking it.
pub async fn status(
    target: &MysqlTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<HolderInfo>, LockError> {
    let mut conn = connect(target, connect_limit).await?;
    let id = holder_connection(&mut conn, name.as_str(), answer)
        .await
        .map_err(|e| match e {
            Some(e) => setup_error(target, e),
            None => no_answer(target, "IS_USED_LOCK", answer),
        })?;
    let holder = match id {
        Some(id) => Some(describe_connection(&mut conn, id, answer).await.0),
        None => None,
    };
    let _ = timeout(answer, conn.disconnect()).await;
    Ok(holder)
}

fn version(conn: &Conn) -> String {
    let (major, minor, patch) = conn.server_version();
    format!("{major}.{minor}.{patch}")
}

/// `GET_LOCK` on a read-only replica, a Galera node, a member of a multi-primary Group Replication
/// group or an NDB SQL node does not make a cluster-wide singleton: there the lock is local to one
/// node, and another node grants the same name.
fn refuse_unsafe(vars: Vec<(String, String)>) -> Result<(), LockError> {
    for (variable, value) in vars {
        let upper = value.to_ascii_uppercase();
        let on = matches!(upper.as_str(), "ON" | "1");
        let refuse = |why: String| Err(LockError::Unsafe(why));
        match variable.to_ascii_lowercase().as_str() {
            // Any level but OFF refuses writes (MariaDB 11 made read_only a list of levels), as
            // the check reads it.
            "read_only" | "super_read_only" if !matches!(upper.as_str(), "OFF" | "0") => {
                return refuse(format!(
                    "@@global.{variable}=ON: this is a replica or reader endpoint; point --url at the primary"
                ))
            }
            "wsrep_on" if on => {
                return refuse(
                    "wsrep_on=ON: on Galera/PXC, GET_LOCK is local to one node (or an error), so two nodes can each grant it"
                        .to_owned(),
                )
            }
            "group_replication_single_primary_mode" if matches!(upper.as_str(), "OFF" | "0") => {
                return refuse(
                    "group_replication_single_primary_mode=OFF: in a multi-primary group GET_LOCK is local to one member, so two members can each grant it"
                        .to_owned(),
                )
            }
            "ndb_version_string" if !value.is_empty() => {
                return refuse(format!(
                    "this is an NDB Cluster SQL node ({value}): GET_LOCK is local to one SQL node, so two nodes can each grant it"
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// The connection id holding `name`, or `None` when it is free. `Err(None)` is a timeout.
async fn holder_connection(
    conn: &mut Conn,
    name: &str,
    limit: Duration,
) -> Result<Option<u64>, Option<mysql_async::Error>> {
    match timeout(
        limit,
        conn.exec_first::<Option<u64>, _, _>("SELECT IS_USED_LOCK(?)", (name,)),
    )
    .await
    {
        Ok(Ok(id)) => Ok(id.flatten()),
        Ok(Err(e)) => Err(Some(e)),
        Err(_) => Err(None),
    }
}

/// Says who holds `name`, as far as this account can see, and whether every statement was answered
/// in time: when one was not, `conn` must not be queried again (see `session_ports`).
async fn describe_holder(conn: &mut Conn, name: &str, limit: Duration) -> (HolderInfo, bool) {
    match holder_connection(conn, name, limit).await {
        Ok(Some(id)) => describe_connection(conn, id, limit).await,
        Ok(None) => (
            HolderInfo::default().with("holder", "unknown (released while being looked up)"),
            true,
        ),
        Err(e) => (
            HolderInfo::default().with("holder", "unknown (the lookup failed)"),
            e.is_some(),
        ),
    }
}

/// The holder's connection id, its account from the process list, and the guard identity its
/// outstanding check query carries in a comment; and whether the server answered in time.
async fn describe_connection(conn: &mut Conn, id: u64, limit: Duration) -> (HolderInfo, bool) {
    let answer = timeout(
        limit,
        conn.exec_first::<(String, String, u64, Option<String>), _, _>(
            "SELECT USER, HOST, TIME, INFO FROM information_schema.PROCESSLIST WHERE ID = ?",
            (id,),
        ),
    )
    .await;
    let answered = answer.is_ok();
    let info = HolderInfo::default().with("connection_id", id);
    let info = match answer.ok().and_then(Result::ok).flatten() {
        Some((user, client, seconds, query)) => info
            .with("user", user)
            .with("client", client)
            .with("command_secs", seconds)
            .with_guard(query.as_deref().and_then(Holder::parse)),
        None => info.with("processlist", "not visible to this account"),
    };
    (info, answered)
}
