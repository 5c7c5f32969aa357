//! The held PostgreSQL lock: its ownership check, its interrupts, its release, and the watchdog's
//! farewell.

use super::*;

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
pub(super) fn watch(
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
        released_sql: record_table::released_sql(request, recorded).map(|sql| {
            // Committed without waiting for its WAL to be flushed (`synchronous_commit` off for
            // this transaction alone): visible at once, to the next holder too, and a `released`
            // lost to a crash only leaves `held`, which makes the next holder wait its bound. The
            // next holder's own `held` is flushed, and with it this one, which came first.
            format!("{sql} AND set_config('synchronous_commit', 'off', true) = 'off'")
        }),
        timing: CheckTiming::of(request),
    };
    let windows = SqlWindows {
        dialect: PostgresWindows {
            target: Box::new(target.clone()),
            app_name: format!("sentinel-guard windows {}", request.holder.id),
        },
        session_id: i64::from(session.pid),
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
        let budget = self.timing.budget;
        // The record first, while the lock is still ours: the next holder starts at once. Only
        // called once the app's tree is gone. Both sent at once, in this order: the driver queues
        // a request when it is first polled, which a biased `join!` does in the order written, and
        // the server runs them in turn, each its own transaction, so the record is committed before
        // the unlock runs, one round trip for both, and a failed record leaves the unlock to run.
        let marked = async {
            match &self.released_sql {
                Some(sql) => query(&client, sql, budget).await.err(),
                None => None,
            }
        };
        let unlock = format!("SELECT pg_advisory_unlock({})", self.key);
        let (failed, unlocked) = tokio::join!(biased; marked, query(&client, &unlock, budget));
        if let Some(failure) = failed {
            let error = match failure {
                Failure::Db(e) => self.target.explain(e),
                Failure::Timeout => "no answer".to_owned(),
            };
            warn!(event = "lock_record_failed", error = %error, "cannot mark the lock record released; the next holder waits the takeover bound unless a late answer marked it");
        }
        match unlocked {
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
        // Dropping the client ends the session once what was sent has been answered (or the guard
        // exits), which frees the lock even where the unlock failed.
        drop(client);
        Ok(())
    }
}
