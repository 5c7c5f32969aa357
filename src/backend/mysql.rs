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
use super::{
    connect_failure, reopen, Acquisition, Backoff, ClaimAnswer, ClaimRequest, Contention, HeldLock,
    HolderInfo, LockError, LockRequest, WindowStore,
};
use crate::config::{LockName, MysqlTarget, Target, Timings};
use crate::deadline::Deadline;
use crate::holder::Holder;
use crate::record::{Fence, Previous, RecordFacts, RecordState};
use crate::window::{Claim, RunEnd, RunExit, UnixMicros};

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
/// The server settings that make `GET_LOCK` unsafe as a singleton lock (`refuse_unsafe`).
const SAFETY_QUERY: &str = "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('read_only', \
     'super_read_only', 'wsrep_on', 'group_replication_single_primary_mode', 'ndb_version_string')";

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
async fn open_session(target: &MysqlTarget, timings: &Timings) -> Result<Conn, LockError> {
    let mut conn = connect(target, timings.connect_timeout).await?;
    let bounded = timings.connect_timeout;
    let wanted = timings.session_timeout_secs();
    let (vars, kept) = match timeout(bounded, settle_at_once(&mut conn, wanted)).await {
        Err(_) => return Err(no_answer(target, "the session settings", bounded)),
        Ok(Ok(answer)) => answer,
        // The server family was guessed wrong: the settings one by one.
        Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_UNKNOWN_SYSTEM_VARIABLE => {
            settle_one_by_one(&mut conn, target, wanted, bounded).await?
        }
        Ok(Err(e)) => return Err(setup_error(target, e)),
    };
    refuse_unsafe(vars)?;
    if kept != Some(wanted) {
        return Err(LockError::Unsafe(format!(
            "the server keeps wait_timeout at {kept:?} instead of {wanted}s, so it could free the lock \
             of a silent connection before the guard stops the app (a proxy in between?)"
        )));
    }
    Ok(conn)
}

/// The server variables `SAFETY_QUERY` returns, and the session's `wait_timeout` as read back.
type Settled = (Vec<(String, String)>, Option<u64>);

/// The session's settings, the server's safety and the setting read back in one round trip (the
/// driver allows several statements per query). A server-wide statement time limit would end the
/// check's deliberate `SLEEP` and look like a lost lock, so it is zeroed for the session; its name
/// depends on the server family (MariaDB's `max_statement_time`, MySQL's `max_execution_time`),
/// guessed from the version: MariaDB numbers itself 10 and up, MySQL 5, 8 and 9. A wrong guess is an
/// unknown variable, and nothing of the query has run.
async fn settle_at_once(conn: &mut Conn, wanted: u64) -> Result<Settled, mysql_async::Error> {
    let limit = if conn.server_version().0 >= 10 {
        "max_statement_time"
    } else {
        "max_execution_time"
    };
    let mut answer = conn
        .query_iter(format!(
            "SET SESSION wait_timeout = {wanted}, {limit} = 0, autocommit = 1; {SAFETY_QUERY}; \
             SELECT @@session.wait_timeout"
        ))
        .await?;
    // The SET's empty result, then the two that answer.
    answer.collect::<mysql_async::Row>().await?;
    let vars = answer.collect::<(String, String)>().await?;
    let kept = answer.collect::<Option<u64>>().await?;
    answer.drop_result().await?;
    Ok((vars, kept.into_iter().next().flatten()))
}

/// `settle_at_once`, one statement at a time, each statement time limit tried on its own.
async fn settle_one_by_one(
    conn: &mut Conn,
    target: &MysqlTarget,
    wanted: u64,
    bounded: Duration,
) -> Result<Settled, LockError> {
    let step = |what| (target, what, bounded);
    let vars = set_up(step("SHOW GLOBAL VARIABLES"), conn.query(SAFETY_QUERY)).await?;
    // Autocommit: the lock record is written on this session, and must be seen at once.
    let set = format!("SET SESSION wait_timeout = {wanted}, autocommit = 1");
    set_up(step("SET SESSION wait_timeout"), conn.query_drop(set)).await?;
    let read_back = conn.query_first("SELECT @@session.wait_timeout");
    let kept = set_up(step("SELECT @@session.wait_timeout"), read_back).await?;
    for variable in ["max_statement_time", "max_execution_time"] {
        let set = format!("SET SESSION {variable} = 0");
        match timeout(bounded, conn.query_drop(&set)).await {
            Err(_) => return Err(no_answer(target, &set, bounded)),
            Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_UNKNOWN_SYSTEM_VARIABLE => {}
            Ok(Err(e)) => return Err(setup_error(target, e)),
            Ok(Ok(())) => {}
        }
    }
    Ok((vars, kept))
}

