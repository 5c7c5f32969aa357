//! MySQL/MariaDB `GET_LOCK` on one dedicated connection.
//!
//! The lock lives exactly as long as the connection that took it, so the connection is the lock:
//! - a session `wait_timeout` bounds how long the server keeps the lock of a silent connection, and is
//!   set so the server frees it only after the guard has noticed the silence and killed its app;
//! - between ownership checks a server-side `SLEEP` is always outstanding, so a `KILL` of the connection
//!   or a dead server is seen the instant the socket closes, not at the next check.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, OptsBuilder};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use super::watched::{WatchedLock, WatcherEnds};
use super::{Acquisition, HeldLock, LockError, LockLoss, LockRequest, LossReason};
use crate::config::MysqlTarget;
use crate::holder::Holder;

/// Server error codes that mean the server ended our session rather than refused one statement.
const ER_SERVER_SHUTDOWN: u16 = 1053;
const ER_CONNECTION_KILLED: u16 = 1927;
/// How long the guard waits for a side connection that interrupts its own `SLEEP` at release.
const INTERRUPT_TIMEOUT: Duration = Duration::from_secs(1);

async fn connect(target: &MysqlTarget, connect_timeout: Duration) -> Result<Conn, LockError> {
    // Connect exactly where the URL says: the driver would otherwise switch to a local socket it
    // discovers on its own, which may be a different server.
    let opts = OptsBuilder::from_opts(target.opts.clone()).prefer_socket(false);
    match timeout(connect_timeout, Conn::new(opts)).await {
        Err(_) => Err(LockError::Unreachable(format!(
            "no connection to {} within {}",
            target.url,
            humantime::format_duration(connect_timeout)
        ))),
        Ok(Err(mysql_async::Error::Server(e))) => Err(LockError::Refused(format!(
            "{}: {}",
            target.url,
            target.url.scrub(e)
        ))),
        Ok(Err(e)) => Err(LockError::Unreachable(format!(
            "{}: {}",
            target.url,
            target.url.scrub(e)
        ))),
        Ok(Ok(conn)) => Ok(conn),
    }
}

/// Any failure while setting up or taking the lock: the app is never started on such a server.
fn setup_error(target: &MysqlTarget, e: mysql_async::Error) -> LockError {
    LockError::Unreachable(format!("{}: {}", target.url, target.url.scrub(e)))
}

pub async fn try_acquire(
    target: &MysqlTarget,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let timings = request.timings;
    let mut conn = connect(target, timings.connect_timeout).await?;
    let fail = |e| setup_error(target, e);
    let bounded = timings.connect_timeout;
    let step = |what: &str| {
        LockError::Unreachable(format!(
            "{}: no answer to {what} within {}",
            target.url,
            humantime::format_duration(bounded)
        ))
    };

    refuse_unsafe_server(&mut conn, target, bounded).await?;

    let wanted = timings.mysql_wait_timeout_secs();
    timeout(
        bounded,
        conn.query_drop(format!("SET SESSION wait_timeout = {wanted}")),
    )
    .await
    .map_err(|_| step("SET SESSION wait_timeout"))?
    .map_err(fail)?;
    let kept: Option<u64> = timeout(bounded, conn.query_first("SELECT @@session.wait_timeout"))
        .await
        .map_err(|_| step("SELECT @@session.wait_timeout"))?
        .map_err(fail)?;
    if kept != Some(wanted) {
        return Err(LockError::Unsafe(format!(
            "the server keeps wait_timeout at {kept:?} instead of {wanted}s, so it could free the lock \
             of a silent connection before the guard stops the app (a proxy in between?)"
        )));
    }

    let name = request.name.as_str();
    let got: Option<Option<i64>> =
        timeout(bounded, conn.exec_first("SELECT GET_LOCK(?, 0)", (name,)))
            .await
            .map_err(|_| step("GET_LOCK"))?
            .map_err(fail)?;
    match got.flatten() {
        Some(1) => {
            info!(
                connection_id = conn.id(),
                wait_timeout_secs = wanted,
                server_version = %version(&conn),
                "mysql lock acquired"
            );
            Ok(Acquisition::Acquired(HeldLock::Mysql(MysqlLock::watch(
                conn, target, request,
            ))))
        }
        Some(0) => {
            let holder = describe_holder(&mut conn, name, bounded).await;
            let _ = conn.disconnect().await;
            Ok(Acquisition::HeldElsewhere(holder))
        }
        other => Err(LockError::Unsafe(format!(
            "GET_LOCK returned {other:?} instead of 0 or 1"
        ))),
    }
}

