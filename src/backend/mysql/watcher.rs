//! The held MySQL lock: its ownership check, its interrupts, its release.

use super::*;

/// A held `GET_LOCK`: a task owns the connection and keeps proving ownership until it is told to
/// release or finds the lock gone.
pub(super) fn watch(
    conn: Conn,
    session_id: u64,
    target: &MysqlTarget,
    request: &LockRequest<'_>,
    asked: (Deadline, Option<(u16, u16)>),
    (previous, fence, recorded): (Previous, u64, bool),
) -> HeldLock {
    let farewell = SessionFarewell {
        server: Server::Mysql,
        url: target.secret.clone(),
        session_id,
        revision: 0,
        name: request.name.as_str().to_owned(),
        holder_id: request.holder.id.clone(),
        timeout: request.timings.connect_timeout,
        ca_file: target.ca_file.clone(),
    }
    .encode();
    let watcher = Watcher {
        session_id,
        name: request.name.as_str().to_owned(),
        holder_id: request.holder.id.clone(),
        target: target.clone(),
        check_sql: check_sql(request),
        release_sql: format!("SELECT RELEASE_LOCK('{}')", request.name.as_str()),
        released_sql: record_table::released_sql(request, recorded),
        timing: CheckTiming::of(request),
    };
    HeldLock::new(SessionHeld {
        session: SessionLock::spawn(watcher, conn, farewell, Some(fence), asked),
        previous,
        windows: SqlWindows {
            dialect: MysqlWindows(Box::new(target.clone())),
            // Past i64 (never, in practice) it matches no session: no claim, never a wrong one.
            session_id: i64::try_from(session_id).unwrap_or(-1),
        },
    })
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
    session_id: u64,
    /// The lock's name and the guard's holder id: what proves `session_id` is still the lock's session.
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
                self.session_id
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

    type Interrupter = SideConnection;

    /// Opens the side connection and proves at once what the first `KILL QUERY` needs proven: the
    /// release often follows within a millisecond (an app that ended on its own leaves little to
    /// tear down), and the proof, a read of the whole process list, is then off its path.
    fn open_interrupter(&self) -> impl Future<Output = Option<SideConnection>> + Send + 'static {
        let (target, name, id) = (self.target.clone(), self.name.clone(), self.session_id);
        let holder_id = self.holder_id.clone();
        async move {
            let mut conn = connect(&target, INTERRUPT_TIMEOUT).await.ok()?;
            // Counted from the question, on the clock that runs through a suspend.
            let asked = Deadline::now();
            let proven_at =
                match runs_our_check(&mut conn, &name, id, &holder_id, INTERRUPT_TIMEOUT).await {
                    Ok(proven) => proven.then_some(asked),
                    // Its answer is still unread on the connection, where the next statement would
                    // read it as its own: a new one, proven when used, so that a slow first proof
                    // does not end the interrupting.
                    Err(None) => {
                        conn = connect(&target, INTERRUPT_TIMEOUT).await.ok()?;
                        None
                    }
                    Err(Some(_)) => None,
                };
            Some(SideConnection { conn, proven_at })
        }
    }

    /// `KILL QUERY` from a side connection, repeated until the check answers: the first one can
    /// reach the server before the check itself does. Each is sent only once the side connection has
    /// proven that the id is still the lock's session running this guard's check
    /// (`runs_our_check`): after a restart or a moved address the number can be a stranger's. The
    /// proof made when the connection opened serves the first `KILL` only, and only while it is
    /// fresh (`AHEAD_PROOF_FRESH`). A side connection that the server has closed (one opened ahead
    /// can outlive its `wait_timeout` during a long teardown) is replaced by a new one. Without a
    /// side connection, or without the proof, the sleep simply runs out.
    async fn interrupt<'a, F>(
        &'a self,
        mut check: Pin<&'a mut F>,
        ahead: Option<SideConnection>,
    ) -> CheckResult
    where
        F: Future<Output = CheckResult> + Send + 'a,
    {
        let kill = format!("KILL QUERY {}", self.session_id);
        let mut side = ahead;
        let result = loop {
            let opened = match side.as_mut() {
                Some(opened) => opened,
                None => match self.open_interrupter().await {
                    Some(opened) => side.insert(opened),
                    None => {
                        debug!(
                            connection_id = self.session_id,
                            "could not interrupt the check sleep; waiting for it to end"
                        );
                        return check.await;
                    }
                },
            };
            let fresh = opened
                .proven_at
                .take()
                .is_some_and(|asked| asked.elapsed() < AHEAD_PROOF_FRESH);
            let conn = &mut opened.conn;
            let proof = if fresh {
                Ok(true)
            } else {
                runs_our_check(
                    conn,
                    &self.name,
                    self.session_id,
                    &self.holder_id,
                    INTERRUPT_TIMEOUT,
                )
                .await
            };
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
                        connection_id = self.session_id,
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
            let _ = timeout(INTERRUPT_TIMEOUT, side.conn.disconnect()).await;
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
            connection_id = self.session_id,
            "the last check had no answer in time; closed the session instead, which frees the lock, and the next holder waits the takeover bound"
        );
        Ok(())
    }
}