/// One statement of the session's set-up, `what` within `limit`: no answer and an error are both
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

/// Not an answer `GET_LOCK` gives: stands for a grant (or a refusal) on a server that is read-only.
const READ_ONLY_GRANT: i64 = -1;

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
    let timings = request.timings;
    let patience = request.patience;
    let name = request.name.as_str();
    let mut conn = open_session(target, timings).await?;
    let mut contention = Contention::new(&**request.observer);
    let mut backoff = Backoff::new();
    loop {
        let chunk = contention.next_wait(patience);
        let sent = Deadline::now();
        let budget = chunk + timings.check_timeout;
        // A text query: a prepared statement would cost a round trip more, and names are limited
        // to characters that need no quoting.
        // With the server's role read in the same statement: a standby's session lives for as long
        // as it waits, and a server demoted meanwhile grants the name locally while the new
        // primary grants it to anyone.
        let got = timeout(
            budget,
            conn.query_first::<(Option<i64>, Option<i64>), _>(format!(
                "SELECT GET_LOCK('{name}', {:.3}), \
                 CAST(@@global.read_only AS CHAR) NOT IN ('0', 'OFF')",
                chunk.as_secs_f64()
            )),
        )
        .await
        .map(|answer| {
            answer.map(|row| match row {
                Some((granted, Some(0))) => Some(granted),
                Some((_, _)) => Some(Some(READ_ONLY_GRANT)),
                None => None,
            })
        });
        let error = match got {
            // Dropping the session gives back a lock it may have been granted; reopening it finds
            // the server refused.
            Ok(Ok(Some(Some(READ_ONLY_GRANT)))) => LockError::Unsafe(format!(
                "{}: @@global.read_only is ON: the server was demoted from primary while the guard waited; point --url at the primary",
                target.url
            )),
            // Granted, but read after a freeze: the server may have ended the silent session and
            // granted the lock elsewhere since. Dropping the connection gives it back.
            Ok(Ok(Some(Some(1)))) if sent.elapsed() > budget => LockError::Unreachable(format!(
                "{}: GET_LOCK answered after {}, too late to rely on; the session is closed",
                target.url,
                crate::vocab::show_duration(
                    Duration::from_millis(sent.elapsed().as_millis() as u64)
                )
            )),
            Ok(Ok(Some(Some(1)))) => {
                // A record that cannot be taken, or a session cut off mid-statement, is a failed
                // acquisition: closing the session gives the lock back before any app started.
                let taken = match session_ports(&mut conn, target, timings.check_timeout).await {
                    Ok(ports) => take_record(&mut conn, target, request)
                        .await
                        .map(|record| (ports, record)),
                    Err(e) => Err(e),
                };
                match taken {
                    Ok((ports, record)) => {
                        info!(
                            event = "lock_acquired",
                            connection_id = conn.id(),
                            wait_timeout_secs = timings.session_timeout_secs(),
                            server_version = %version(&conn),
                            fencing_token = record.1,
                            previous = %record.0.reason(),
                            "mysql lock acquired"
                        );
                        return Ok(Acquisition::Acquired(watch(
                            conn,
                            target,
                            request,
                            (sent + chunk, ports),
                            record,
                        )));
                    }
                    Err(e) => e,
                }
            }
            Ok(Ok(Some(Some(0)))) if patience.exhausted() => {
                let (holder, _) = describe_holder(&mut conn, name, timings.check_timeout).await;
                let _ = timeout(timings.check_timeout, conn.disconnect()).await;
                return Ok(contention.give_up(holder));
            }
            Ok(Ok(Some(Some(0)))) => {
                let answered = if contention.log_due() {
                    let (holder, answered) =
                        describe_holder(&mut conn, name, timings.check_timeout).await;
                    contention.waiting(&holder);
                    answered
                } else {
                    true
                };
                if answered {
                    backoff.reset();
                    continue;
                }
                no_answer(target, "the holder's description", timings.check_timeout)
            }
            Ok(Ok(other)) => {
                LockError::Unsafe(format!("GET_LOCK returned {other:?} instead of 0 or 1"))
            }
            Ok(Err(e)) => setup_error(target, e),
            Err(_) => no_answer(target, "GET_LOCK", chunk + timings.check_timeout),
        };
        // Fail closed at start; a standby whose own session failed reconnects with backoff. Closing
        // the failed session first gives back a lock it may have been granted.
        drop(conn);
        conn = reopen(error, patience, &mut backoff, || {
            open_session(target, timings)
        })
        .await?;
    }
}

