//! The connection to wherever a Redis lock's keys live: one server, the primary a Sentinel names
//! (checked to still be a primary), or a Cluster; and what its errors mean.

use super::*;

/// A connection to the node that holds the lock's keys, or to a whole Cluster.
#[derive(Clone)]
pub(super) enum Conn {
    Node(MultiplexedConnection),
    /// To the node the sentinels named as primary, at `address`; `sentinel` (the sentinel that
    /// named it, or the next that answers) is asked again before each use.
    Primary {
        conn: MultiplexedConnection,
        address: (String, u16),
        sentinel: Option<MultiplexedConnection>,
    },
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(conn) | Conn::Primary { conn, .. } => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(conn) | Conn::Primary { conn, .. } => {
                conn.req_packed_commands(pipeline, offset, count)
            }
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(conn) | Conn::Primary { conn, .. } => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
        }
    }
}

/// A call of one of the lock's scripts by its hash (`EVALSHA`), keys first: what a
/// `redis::ScriptInvocation` sends, but a command that can go into a pipeline; and the `SCRIPT LOAD`
/// that goes before it to a server that lacks the script.
pub(super) struct ScriptCall {
    load: Cmd,
    evalsha: Cmd,
}

impl ScriptCall {
    pub(super) fn new(source: &str, keys: &[&str]) -> ScriptCall {
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha
            .arg(Script::new(source).get_hash())
            .arg(keys.len())
            .arg(keys);
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(source);
        ScriptCall { load, evalsha }
    }

    pub(super) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut ScriptCall {
        self.evalsha.arg(arg);
        self
    }
}

impl Conn {
    /// Runs `call` on the node that owns `keys`' slot; with `wait` (replicas, limit), `WAIT` follows
    /// it in the same pipeline and its count comes back too. Together, because a `WAIT` sent on its
    /// own could go down another connection than the script's write (a Cluster client reconnects
    /// and retries by itself): a connection that has written nothing is acknowledged at once. A
    /// `WAIT` that fails counts no replica. A server that lacks the script (restarted, promoted,
    /// flushed) is sent it in front of the same call, in one pipeline: one round trip more, not two.
    /// With `load_first` it goes in front at once: a lock's first call on a connection just made,
    /// where the server reached anew is often one that lacks it (a promoted replica), and a call
    /// answered `NOSCRIPT` would have sat through its `WAIT` for nothing.
    pub(super) async fn call<T: FromRedisValue>(
        &mut self,
        keys: &Keys,
        call: &ScriptCall,
        wait: Option<(u32, Duration)>,
        load_first: bool,
    ) -> Result<(T, Option<i64>), RedisError> {
        let pipe = |load: bool| {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            if load {
                pipe.add_command(call.load.clone());
            }
            pipe.add_command(call.evalsha.clone());
            if let Some((replicas, limit)) = wait {
                // WAIT 0 would block for ever.
                pipe.cmd("WAIT").arg(replicas).arg(millis(limit).max(1));
            }
            pipe
        };
        let mut load = load_first;
        let mut answers = self.pipeline(keys, &pipe(load)).await?;
        if !load && answers.first().is_some_and(no_script) {
            // The script did not run (the WAIT did, on nothing new).
            load = true;
            answers = self.pipeline(keys, &pipe(true)).await?;
        }
        let mut answers = answers.into_iter();
        let loaded = if load { answers.next() } else { None };
        let script = answers.next().unwrap_or(Value::Nil);
        if no_script(&script) {
            // Refused (an ACL without `script|load`), the load says why the script could not run;
            // refused where the server had the script anyway, it does not matter.
            loaded.unwrap_or(Value::Nil).extract_error()?;
        }
        let script = script.extract_error()?;
        let acked = wait.map(|_| {
            answers
                .next()
                .and_then(|count| redis::from_redis_value::<i64>(count).ok())
                .unwrap_or(0)
        });
        Ok((redis::from_redis_value(script)?, acked))
    }

    /// Sends `pipe` whole down the connection to the node that owns `keys`' slot.
    async fn pipeline(&mut self, keys: &Keys, pipe: &Pipeline) -> Result<Vec<Value>, RedisError> {
        match self {
            Conn::Node(conn) | Conn::Primary { conn, .. } => pipe.query_async(conn).await,
            Conn::Cluster(conn) => {
                let route = Route::new(keys.slot(), SlotAddr::Master);
                let node = SingleNodeRoutingInfo::SpecificNode(route);
                conn.route_pipeline(pipe.clone(), 0, pipe.len(), node).await
            }
        }
    }
}

/// A server's answer that it does not know the script.
fn no_script(answer: &Value) -> bool {
    matches!(answer, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript))
}