fn version(conn: &Conn) -> String {
    let (major, minor, patch) = conn.server_version();
    format!("{major}.{minor}.{patch}")
}

/// `GET_LOCK` on a read-only replica or a Galera node does not make a cluster-wide singleton.
async fn refuse_unsafe_server(
    conn: &mut Conn,
    target: &MysqlTarget,
    bounded: Duration,
) -> Result<(), LockError> {
    let vars: Vec<(String, String)> = timeout(
        bounded,
        conn.query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('read_only', 'super_read_only', 'wsrep_on')",
        ),
    )
    .await
    .map_err(|_| LockError::Unreachable(format!("{}: no answer to SHOW GLOBAL VARIABLES", target.url)))?
    .map_err(|e| setup_error(target, e))?;
    for (variable, value) in vars {
        let on = matches!(value.to_ascii_uppercase().as_str(), "ON" | "1");
        match variable.to_ascii_lowercase().as_str() {
            "read_only" | "super_read_only" if on => {
                return Err(LockError::Unsafe(format!(
                    "@@global.{variable}=ON: this is a replica or reader endpoint; point --url at the primary"
                )))
            }
            "wsrep_on" if on => {
                return Err(LockError::Unsafe(
                    "wsrep_on=ON: on Galera/PXC, GET_LOCK is local to one node (or an error), so two nodes can each grant it"
                        .to_owned(),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Says who holds `name`, as far as this account can see: the holder's connection id, its account from
/// the process list, and the guard identity its outstanding check query carries in a comment.
async fn describe_holder(conn: &mut Conn, name: &str, bounded: Duration) -> String {
    let id: Option<u64> =
        match timeout(bounded, conn.exec_first("SELECT IS_USED_LOCK(?)", (name,))).await {
            Ok(Ok(id)) => id.flatten(),
            _ => None,
        };
    let Some(id) = id else {
        return "unknown (released while being looked up)".to_owned();
    };
    let row: Option<(String, String, u64, Option<String>)> = timeout(
        bounded,
        conn.exec_first(
            "SELECT USER, HOST, TIME, INFO FROM information_schema.PROCESSLIST WHERE ID = ?",
            (id,),
        ),
    )
    .await
    .ok()
    .and_then(Result::ok)
    .flatten();
    match row {
        Some((user, client, seconds, info)) => {
            let guard = info
                .as_deref()
                .and_then(Holder::parse)
                .map(|h| format!(" {h}"))
                .unwrap_or_default();
            format!(
                "connection_id={id} user={user} client={client} idle_or_busy_secs={seconds}{guard}"
            )
        }
        None => format!("connection_id={id} (not visible in the process list to this account)"),
    }
}

/// A held `GET_LOCK`. A task owns the connection and keeps proving ownership until it is told to
/// release or finds the lock gone.
pub struct MysqlLock(WatchedLock);

impl MysqlLock {
    fn watch(conn: Conn, target: &MysqlTarget, request: &LockRequest<'_>) -> MysqlLock {
        let watcher = Watcher {
            conn_id: conn.id(),
            target: target.clone(),
            check_sql: check_sql(request),
            release_sql: format!("SELECT RELEASE_LOCK('{}')", request.name.as_str()),
            budget: request.timings.detection_bound(),
        };
        MysqlLock(WatchedLock::spawn(|ends| watcher.run(conn, ends)))
    }

    pub async fn lost(&mut self) -> LockLoss {
        self.0.lost().await
    }

    pub async fn release(self) -> Result<(), LockError> {
        self.0.release().await
    }
}

/// The query that proves ownership; the comment lets a refused instance name this guard from the
/// process list. Lock names and holder fields are restricted to characters that need no escaping.
fn check_sql(request: &LockRequest<'_>) -> String {
    let sleep = request.timings.check_interval.as_secs_f64();
    format!(
        "SELECT SLEEP({sleep:.3}), IS_USED_LOCK('{name}') = CONNECTION_ID() /* sentinel-guard {holder} */",
        name = request.name.as_str(),
        holder = request.holder,
    )
}

struct Watcher {
    conn_id: u32,
    target: MysqlTarget,
    check_sql: String,
    release_sql: String,
    /// check-interval (the server-side sleep) + check-timeout.
    budget: Duration,
}

/// The row of `check_sql`, or why there is none.
type CheckResult = Result<
    Result<Option<(Option<i64>, Option<i64>)>, mysql_async::Error>,
    tokio::time::error::Elapsed,
>;

enum Check {
    Owned,
    Lost(LockLoss),
}

impl Watcher {
    async fn run(self, mut conn: Conn, mut ends: WatcherEnds) -> Result<(), LockError> {
        loop {
            let (check, releasing) = {
                let check = timeout(
                    self.budget,
                    conn.query_first::<(Option<i64>, Option<i64>), _>(&self.check_sql),
                );
                tokio::pin!(check);
                tokio::select! {
                    result = &mut check => (self.judge(result), false),
                    _ = &mut ends.release => {
                        self.interrupt_sleep().await;
                        (self.judge(check.await), true)
                    }
                }
            };
            match (check, releasing) {
                (Check::Owned, false) => continue,
                (Check::Owned, true) => return self.release(conn).await,
                (Check::Lost(loss), _) => {
                    ends.report(loss);
                    // A connection that timed out or failed is never reused; dropping it closes it.
                    return Ok(());
                }
            }
        }
    }

    fn judge(&self, result: CheckResult) -> Check {
        let lost = |reason, detail: String| Check::Lost(LockLoss { reason, detail });
        match result {
            Ok(Ok(Some((_, Some(1))))) => Check::Owned,
            Ok(Ok(row)) => lost(
                LossReason::NotOwner,
                format!(
                    "IS_USED_LOCK no longer names connection {} ({row:?})",
                    self.conn_id
                ),
            ),
            Err(_) => lost(
                LossReason::CheckTimeout,
                format!(
                    "no answer within {}",
                    humantime::format_duration(self.budget)
                ),
            ),
            Ok(Err(e)) => {
                let closed = match &e {
                    mysql_async::Error::Server(s) => {
                        matches!(s.code, ER_CONNECTION_KILLED | ER_SERVER_SHUTDOWN)
                    }
                    mysql_async::Error::Io(_) | mysql_async::Error::Driver(_) => true,
                    _ => false,
                };
                let reason = if closed {
                    LossReason::ConnectionClosed
                } else {
                    LossReason::CheckFailed
                };
                lost(reason, self.target.url.scrub(e))
            }
        }
    }

    /// Ends the outstanding `SLEEP` from a side connection so a release is not delayed by up to a
    /// check interval. Best effort: if it fails, the sleep simply runs out.
    async fn interrupt_sleep(&self) {
        let interrupted = async {
            let mut side = connect(&self.target, INTERRUPT_TIMEOUT).await.ok()?;
            let killed = timeout(
                INTERRUPT_TIMEOUT,
                side.query_drop(format!("KILL QUERY {}", self.conn_id)),
            )
            .await;
            let _ = side.disconnect().await;
            killed.ok()?.ok()
        };
        if interrupted.await.is_none() {
            debug!(
                connection_id = self.conn_id,
                "could not interrupt the check sleep; waiting for it to end"
            );
        }
    }

    async fn release(&self, mut conn: Conn) -> Result<(), LockError> {
        let released = timeout(
            self.budget,
            conn.query_first::<Option<i64>, _>(&self.release_sql),
        )
        .await;
        match released {
            Ok(Ok(Some(Some(1)))) => info!(connection_id = self.conn_id, "mysql lock released"),
            Ok(Ok(other)) => warn!(
                connection_id = self.conn_id,
                result = ?other,
                "release_lock did not confirm; closing the connection frees the lock"
            ),
            Ok(Err(e)) => warn!(
                connection_id = self.conn_id,
                error = %self.target.url.scrub(e),
                "release_lock failed; closing the connection frees the lock"
            ),
            Err(_) => warn!(
                connection_id = self.conn_id,
                "release_lock timed out; closing the connection frees the lock"
            ),
        }
        // Closing the session frees the lock on the server even where RELEASE_LOCK failed.
        let _ = timeout(self.budget, conn.disconnect()).await;
        Ok(())
    }
}