/// The session's client port as the server sees it, and the server's port: what finds the session's
/// socket for the watchdog's copy. None where the server does not say (the copy is then not made).
/// No answer in time is an error: a statement cut off by its bound leaves its answer unread on the
/// session, where the next statement would read it as its own (the driver panics on a row of
/// another shape), so the session must not be used again.
async fn session_ports(
    conn: &mut Conn,
    target: &MysqlTarget,
    limit: Duration,
) -> Result<Option<(u16, u16)>, LockError> {
    let host = timeout(
        limit,
        conn.query_first::<Option<String>, _>(
            "SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = CONNECTION_ID()",
        ),
    )
    .await
    .map_err(|_| no_answer(target, "the session's client port", limit))?;
    let port = || {
        let client = host.ok()???.rsplit(':').next()?.parse().ok()?;
        Some((client, target.opts.tcp_port()))
    };
    Ok(port())
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

/// `KILL CONNECTION` of the dead guard's session, from a new session, if that session still holds
/// the lock and runs the dead guard's check (see `SessionFarewell`). Run in the watchdog.
pub fn end_session(farewell: &SessionFarewell) -> Result<String, String> {
    let target = match farewell.target()? {
        Target::Mysql(target) => target,
        _ => return Err("not a mysql:// URL".to_owned()),
    };
    farewell.on_runtime(async {
        let mut conn = connect(&target, farewell.timeout)
            .await
            .map_err(|e| e.to_string())?;
        let result = end_on(farewell, &mut conn, &target).await;
        let _ = timeout(farewell.timeout, conn.disconnect()).await;
        result
    })
}

async fn end_on(
    farewell: &SessionFarewell,
    conn: &mut Conn,
    target: &MysqlTarget,
) -> Result<String, String> {
    let ours = runs_our_check(
        conn,
        &farewell.name,
        farewell.session_id,
        &farewell.holder_id,
        farewell.timeout,
    )
    .await
    .map_err(|e| match e {
        Some(e) => target.url.scrub(e),
        None => "no answer to the session's proof".to_owned(),
    })?;
    // The tree is gone (the watchdog says farewell only then): a record still held by the dead
    // guard says so, whether or not its session still holds the lock. One the next holder wrote
    // is not the dead guard's, and is left as it is.
    let marked = timeout(
        farewell.timeout,
        conn.query_drop(record_table::mark_sql(
            &farewell.name,
            &farewell.holder_id,
            RecordState::TreeGone,
        )),
    )
    .await;
    match marked {
        Ok(Ok(())) => {}
        Ok(Err(_)) => debug!("the dead guard's lock record could not be marked tree_gone"),
        // Its answer is still unread on this session, where the KILL would read it as its own.
        Err(_) => {
            return Err(format!(
                "no answer within {} while marking the lock record tree_gone",
                crate::vocab::show_duration(farewell.timeout)
            ))
        }
    }
    if !ours {
        return Ok(format!(
            "left connection {}: it no longer holds the lock while running the dead guard's check",
            farewell.session_id
        ));
    }
    let kill = format!("KILL CONNECTION {}", farewell.session_id);
    match timeout(farewell.timeout, conn.query_drop(kill)).await {
        Err(_) => Err(format!(
            "no answer within {}",
            crate::vocab::show_duration(farewell.timeout)
        )),
        Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_NO_SUCH_THREAD => Ok(format!(
            "connection {} had already ended",
            farewell.session_id
        )),
        Ok(Err(e)) => Err(target.url.scrub(e)),
        Ok(Ok(())) => Ok(format!("ended connection {}", farewell.session_id)),
    }
}

/// Whether connection `id` of the server `conn` reaches holds `name` and is running the check of
/// the guard `holder_id` (its comment names the holder): the proof that the number is the lock's
/// session, and not a stranger's that got the same id after a restart, or on another server behind
/// a proxy or a moved address. Only then may it be interrupted or ended. `Err(None)` is a timeout.
async fn runs_our_check(
    conn: &mut Conn,
    name: &str,
    id: u64,
    holder_id: &str,
    limit: Duration,
) -> Result<bool, Option<mysql_async::Error>> {
    let ours = format!("holder_id={holder_id} ");
    let proof = conn.exec_first::<Option<i64>, _, _>(
        "SELECT IS_USED_LOCK(?) = ? AND EXISTS (SELECT 1 FROM information_schema.PROCESSLIST \
         WHERE ID = ? AND INSTR(INFO, ?) > 0)",
        (name, id, id, ours),
    );
    match timeout(limit, proof).await {
        Err(_) => Err(None),
        Ok(Err(e)) => Err(Some(e)),
        Ok(Ok(answer)) => Ok(answer.flatten() == Some(1)),
    }
}

/// MariaDB's "Unknown thread id": the session had already ended.
const ER_NO_SUCH_THREAD: u16 = 1094;

/// A held `GET_LOCK`: a task owns the connection and keeps proving ownership until it is told to
/// release or finds the lock gone.
fn watch(
    conn: Conn,
    target: &MysqlTarget,
    request: &LockRequest<'_>,
    asked: (Deadline, Option<(u16, u16)>),
    (previous, fence, recorded): (Previous, u64, bool),
) -> HeldLock {
    let farewell = SessionFarewell {
        server: Server::Mysql,
        url: target.secret.clone(),
        session_id: u64::from(conn.id()),
        revision: 0,
        name: request.name.as_str().to_owned(),
        holder_id: request.holder.id.clone(),
        timeout: request.timings.connect_timeout,
        ca_file: target.ca_file.clone(),
    }
    .encode();
    let connection_id = conn.id();
    let watcher = Watcher {
        conn_id: conn.id(),
        name: request.name.as_str().to_owned(),
        holder_id: request.holder.id.clone(),
        target: target.clone(),
        check_sql: check_sql(request),
        release_sql: format!("SELECT RELEASE_LOCK('{}')", request.name.as_str()),
        released_sql: recorded.then(|| {
            record_table::mark_sql(
                request.name.as_str(),
                &request.holder.id,
                RecordState::Released,
            )
        }),
        timing: CheckTiming::of(request),
    };
    HeldLock::new(SessionHeld {
        session: SessionLock::spawn(watcher, conn, farewell, Some(fence), asked),
        previous,
        windows: MysqlWindows {
            target: Box::new(target.clone()),
            connection_id,
        },
    })
}

/// What scheduled runs need to claim windows under a held `GET_LOCK`.
pub struct MysqlWindows {
    /// Where scheduled runs record their windows, on a connection of their own: the lock's
    /// connection is busy with the ownership check.
    target: Box<MysqlTarget>,
    /// The lock's session, which a window claim proves still holds the lock (`IS_USED_LOCK`).
    connection_id: u32,
}

#[async_trait]
impl WindowStore for MysqlWindows {
    /// Claims the window on a session of its own (the lock's session is busy with its check).
    async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        let timings = request.timings;
        let mut conn =
            windows_session(&self.target, timings.connect_timeout, timings.check_timeout).await?;
        let answer = self.claim_on(&mut conn, request).await;
        let _ = timeout(timings.check_timeout, conn.disconnect()).await;
        answer
    }

    async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError> {
        let target = &self.target;
        let timings = request.timings;
        let limit = timings.check_timeout;
        let mut conn = windows_session(target, timings.connect_timeout, limit).await?;
        let update = conn.exec_drop(
            "UPDATE sentinel_guard_windows SET finished_at = NOW(6), exit_code = ? \
             WHERE name = ? AND window_start = FROM_UNIXTIME(?) AND holder = ?",
            (
                exit.stored(),
                request.name.as_str(),
                request.window.start / 1_000_000,
                &request.holder.id,
            ),
        );
        let done = timeout(limit, update).await;
        let _ = timeout(limit, conn.disconnect()).await;
        match done {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(windows_error(target, e)),
            Err(_) => Err(no_answer(target, "UPDATE sentinel_guard_windows", limit)),
        }
    }
}