pub(super) async fn connect(target: &RedisTarget, limit: Duration) -> Result<Conn, RedisError> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit));
    match &target.servers {
        RedisServers::Primary(client) => {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            // A server demoted to a writable replica (`replica-read-only no`) would take the
            // lease's scripts as if it were the primary.
            require_primary(&mut conn, "the server is not a primary", String::new()).await?;
            Ok(Conn::Node(conn))
        }
        RedisServers::Sentinel {
            sentinels,
            group,
            primary,
        } => {
            let (address, sentinel) = ask_sentinels(sentinels, group, &config).await?;
            let shown = format!("{}:{}", address.0, address.1);
            let mut conn = primary
                .client(&address.0, address.1)?
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            // Between the sentinels' answer and now a failover may have happened.
            let named = "the node the sentinels named is not a primary";
            require_primary(&mut conn, named, shown.clone()).await?;
            debug!(event = "redis_primary", group = %group, primary = %shown, "sentinels named the primary");
            Ok(Conn::Primary {
                conn,
                address,
                sentinel: Some(sentinel),
            })
        }
        RedisServers::Cluster { cluster, .. } => {
            let config = ClusterConfig::new()
                .set_connection_timeout(limit)
                .set_response_timeout(limit);
            Ok(Conn::Cluster(
                cluster.get_async_connection_with_config(config).await?,
            ))
        }
    }
}

/// The primary of `group` as the first sentinel that answers names it, and the connection to that
/// sentinel.
async fn ask_sentinels(
    sentinels: &[redis::Client],
    group: &str,
    config: &AsyncConnectionConfig,
) -> Result<((String, u16), MultiplexedConnection), RedisError> {
    let mut failure = RedisError::from((
        ErrorKind::MasterNameNotFoundBySentinel,
        "no sentinel names a primary for the group",
        group.to_owned(),
    ));
    for sentinel in sentinels {
        let answer = async {
            let mut conn = sentinel
                .get_multiplexed_async_connection_with_config(config)
                .await?;
            let named = named_primary(&mut conn, group).await?;
            Ok::<_, RedisError>(named.map(|address| (address, conn)))
        };
        match answer.await {
            Ok(Some(found)) => return Ok(found),
            Ok(None) => {}
            Err(e) => failure = e,
        }
    }
    Err(failure)
}

async fn named_primary(
    sentinel: &mut MultiplexedConnection,
    group: &str,
) -> Result<Option<(String, u16)>, RedisError> {
    redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(group)
        .query_async(sentinel)
        .await
}

/// `ROLE` on a connection whose script wrote without reading the server's role (`INFO` refused by an
/// ACL; `ROLE` was allowed at connect): whether the server answers as a primary, within `limit`. A
/// Cluster connection reaches primaries only: a replica answers `MOVED`.
pub(super) async fn answers_as_primary(
    target: &RedisTarget,
    conn: &mut Conn,
    limit: Duration,
) -> Result<bool, ScriptFailure> {
    let (Conn::Node(conn) | Conn::Primary { conn, .. }) = conn else {
        return Ok(true);
    };
    match timeout(limit, redis::cmd("ROLE").query_async::<Role>(conn)).await {
        Ok(Ok(role)) => Ok(matches!(role, Role::Primary { .. })),
        Ok(Err(e)) => Err(ScriptFailure {
            outcome: CheckOutcome::Error,
            message: format!(
                "the server's role could not be read: {}",
                target.url.scrub(e)
            ),
        }),
        Err(_) => Err(ScriptFailure {
            outcome: CheckOutcome::Timeout,
            message: format!(
                "the server's role could not be read within {}",
                crate::vocab::show_duration(limit)
            ),
        }),
    }
}

/// `ROLE` on a new connection: anything but a primary is refused as a read-only server.
async fn require_primary(
    conn: &mut MultiplexedConnection,
    why: &'static str,
    detail: String,
) -> Result<(), RedisError> {
    let role: Role = redis::cmd("ROLE").query_async(conn).await?;
    if matches!(role, Role::Primary { .. }) {
        return Ok(());
    }
    Err(RedisError::from((
        ErrorKind::Server(ServerErrorKind::ReadOnly),
        why,
        detail,
    )))
}

/// Drops a kept connection to a node the sentinels no longer name as the primary. A demoted primary
/// may go on accepting writes until the sentinels reconfigure it, seconds later: a guard renewing
/// there would never notice that a standby was granted the lock on the new primary. The next
/// connection asks the sentinels again and checks ROLE. Sentinels that cannot answer within
/// `limit` change nothing: the primary itself is what a renewal proves.
pub(super) async fn forget_demoted(target: &RedisTarget, slot: &mut Option<Conn>, limit: Duration) {
    let (
        Some(Conn::Primary {
            address, sentinel, ..
        }),
        RedisServers::Sentinel {
            sentinels, group, ..
        },
    ) = (slot.as_mut(), &target.servers)
    else {
        return;
    };
    let named = timeout(limit, async {
        if let Some(conn) = sentinel.as_mut() {
            if let Ok(named) = named_primary(conn, group).await {
                return Ok(named);
            }
        }
        // The kept sentinel failed: ask them all, and keep the one that answers.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(limit))
            .set_response_timeout(Some(limit));
        let (named, conn) = ask_sentinels(sentinels, group, &config).await?;
        *sentinel = Some(conn);
        Ok::<_, RedisError>(Some(named))
    })
    .await;
    match named {
        Ok(Ok(Some(named))) if named != *address => {
            info!(
                event = "redis_primary_changed",
                group = %group,
                old = %format!("{}:{}", address.0, address.1),
                new = %format!("{}:{}", named.0, named.1),
                "the sentinels name another primary; reconnecting"
            );
            *slot = None;
        }
        _ => {}
    }
}