impl Watcher {
    async fn give_back(&self, mut conn: Conn) -> Result<(), LockError> {
        let budget = self.timing.budget;
        // The record first, while the lock is still ours: the next holder starts at once. Only
        // called once the app's tree is gone. Both in one round trip: the UPDATE commits before
        // RELEASE_LOCK runs, and a failed UPDATE ends the query before it.
        let released = match &self.released_sql {
            Some(record) => {
                let both = format!("{record}; {}", self.release_sql);
                match timeout(budget, marked_then_released(&mut conn, both)).await {
                    Ok(Ok(released)) => Ok(Ok(released)),
                    Ok(Err(Step::Record(e))) => {
                        warn!(event = "lock_record_failed", error = %self.target.url.scrub(e), "cannot mark the lock record released; the next holder waits the takeover bound");
                        timeout(
                            budget,
                            conn.query_first::<Option<i64>, _>(&self.release_sql),
                        )
                        .await
                    }
                    Ok(Err(Step::Release(e))) => Ok(Err(e)),
                    // An answer may still be unread on the session, where RELEASE_LOCK would read
                    // it as its own: closing the session frees the lock instead.
                    Err(_) => {
                        warn!(event = "release_failed", connection_id = self.session_id, "no answer while marking the lock record released and releasing the lock; closed the session instead, which frees the lock, and the next holder waits the takeover bound unless the record was marked");
                        // Closed without reading the rest: dropped, the driver would wait for it.
                        let _ = timeout(budget, conn.disconnect()).await;
                        return Ok(());
                    }
                }
            }
            None => {
                timeout(
                    budget,
                    conn.query_first::<Option<i64>, _>(&self.release_sql),
                )
                .await
            }
        };
        match released {
            Ok(Ok(Some(Some(1)))) => info!(
                event = "lock_released",
                connection_id = self.session_id,
                "mysql lock released"
            ),
            Ok(Ok(other)) => warn!(
                event = "release_failed",
                connection_id = self.session_id,
                result = other
                    .flatten()
                    .map_or_else(|| "NULL".to_owned(), |n| n.to_string()),
                "release_lock did not confirm; closing the connection frees the lock"
            ),
            Ok(Err(e)) => warn!(
                event = "release_failed",
                connection_id = self.session_id,
                error = %self.target.url.scrub(e),
                "release_lock failed; closing the connection frees the lock"
            ),
            Err(_) => warn!(
                event = "release_failed",
                connection_id = self.session_id,
                "release_lock timed out; closing the connection frees the lock"
            ),
        }
        // Closing the session frees the lock on the server even where RELEASE_LOCK failed.
        let _ = timeout(self.timing.budget, conn.disconnect()).await;
        Ok(())
    }
}

/// How young a proof made as the side connection opened must be to serve the first `KILL QUERY`:
/// a restart that gives the id to a stranger also ends the side connection, but a proxy that keeps
/// the client's connection across a backend's restart (or sends each statement to any backend)
/// would carry an old proof over to a stranger. A few milliseconds cover a release that follows a
/// short teardown; past them the `KILL` is proven anew, one round trip after its proof, as before.
const AHEAD_PROOF_FRESH: Duration = Duration::from_millis(5);

/// A side connection, authenticated (`KILL QUERY` needs the lock session's user), and when it
/// asked for the proof that the lock's session runs this guard's check, if the answer it got as it
/// opened was yes.
pub(super) struct SideConnection {
    conn: Conn,
    proven_at: Option<Deadline>,
}

/// Which of `marked_then_released`'s two statements failed.
enum Step {
    Record(mysql_async::Error),
    Release(mysql_async::Error),
}

/// Runs `both` (the record's UPDATE, then RELEASE_LOCK) and reads RELEASE_LOCK's answer.
/// Once `query_iter` has answered, the UPDATE has succeeded: any error after that is RELEASE_LOCK's,
/// whichever read brings it (the driver reads the next statement's header as it ends a result).
async fn marked_then_released(conn: &mut Conn, both: String) -> Result<Option<Option<i64>>, Step> {
    let mut answer = conn.query_iter(both).await.map_err(Step::Record)?;
    let released = async {
        answer.collect::<mysql_async::Row>().await?;
        let released = answer.collect::<Option<i64>>().await?;
        answer.drop_result().await?;
        Ok(released.into_iter().next())
    };
    released.await.map_err(Step::Release)
}