impl MysqlWindows {
    async fn claim_on(
        &self,
        conn: &mut Conn,
        request: &ClaimRequest<'_>,
    ) -> Result<ClaimAnswer, LockError> {
        let (target, limit) = (&self.target, request.timings.check_timeout);
        let name = request.name.as_str();
        // Only the lock's holder writes claims, so what is read here stays true until the insert,
        // which proves the lock again.
        let last = read_last_claim(conn, name, limit)
            .await
            .map_err(|e| query_error(target, "SELECT FROM sentinel_guard_windows", limit, e))?;
        if let Some(blocked) = ClaimAnswer::blocked_by(last.as_ref(), request.window) {
            return Ok(blocked);
        }
        // This window's own claim, whose command never started: it holds nothing, and its row
        // goes for the new one (no proof needed to remove what blocks nothing).
        if last
            .as_ref()
            .is_some_and(|last| last.window_start == request.window.start)
        {
            let delete = conn.exec_drop(
                "DELETE FROM sentinel_guard_windows \
                 WHERE name = ? AND window_start = FROM_UNIXTIME(?) AND exit_code < 0",
                (name, request.window.start / 1_000_000),
            );
            match timeout(limit, delete).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(windows_error(target, e)),
                Err(_) => {
                    return Err(no_answer(
                        target,
                        "DELETE FROM sentinel_guard_windows",
                        limit,
                    ))
                }
            }
        }
        let inserted = match self.insert_claim(conn, request).await? {
            Insert::NoTable => {
                create_windows_table(conn, target, limit).await?;
                self.insert_claim(conn, request).await?
            }
            done => done,
        };
        if inserted == Insert::Done {
            prune_windows(conn, name, limit).await;
            return Ok(ClaimAnswer::Ours);
        }
        Ok(ClaimAnswer::NotNow(
            "the lock's session no longer proves the lock, or the server's clock is outside the window",
        ))
    }

    /// The row goes in only while the lock's own session holds the lock (`IS_USED_LOCK`, and that
    /// session still runs this guard's check: after a server restart the id could be a stranger's)
    /// and while the server's clock is inside the window; the primary key refuses a second claim.
    async fn insert_claim(
        &self,
        conn: &mut Conn,
        request: &ClaimRequest<'_>,
    ) -> Result<Insert, LockError> {
        let (target, limit) = (&self.target, request.timings.check_timeout);
        let name = request.name.as_str();
        let window = request.window;
        let insert = conn.exec_iter(
            "INSERT IGNORE INTO sentinel_guard_windows (name, window_start, holder, host, claimed_at) \
             SELECT ?, FROM_UNIXTIME(?), ?, ?, NOW(6) FROM DUAL \
             WHERE IS_USED_LOCK(?) = ? \
             AND (SELECT INFO FROM information_schema.PROCESSLIST WHERE ID = ?) LIKE ? \
             AND UNIX_TIMESTAMP(NOW(6)) >= ? AND UNIX_TIMESTAMP(NOW(6)) < ?",
            (
                name,
                window.start / 1_000_000,
                &request.holder.id,
                &request.holder.host,
                name,
                self.connection_id,
                self.connection_id,
                format!("%holder_id={} %", request.holder.id),
                window.start / 1_000_000,
                window.end / 1_000_000,
            ),
        );
        match timeout(limit, async {
            Ok::<_, mysql_async::Error>(insert.await?.affected_rows())
        })
        .await
        {
            Ok(Ok(1)) => Ok(Insert::Done),
            Ok(Ok(_)) => Ok(Insert::Refused),
            Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_NO_SUCH_TABLE => {
                Ok(Insert::NoTable)
            }
            Ok(Err(e)) => Err(windows_error(target, e)),
            Err(_) => Err(no_answer(
                target,
                "INSERT INTO sentinel_guard_windows",
                limit,
            )),
        }
    }
}

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
async fn take_record(
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
        type Found = (
            Option<String>,
            Option<u64>,
            Option<u64>,
            Option<u64>,
            Option<String>,
            String,
        );
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
    let (state, bound_ms, token, drawn_us, written_by, server) = found;
    let found = state.map(|state| record_table::Row {
        state,
        bound_ms: bound_ms.unwrap_or(0),
        fence: Fence {
            token: token.unwrap_or(0),
            drawn_us: drawn_us.unwrap_or(0),
        },
        same_server: written_by.as_deref() == Some(server.as_str()),
    });
    // Host names are letters, digits, dots and dashes; anything else is kept out of the literal.
    let server: String = server
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || ".-_:# ".contains(*c))
        .collect();
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