/// A connection within `limit`, or the error that says why not.
pub(super) async fn connected(target: &RedisTarget, limit: Duration) -> Result<Conn, LockError> {
    match timeout(limit, connect(target, limit)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(lock_error(target, &e)),
        Err(_) => Err(no_answer(target, limit)),
    }
}

/// A failure that a retry cannot mend (wrong password, bad configuration, script error). A node that
/// is no longer (or not yet) the primary, a failover in progress, or sentinels that know no healthy
/// primary for the moment are mended by asking again.
pub(super) fn is_permanent(e: &RedisError) -> bool {
    let in_transition = matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::ReadOnly
                | ServerErrorKind::MasterDown
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ) | ErrorKind::MasterNameNotFoundBySentinel
    );
    !(in_transition || e.is_io_error() || e.is_timeout() || e.is_connection_dropped())
}

pub(super) fn lock_error(target: &RedisTarget, e: &RedisError) -> LockError {
    let message = format!("{}: {}", target.url, target.url.scrub(e));
    match e.kind() {
        ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig => {
            LockError::Refused(message)
        }
        // `SELECT` of a database the server does not have: no retry will find it. Read in the
        // server's words, not the scrubbed ones, which a short secret can cut into.
        _ if e.to_string().contains("refused to switch database") => LockError::Refused(format!(
            "{message} (the URL's /db is beyond the server's `databases` setting)"
        )),
        _ if e.is_timeout() => connect_failure(format!("{message}{}", tls_hint(target))),
        _ => connect_failure(message),
    }
}

pub(super) fn no_answer(target: &RedisTarget, limit: Duration) -> LockError {
    LockError::Unreachable(format!(
        "{}: no answer within {}{}",
        target.url,
        crate::vocab::show_duration(limit),
        tls_hint(target)
    ))
}

/// What a silent server may mean for a TLS URL: a plain server sits through a TLS handshake,
/// waiting for a command.
fn tls_hint(target: &RedisTarget) -> &'static str {
    if target.uses_tls() {
        " (a server without TLS never answers a TLS handshake: is it redis://?)"
    } else {
        ""
    }
}

/// How long after its lease is taken away this holder's app may still run: until its deadline, at
/// most the lease's validity after the last renewal it sent, then the grace period.
pub(super) fn bound(timings: &Timings) -> Duration {
    timings.ttl + timings.grace_period
}

pub(super) fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

pub(super) async fn subscribe(
    target: &RedisTarget,
    keys: &Keys,
    limit: Duration,
) -> Option<PubSub> {
    let subscribed = timeout(limit, async {
        let client = match &target.servers {
            RedisServers::Primary(client) => client.clone(),
            RedisServers::Sentinel {
                sentinels,
                group,
                primary,
            } => {
                let config = AsyncConnectionConfig::new();
                let ((host, port), _) = ask_sentinels(sentinels, group, &config).await?;
                primary.client(&host, port)?
            }
            // A PUBLISH reaches every node of a Cluster.
            RedisServers::Cluster { seed, .. } => seed.clone(),
        };
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(&keys.released).await?;
        Ok::<_, RedisError>(pubsub)
    })
    .await;
    match subscribed {
        Ok(Ok(pubsub)) => Some(pubsub),
        Ok(Err(e)) => {
            warn!(event = "subscribe_failed", error = %target.url.scrub(e), "cannot subscribe to release announcements; polling only");
            None
        }
        Err(_) => {
            warn!(
                event = "subscribe_failed",
                "cannot subscribe to release announcements in time; polling only"
            );
            None
        }
    }
}

/// Sleeps for `nap`, or less if a release is announced. A broken subscription falls back to polling.
pub(super) async fn wait_for_release(releases: &mut Option<PubSub>, nap: Duration) {
    let Some(pubsub) = releases else {
        tokio::time::sleep(nap).await;
        return;
    };
    let subscription_ended = {
        let mut messages = pubsub.on_message();
        tokio::select! {
            _ = tokio::time::sleep(nap) => false,
            message = messages.next() => message.is_none(),
        }
    };
    if subscription_ended {
        warn!(
            event = "subscribe_failed",
            "release announcements stopped; polling only"
        );
        *releases = None;
    }
}