/// The table of claimed windows, created on first use in the URL's database.
const WINDOWS_TABLE: &str = "CREATE TABLE IF NOT EXISTS sentinel_guard_windows (\
name VARCHAR(64) NOT NULL, \
window_start DATETIME(6) NOT NULL, \
holder VARCHAR(64) NOT NULL, \
host VARCHAR(255) NOT NULL, \
claimed_at DATETIME(6) NOT NULL, \
finished_at DATETIME(6) NULL, \
exit_code SMALLINT NULL, \
PRIMARY KEY (name, window_start))";

/// Rows kept per lock name: enough to outlast every window, few enough to stay small.
const WINDOWS_KEPT: u32 = 100;
const ER_NO_SUCH_TABLE: u16 = 1146;

#[derive(Debug, PartialEq, Eq)]
enum Insert {
    Done,
    /// The proof failed: the lock or the window no longer fits.
    Refused,
    NoTable,
}

/// A session for the windows table: in UTC, so `FROM_UNIXTIME` and `UNIX_TIMESTAMP` are exact, and
/// with autocommit on whatever the server's default, so a claim is stored the moment it is made.
async fn windows_session(
    target: &MysqlTarget,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Conn, LockError> {
    let mut conn = connect(target, connect_limit).await?;
    let set = "SET time_zone = '+00:00', autocommit = 1";
    timeout(answer, conn.query_drop(set))
        .await
        .map_err(|_| no_answer(target, set, answer))?
        .map_err(|e| windows_error(target, e))?;
    Ok(conn)
}

/// A server's error on the windows table (missing grant, read-only server) will not mend by itself:
/// it is a refusal, which stops a scheduler; a dropped connection is the backend being unreachable,
/// which the job's `--if-unavailable` policy handles.
fn windows_error(target: &MysqlTarget, e: mysql_async::Error) -> LockError {
    match e {
        mysql_async::Error::Server(e) => {
            LockError::Refused(format!("{}: {}", target.url, target.url.scrub(e)))
        }
        e => setup_error(target, e),
    }
}

fn query_error(
    target: &MysqlTarget,
    what: &str,
    limit: Duration,
    e: Option<mysql_async::Error>,
) -> LockError {
    match e {
        Some(e) => windows_error(target, e),
        None => no_answer(target, what, limit),
    }
}

/// Creates the windows table, or says exactly what an administrator must run once.
async fn create_windows_table(
    conn: &mut Conn,
    target: &MysqlTarget,
    limit: Duration,
) -> Result<(), LockError> {
    match timeout(limit, conn.query_drop(WINDOWS_TABLE)).await {
        Ok(Ok(())) => {
            info!(
                event = "windows_table_created",
                "created table sentinel_guard_windows for scheduled runs"
            );
            Ok(())
        }
        Ok(Err(e)) => {
            let db = target.opts.db_name().unwrap_or("<database>");
            let user = target.opts.user().unwrap_or("<user>");
            Err(LockError::Refused(format!(
                "{}: cannot create the table of scheduled windows ({}). Run this once as an administrator \
                 in database `{db}`: {WINDOWS_TABLE}; and grant the guard's user: \
                 GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.`sentinel_guard_windows` TO '{user}'@'%';",
                target.url,
                target.url.scrub(e)
            )))
        }
        Err(_) => Err(no_answer(
            target,
            "CREATE TABLE sentinel_guard_windows",
            limit,
        )),
    }
}

/// Keeps the newest rows of `name`; a failure only leaves more rows behind, so it is logged, not fatal.
async fn prune_windows(conn: &mut Conn, name: &str, limit: Duration) {
    let delete = conn.exec_drop(
        format!(
            "DELETE FROM sentinel_guard_windows WHERE name = ? AND window_start < \
             (SELECT window_start FROM (SELECT window_start FROM sentinel_guard_windows WHERE name = ? \
             ORDER BY window_start DESC LIMIT 1 OFFSET {}) AS kept)",
            WINDOWS_KEPT - 1
        ),
        (name, name),
    );
    match timeout(limit, delete).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            warn!(event = "windows_prune_failed", error = %e, "cannot delete old rows of sentinel_guard_windows")
        }
        Err(_) => warn!(
            event = "windows_prune_failed",
            "no answer while deleting old rows of sentinel_guard_windows"
        ),
    }
}

/// The newest claimed window of `name`; `None` without the table (nothing was ever scheduled).
/// A query error is `Err(Some)`, silence `Err(None)`.
async fn read_last_claim(
    conn: &mut Conn,
    name: &str,
    limit: Duration,
) -> Result<Option<Claim>, Option<mysql_async::Error>> {
    type Row = (i64, String, String, i64, Option<i64>, Option<i64>);
    let query = conn.exec_first::<Row, _, _>(
        "SELECT CAST(UNIX_TIMESTAMP(window_start) * 1000000 AS SIGNED), holder, host, \
         CAST(UNIX_TIMESTAMP(claimed_at) * 1000000 AS SIGNED), \
         CAST(UNIX_TIMESTAMP(finished_at) * 1000000 AS SIGNED), exit_code \
         FROM sentinel_guard_windows WHERE name = ? ORDER BY window_start DESC LIMIT 1",
        (name,),
    );
    let row = match timeout(limit, query).await {
        Ok(Ok(row)) => row,
        Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_NO_SUCH_TABLE => None,
        Ok(Err(e)) => return Err(Some(e)),
        Err(_) => return Err(None),
    };
    Ok(row.map(
        |(window_start, holder_id, host, claimed_at, finished_at, exit_code)| Claim {
            window_start,
            holder_id,
            host,
            claimed_at,
            end: match (finished_at, exit_code) {
                (Some(finished_at), Some(code)) => Some(RunEnd::from_stored(code, finished_at)),
                _ => None,
            },
        },
    ))
}

/// `UNIX_TIMESTAMP(NOW(6))` in microseconds.
pub async fn server_clock(
    target: &MysqlTarget,
    timings: &Timings,
) -> Result<UnixMicros, LockError> {
    let limit = timings.check_timeout;
    let mut conn = windows_session(target, timings.connect_timeout, limit).await?;
    let now = timeout(
        limit,
        conn.query_first::<i64, _>("SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)"),
    )
    .await;
    let _ = timeout(limit, conn.disconnect()).await;
    match now {
        Ok(Ok(Some(now))) => Ok(now),
        Ok(Ok(None)) => Err(LockError::Unsafe("the server returned no time".to_owned())),
        Ok(Err(e)) => Err(setup_error(target, e)),
        Err(_) => Err(no_answer(target, "SELECT UNIX_TIMESTAMP(NOW(6))", limit)),
    }
}

/// The newest claimed window of `name`, for `status` and the scheduler.
pub async fn last_claim(
    target: &MysqlTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<Claim>, LockError> {
    if target.opts.db_name().is_none() {
        return Ok(None);
    }
    let mut conn = windows_session(target, connect_limit, answer).await?;
    let last = read_last_claim(&mut conn, name.as_str(), answer)
        .await
        .map_err(|e| query_error(target, "SELECT FROM sentinel_guard_windows", answer, e));
    let _ = timeout(answer, conn.disconnect()).await;
    last
}

/// The query that proves ownership, and in the same statement that the server is still a writable
/// primary: a primary demoted in place (`read_only`, which `super_read_only` implies, set by a
/// switchover while the lock is held) keeps the lock valid on itself while the new primary grants
/// the name to anyone. `read_only` is read as text: MariaDB 11 made it a list of levels, where
/// anything but `OFF` refuses writes. The comment lets a refused instance name this guard from the
/// process list. Lock names and holder fields are restricted to characters that need no escaping.
fn check_sql(request: &LockRequest<'_>) -> String {
    let sleep = request.timings.check_interval.as_secs_f64();
    format!(
        "SELECT SLEEP({sleep:.3}), IS_USED_LOCK('{name}') = CONNECTION_ID(), \
         CAST(@@global.read_only AS CHAR) NOT IN ('0', 'OFF') /* sentinel-guard {holder} */",
        name = request.name.as_str(),
        holder = request.holder,
    )
}

struct Watcher {
    conn_id: u32,
    /// The lock's name and the guard's holder id: what proves `conn_id` is still the lock's session.
    name: String,
    holder_id: String,
    target: MysqlTarget,
    check_sql: String,
    release_sql: String,
    /// Marks the lock record released, where there is one.
    released_sql: Option<String>,
    timing: CheckTiming,
}

/// The row of `check_sql`, or why there is none.
type CheckResult = Result<
    Result<Option<(Option<i64>, Option<i64>, Option<i64>)>, mysql_async::Error>,
    tokio::time::error::Elapsed,
>;

impl SessionWatcher for Watcher {
    type Conn = Conn;
    type Answer = CheckResult;

    fn timing(&self) -> &CheckTiming {
        &self.timing
    }

    fn check<'a>(&'a self, conn: &'a mut Conn) -> impl Future<Output = CheckResult> + Send + 'a {
        timeout(
            self.timing.budget,
            conn.query_first::<(Option<i64>, Option<i64>, Option<i64>), _>(&self.check_sql),
        )
    }

    fn verdict(&self, answer: CheckResult) -> Verdict {
        match answer {
            Ok(Ok(Some((_, _, Some(read_only))))) if read_only != 0 => Verdict::Demoted(
                "@@global.read_only is ON: the server was demoted from primary while holding the lock"
                    .to_owned(),
            ),
            Ok(Ok(Some((_, Some(1), Some(0))))) => Verdict::Owned,
            Ok(Ok(row)) => Verdict::NotOwner(format!(
                "IS_USED_LOCK no longer names connection {} ({row:?})",
                self.conn_id
            )),
            Err(_) => Verdict::NoAnswer,
            Ok(Err(e)) => {
                let closed = session_ended(&e);
                let detail = self.target.url.scrub(e);
                if closed {
                    Verdict::Closed(detail)
                } else {
                    Verdict::Failed(detail)
                }
            }
        }
    }

    /// A side connection, authenticated: `KILL QUERY` needs the lock session's user.
    type Interrupter = Conn;

    fn open_interrupter(&self) -> impl Future<Output = Option<Conn>> + Send + 'static {
        let target = self.target.clone();
        async move { connect(&target, INTERRUPT_TIMEOUT).await.ok() }
    }

    /// `KILL QUERY` from a side connection, repeated until the check answers: the first one can
    /// reach the server before the check itself does. Each is sent only once the side connection has
    /// proven that the id is still the lock's session running this guard's check
    /// (`runs_our_check`): after a restart or a moved address the number can be a stranger's. A side
    /// connection that the server has closed (one opened ahead can outlive its `wait_timeout` during
    /// a long teardown) is replaced by a new one. Without a side connection, or without the proof,
    /// the sleep simply runs out.
    async fn interrupt<'a, F>(
        &'a self,
        mut check: Pin<&'a mut F>,
        ahead: Option<Conn>,
    ) -> CheckResult
    where
        F: Future<Output = CheckResult> + Send + 'a,
    {
        let kill = format!("KILL QUERY {}", self.conn_id);
        let mut side = ahead;
        let result = loop {
            let conn = match side.as_mut() {
                Some(conn) => conn,
                None => match self.open_interrupter().await {
                    Some(conn) => side.insert(conn),
                    None => {
                        debug!(
                            connection_id = self.conn_id,
                            "could not interrupt the check sleep; waiting for it to end"
                        );
                        return check.await;
                    }
                },
            };
            let proof = runs_our_check(
                conn,
                &self.name,
                u64::from(self.conn_id),
                &self.holder_id,
                INTERRUPT_TIMEOUT,
            )
            .await;
            // `None`: no answer in time, which leaves the answer unread on the side connection,
            // where the next statement would read it as its own (a stale proof, say): replaced.
            let sent = match proof {
                Ok(true) => timeout(INTERRUPT_TIMEOUT, conn.query_drop(&kill))
                    .await
                    .ok(),
                // Not (or not yet: the proof can reach the server before the check does) the lock's
                // session running this guard's check: no interrupt, and another look shortly.
                Ok(false) => {
                    debug!(
                        connection_id = self.conn_id,
                        "the id does not name the lock's session running this guard's check; not interrupting it"
                    );
                    Some(Ok(()))
                }
                Err(e) => e.map(Err),
            };
            match sent {
                None => side = None,
                Some(Err(e)) if session_ended(&e) => side = None,
                Some(_) => {}
            }
            tokio::select! {
                result = check.as_mut() => break result,
                _ = tokio::time::sleep(INTERRUPT_RETRY) => {}
            }
        };
        if let Some(side) = side {
            let _ = timeout(INTERRUPT_TIMEOUT, side.disconnect()).await;
        }
        result
    }

    fn release(&self, conn: Conn) -> impl Future<Output = Result<(), LockError>> + Send + '_ {
        self.give_back(conn)
    }

    /// The unanswered check's answer would be read as the release's own: the session is closed
    /// instead (a cancelled statement leaves the driver nothing to send on its way out).
    async fn abandon(&self, conn: Conn) -> Result<(), LockError> {
        drop(conn);
        warn!(
            event = "release_failed",
            connection_id = self.conn_id,
            "the last check had no answer in time; closed the session instead, which frees the lock, and the next holder waits the takeover bound"
        );
        Ok(())
    }
}

impl Watcher {
    async fn give_back(&self, mut conn: Conn) -> Result<(), LockError> {
        // The record first, while the lock is still ours: the next holder starts at once. Only
        // called once the app's tree is gone.
        if let Some(sql) = &self.released_sql {
            match timeout(self.timing.budget, conn.query_drop(sql)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    warn!(event = "lock_record_failed", error = %self.target.url.scrub(e), "cannot mark the lock record released; the next holder waits the takeover bound")
                }
                // Its answer is still unread on the session, where RELEASE_LOCK would read it as its
                // own: closing the session frees the lock instead.
                Err(_) => {
                    warn!(event = "lock_record_failed", connection_id = self.conn_id, "no answer while marking the lock record released; closed the session instead, which frees the lock, and the next holder waits the takeover bound");
                    return Ok(());
                }
            }
        }
        let released = timeout(
            self.timing.budget,
            conn.query_first::<Option<i64>, _>(&self.release_sql),
        )
        .await;
        match released {
            Ok(Ok(Some(Some(1)))) => info!(
                event = "lock_released",
                connection_id = self.conn_id,
                "mysql lock released"
            ),
            Ok(Ok(other)) => warn!(
                event = "release_failed",
                connection_id = self.conn_id,
                result = other
                    .flatten()
                    .map_or_else(|| "NULL".to_owned(), |n| n.to_string()),
                "release_lock did not confirm; closing the connection frees the lock"
            ),
            Ok(Err(e)) => warn!(
                event = "release_failed",
                connection_id = self.conn_id,
                error = %self.target.url.scrub(e),
                "release_lock failed; closing the connection frees the lock"
            ),
            Err(_) => warn!(
                event = "release_failed",
                connection_id = self.conn_id,
                "release_lock timed out; closing the connection frees the lock"
            ),
        }
        // Closing the session frees the lock on the server even where RELEASE_LOCK failed.
        let _ = timeout(self.timing.budget, conn.disconnect()).await;
        Ok(())
    }
}
