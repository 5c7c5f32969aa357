//! A Redis lease: a key that expires unless renewed, taken and kept by compare-and-set scripts.
//!
//! A lease is not a connection, so its safety comes from a deadline kept on the guard's monotonic
//! clock, not from a socket: the lease is known valid until the *send* time of the last confirmed
//! acquire or renewal + ttl - drift margin. The app is told to stop grace-period before that deadline
//! and is SIGKILLed by it, whether or not Redis answers. A dropped connection is not a lost lease while
//! the deadline holds: the guard reconnects and retries.
//!
//! Three topologies, one protocol. A single server is addressed directly. With Sentinel every
//! connection starts by asking the sentinels for the group's primary and checking `ROLE` on the
//! connection itself, so a reconnect after an error (a `READONLY` answer from a demoted primary, a
//! dropped connection) finds the new primary. With Cluster the client follows `MOVED`/`ASK`; every key
//! of a lock shares the `{name}` hash tag, so each script runs on the one node that owns the slot.
//! A failover never extends a lease: the new primary is trusted only if it holds the guard's exact
//! token (the renewal answers "not owner" otherwise), and the deadline still counts from the last
//! renewal confirmed anywhere. Asynchronous replication can lose the newest writes, so with
//! `--redis-min-replicas N` an acquisition or renewal counts only once `WAIT` says N replicas have it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::aio::{ConnectionLike, MultiplexedConnection, PubSub};
use redis::cluster::ClusterConfig;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Role, Script,
    ServerErrorKind, Value,
};
use tokio::time::{timeout, Instant};
use tracing::{debug, info, warn};

use super::watched::{WatchedLock, WatcherEnds};
use super::{
    connect_failure, Acquisition, Backoff, ClaimAnswer, ClaimRequest, Contention, Held, HeldLock,
    HolderInfo, LockError, LockLoss, LockRequest, LossReason, Observer, Patience, WindowStore,
};
use crate::config::{LockName, RedisServers, RedisTarget, Timings};
use crate::deadline::{self, Deadline};
use crate::handoff::Farewell;
use crate::holder::Holder;
use crate::record::{set_back_error, Previous, RecordFacts, RecordState};
use crate::vocab::CheckOutcome;
use crate::window::{Claim, RunExit, UnixMicros, WindowOutcome};

/// The dataset a script runs on, as a Lua function `dataset()`: the server process and its
/// replication history (`ACQUIRE`), or `''` where `INFO` is refused or says neither.
macro_rules! dataset_lua {
    () => {
        r"
local function dataset()
  local ok, server = pcall(redis.call, 'INFO', 'server')
  local ok2, replication = pcall(redis.call, 'INFO', 'replication')
  local run = ok and string.match(server, 'run_id:(%x+)')
  local replid = ok2 and string.match(replication, 'master_replid:(%x+)')
  if run and replid then
    return run .. '/' .. replid
  end
  return ''
end
"
    };
}

/// KEYS: lock, fence counter, clean marker, lease record. ARGV: token, holder, ttl (ms), this
/// holder's "app dead by" bound (ms).
///
/// The value is `<token> fence=<n> <holder>`; the token is its first word. Returns `{fence,
/// previous, bound}`: fence 0 when held by another token. `previous` is 1 when the previous lease
/// was released by its owner (its fence is the one recorded in the clean key), 2 when it ran out:
/// the lease record (`<fence> <expiry µs> <bound ms>`, written at every grant and renewal) says its
/// expiry has passed on the server's clock; else 0, as after a `DEL` of a live lease. With 2 and 0,
/// the bound that holder recorded (0: none). A missing counter means a first acquisition or a server
/// that lost its data: nobody can tell which, so it counts as 0. The clean marker names the dataset
/// that wrote it: the server process (`run_id`, new at every start) and its replication history
/// (`master_replid`, new at every promotion and full resynchronisation). A marker restored from a
/// snapshot, written before a restart, or carried through a failover and back may miss newer
/// leases, and proves nothing; so does one written where `INFO` is not allowed (an ACL without
/// `+info`): the hand-over then waits.
/// Fence -1 is a counter set back below a token its records hold (`{-1, counter, recorded}`):
/// nothing is written then. A counter that is missing while its records remain (evicted under an
/// `allkeys-*` policy) is not set back: it resumes above them, and the hand-over waits.
///
/// Fencing tokens never go backwards, even when the server loses its data or a failover loses the
/// newest increments: each token is the counter + 1 or the server's clock in microseconds (`TIME`),
/// whichever is larger, so a counter that lost writes (or all of them) resumes above any token it
/// gave out, unless it was incremented more than a million times a second or the new server's clock
/// is behind the old one's by more than the time the failover took.
const ACQUIRE: &str = concat!(
    dataset_lua!(),
    r"
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
local function record(fence)
  redis.call('SET', KEYS[4], fence .. ' ' .. string.format('%.0f', micros + tonumber(ARGV[3]) * 1000) .. ' ' .. ARGV[4])
end
local current = redis.call('GET', KEYS[1])
if current then
  if string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    local fence = string.match(current, ' fence=(%d+)')
    record(fence)
    return {tonumber(fence), 0, 0}
  end
  return {0, 0, 0}
end
local previous = redis.call('GET', KEYS[2])
local counter = tonumber(previous or '0')
local clean, clean_set = string.match(redis.call('GET', KEYS[3]) or '', '^(%d+) ?(%S*)$')
local f, expiry, b = string.match(redis.call('GET', KEYS[4]) or '', '^(%d+) (%d+) (%d+)')
local recorded = math.max(tonumber(clean or '0'), tonumber(f or '0'))
if previous and recorded > counter then
  return {-1, counter, recorded}
end
local status, bound = 0, 0
local here = dataset()
if previous and previous == clean and clean_set == here and here ~= '' then
  status = 1
elseif previous and f == previous then
  bound = tonumber(b)
  if tonumber(expiry) <= micros then
    status = 2
  end
end
-- A counter that is gone while its records are not (evicted, deleted) resumes above them.
local fence = math.max(math.max(counter, recorded) + 1, micros)
-- Lua would print a number this large as 1.79e+15: the records keep every digit.
local fenced = string.format('%.0f', fence)
redis.call('SET', KEYS[2], fenced)
redis.call('SET', KEYS[1], ARGV[1] .. ' fence=' .. fenced .. ' ' .. ARGV[2], 'NX', 'PX', ARGV[3])
record(fenced)
return {fence, status, bound}
"
);

/// KEYS: lock, lease record. ARGV: token, ttl (ms), fence, this holder's bound (ms). The lease
/// record follows the lease's expiry, so the next holder can tell a lease that ran out from one
/// taken away.
const RENEW: &str = r"
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  local now = redis.call('TIME')
  local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
  redis.call('SET', KEYS[2], ARGV[3] .. ' ' .. string.format('%.0f', micros + tonumber(ARGV[2]) * 1000) .. ' ' .. ARGV[4])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// KEYS: lock, clean marker, release channel (a channel, listed for cluster routing). The marker
/// names the dataset that wrote it (`ACQUIRE`).
const RELEASE: &str = concat!(
    dataset_lua!(),
    r"
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], string.match(current, ' fence=(%d+)') .. ' ' .. dataset())
  redis.call('PUBLISH', KEYS[3], ARGV[1])
  return 1
end
return 0
"
);

/// Claims a window for a scheduled run. KEYS: lock, window claim. ARGV: token, window start (µs),
/// window end (µs), claim record without its time. The claim has no expiry, like the fencing
/// counter: one small key per lock name, which no eviction policy for expiring keys can take and no
/// run, however long, can outlive. Returns 1 when claimed; 0 and the
/// last claim when it blocks the window (it is this window or a later one, or its run ended after this
/// window started: `Claim::blocks`); -1 when the lease is not ours; -2 when the server's clock is
/// outside the window. The claim only ever moves forward.
const CLAIM: &str = r"
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then
  return {-1, ''}
end
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
if micros < tonumber(ARGV[2]) or micros >= tonumber(ARGV[3]) then
  return {-2, ''}
end
local last = redis.call('GET', KEYS[2])
if last then
  local start = tonumber(string.match(last, 'window_start=(%-?%d+)'))
  local finished = tonumber(string.match(last, 'finished_at=(%-?%d+)'))
  -- A claim whose command never started holds its own window no more, but still keeps every
  -- earlier one from being claimed (`Claim::blocks`).
  if string.find(last, ' not_started=1', 1, true) then
    if start and start > tonumber(ARGV[2]) then
      return {0, last}
    end
  elseif (start and start >= tonumber(ARGV[2])) or (finished and finished >= tonumber(ARGV[2])) then
    return {0, last}
  end
end
redis.call('SET', KEYS[2], ARGV[4] .. ' claimed_at=' .. string.format('%.0f', micros))
return {1, ''}
";

/// Adds a run's end to its claim, if the claim is still that run's. KEYS: window claim. ARGV: window
/// start (µs), holder id, exit code, the mark of a command that never started (`RunExit::text_mark`).
const RECORD_END: &str = r"
local last = redis.call('GET', KEYS[1])
if last and string.match(last, 'window_start=(%-?%d+)') == ARGV[1]
    and string.match(last, 'claimed_by=(%S+)') == ARGV[2] then
  local now = redis.call('TIME')
  local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
  redis.call('SET', KEYS[1], last .. ' exit_code=' .. ARGV[3] .. ' finished_at=' .. string.format('%.0f', micros) .. ARGV[4])
  return 1
end
return 0
";

/// After a failed renewal the guard reconnects and retries this often (or every renew-interval, if
/// shorter): a restarted server is found quickly, without a busy loop against a dead one.
const MAX_RETRY_INTERVAL: Duration = Duration::from_millis(250);
/// Pause between acquisition attempts whose reply was lost.
const ACQUIRE_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// A standby re-checks a held lease at least this often, and when it is due to expire.
const MAX_POLL: Duration = Duration::from_secs(1);
/// Spreads standbys that wake for the same expiry.
const MAX_JITTER_MS: u64 = 50;

/// The `{name}` hash tag keeps all the keys in one Redis Cluster slot.
#[derive(Clone)]
struct Keys {
    lock: String,
    fence: String,
    /// The fencing token of the last lease its owner released (rather than left to expire).
    clean: String,
    /// The last lease's fencing token, expiry on the server's clock, and its holder's bound.
    lease: String,
    /// Pub/sub channel on which a release is announced.
    released: String,
    /// The last window claimed by a scheduled run, and by whom.
    window: String,
}

impl Keys {
    fn new(prefix: &str, name: &str) -> Keys {
        let lock = format!("{prefix}:{{{name}}}");
        Keys {
            fence: format!("{lock}:fence"),
            clean: format!("{lock}:clean"),
            lease: format!("{lock}:lease"),
            released: format!("{lock}:released"),
            window: format!("{lock}:window"),
            lock,
        }
    }

    /// The Cluster slot of every key: the CRC16 of the hash tag (what lies between the first `{` and
    /// the next `}`), modulo 16384, as Redis computes it.
    fn slot(&self) -> u16 {
        let tag = self
            .lock
            .split_once('{')
            .and_then(|(_, rest)| rest.split_once('}'))
            .map_or(self.lock.as_str(), |(tag, _)| tag);
        crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % 16384
    }
}

/// A connection to the node that holds the lock's keys, or to a whole Cluster.
#[derive(Clone)]
enum Conn {
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

impl Conn {
    /// `WAIT` on the node that owns `keys`' slot: there the lock's writes were made.
    async fn wait(
        &mut self,
        keys: &Keys,
        replicas: u32,
        limit: Duration,
    ) -> Result<i64, RedisError> {
        let mut wait = redis::cmd("WAIT");
        // WAIT 0 would block for ever.
        wait.arg(replicas).arg(millis(limit).max(1));
        match self {
            Conn::Node(conn) | Conn::Primary { conn, .. } => wait.query_async(conn).await,
            Conn::Cluster(conn) => {
                let route = Route::new(keys.slot(), SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                redis::from_redis_value(conn.route_command(wait, routing).await?)
                    .map_err(RedisError::from)
            }
        }
    }
}

async fn connect(target: &RedisTarget, limit: Duration) -> Result<Conn, RedisError> {
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
async fn forget_demoted(target: &RedisTarget, slot: &mut Option<Conn>, limit: Duration) {
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
async fn connected(target: &RedisTarget, limit: Duration) -> Result<Conn, LockError> {
    match timeout(limit, connect(target, limit)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(lock_error(target, &e)),
        Err(_) => Err(no_answer(target, limit)),
    }
}

/// A failure that a retry cannot mend (wrong password, bad configuration, script error). A node that
/// is no longer (or not yet) the primary, a failover in progress, or sentinels that know no healthy
/// primary for the moment are mended by asking again.
fn is_permanent(e: &RedisError) -> bool {
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

fn lock_error(target: &RedisTarget, e: &RedisError) -> LockError {
    let message = format!("{}: {}", target.url, target.url.scrub(e));
    match e.kind() {
        ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig => {
            LockError::Refused(message)
        }
        // `SELECT` of a database the server does not have: no retry will find it.
        _ if message.contains("refused to switch database") => LockError::Refused(format!(
            "{message} (the URL's /db is beyond the server's `databases` setting)"
        )),
        _ if e.is_timeout() => connect_failure(format!("{message}{}", tls_hint(target))),
        _ => connect_failure(message),
    }
}

fn no_answer(target: &RedisTarget, limit: Duration) -> LockError {
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
fn bound(timings: &Timings) -> Duration {
    timings.ttl + timings.grace_period
}

fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

enum Attempt {
    Won {
        conn: Conn,
        fence: i64,
        previous: Previous,
        sent: Deadline,
    },
    Held {
        holder: HolderInfo,
        expires_in: Duration,
    },
}

/// A failed attempt, whether retrying could mend it, and whether anything could have reached the
/// server (a refused connection carried nothing, so no reply of it can have been lost).
struct Failure {
    error: LockError,
    permanent: bool,
    sent_nothing: bool,
}

impl Failure {
    fn redis(target: &RedisTarget, e: &RedisError) -> Failure {
        Failure {
            error: lock_error(target, e),
            permanent: is_permanent(e),
            // Only a server addressed directly: a cluster client retries inside, after a script
            // may have gone out, and an old primary refuses while sentinels move to a new one.
            sent_nothing: e.is_connection_refusal()
                && matches!(target.servers, RedisServers::Primary(_)),
        }
    }

    fn silent(target: &RedisTarget, limit: Duration) -> Failure {
        Failure {
            error: no_answer(target, limit),
            permanent: false,
            sent_nothing: false,
        }
    }
}

pub async fn acquire(
    target: &RedisTarget,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let timings = *request.timings;
    let patience = request.patience;
    let keys = Keys::new(&target.prefix, request.name.as_str());
    let token = format!("{:032x}", rand::random::<u128>());
    let script = Script::new(ACQUIRE);
    let mut invocation = script.key(&keys.lock);
    invocation
        .key(&keys.fence)
        .key(&keys.clean)
        .key(&keys.lease)
        .arg(&token)
        .arg(request.holder.to_string())
        .arg(millis(timings.ttl))
        .arg(millis(bound(&timings)));
    // Subscribed before the first attempt, so a release in between is not missed.
    let mut releases = match patience {
        Patience::None => None,
        _ => subscribe(target, &keys, timings.connect_timeout).await,
    };
    let mut conn = None;
    let fail_closed_at = Instant::now() + timings.connect_timeout;
    let mut answered = false;
    // Whether an earlier attempt may have sent the script, whose lease a lost reply would leave.
    let mut maybe_sent = false;
    let (mut contention, mut backoff) = (Contention::new(&**request.observer), Backoff::new());
    loop {
        let failure = match attempt(target, &mut conn, &invocation, &keys, &timings).await {
            Ok(Attempt::Won {
                conn,
                fence,
                previous,
                sent,
            }) => {
                info!(
                    event = "lock_acquired",
                    fencing_token = fence,
                    key = %keys.lock,
                    topology = target.topology(),
                    min_replicas = target.min_replicas,
                    ttl = %crate::vocab::show_duration(timings.ttl),
                    previous = %previous.reason(),
                    "redis lease acquired"
                );
                let lease = Lease {
                    target: target.clone(),
                    keys: keys.clone(),
                    token: token.clone(),
                    fence,
                    conn: Some(conn),
                    timings,
                    valid_until: sent + timings.lease_validity(),
                    observer: Arc::clone(request.observer),
                };
                return Ok(Acquisition::Acquired(HeldLock::new(RedisLock {
                    target: Box::new(target.clone()),
                    keys: Box::new(keys),
                    token,
                    fence,
                    previous,
                    watched: WatchedLock::spawn(lease.valid_until, |ends| lease.run(sent, ends)),
                })));
            }
            Ok(Attempt::Held { holder, expires_in }) => {
                if patience.exhausted() {
                    return Ok(contention.give_up(holder));
                }
                answered = true;
                backoff.reset();
                if contention.log_due() {
                    contention.waiting(&holder);
                }
                // A crashed holder's key frees only by expiry, which announces nothing.
                let jitter = Duration::from_millis(rand::random_range(0..MAX_JITTER_MS));
                wait_for_release(
                    &mut releases,
                    patience.cap(expires_in.min(MAX_POLL) + jitter),
                )
                .await;
                continue;
            }
            Err(failure) => failure,
        };
        if failure.permanent {
            return Err(failure.error);
        }
        if answered {
            if patience.exhausted() {
                return Err(failure.error);
            }
            backoff.pause(&failure.error, patience).await;
        } else {
            // Before the first answer the guard fails closed, but the acquire script is idempotent
            // for our token: a reply lost to a timeout is simply asked again until connect-timeout.
            // A refused first connection lost nothing: it fails at once, as on every backend.
            let nothing_sent = failure.sent_nothing && !maybe_sent;
            maybe_sent |= !failure.sent_nothing;
            if nothing_sent || Instant::now() + ACQUIRE_RETRY_PAUSE >= fail_closed_at {
                return Err(failure.error);
            }
            debug!(error = %failure.error, "redis acquisition attempt failed; retrying");
            tokio::time::sleep(ACQUIRE_RETRY_PAUSE).await;
        }
    }
}

/// One run of the acquire script, on the kept connection or a new one; a failed connection is dropped.
async fn attempt(
    target: &RedisTarget,
    slot: &mut Option<Conn>,
    invocation: &redis::ScriptInvocation<'_>,
    keys: &Keys,
    timings: &Timings,
) -> Result<Attempt, Failure> {
    forget_demoted(target, slot, timings.check_timeout / 2).await;
    let mut conn = match slot.take() {
        Some(conn) => conn,
        None => match timeout(
            timings.connect_timeout,
            connect(target, timings.connect_timeout),
        )
        .await
        {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(Failure::redis(target, &e)),
            Err(_) => return Err(Failure::silent(target, timings.connect_timeout)),
        },
    };
    let sent = Deadline::now();
    let (fence, previous, recorded) = match timeout(
        timings.check_timeout,
        invocation.invoke_async::<(i64, i64, u64)>(&mut conn),
    )
    .await
    {
        Ok(Ok(reply)) => reply,
        Ok(Err(e)) => return Err(Failure::redis(target, &e)),
        Err(_) => return Err(Failure::silent(target, timings.check_timeout)),
    };
    if fence == -1 {
        return Err(Failure {
            error: LockError::Unsafe(set_back_error(
                keys.lock.as_str(),
                &format!("its counter {} is below the token {recorded} its records hold", previous),
                &format!(
                    "If the counter was reset on purpose, delete {} and {} while no guard holds the \
                     lock: the next holder starts a new one above the server's clock",
                    keys.clean, keys.lease
                ),
            )),
            permanent: true,
            sent_nothing: false,
        });
    }
    // A late answer (the guard was frozen meanwhile) is asked again: the script is idempotent for
    // our token, and the next answer dates the lease afresh.
    if sent.elapsed() > timings.check_timeout {
        return Err(Failure::silent(target, timings.check_timeout));
    }
    if fence > 0 {
        if target.min_replicas > 0 {
            if let Err(failure) =
                acknowledged(&mut conn, target, keys, sent, timings.check_timeout).await
            {
                return Err(Failure {
                    error: LockError::Unreachable(format!("{}: {}", target.url, failure.message)),
                    permanent: false,
                    sent_nothing: false,
                });
            }
        }
        // A failover may lose the newest writes, among them an acquisition made after the release
        // or the renewal the records show: they prove nothing then (`release_marker_survives_failover`).
        // A lease that ran out waits too: its holder's guard stopped the app by the deadline,
        // unless the whole tree was frozen with it (`docker pause`, a paused VM), whose app runs
        // again for a moment when thawed.
        let previous = match previous {
            1 if target.release_marker_survives_failover() => Previous::Gone("released"),
            _ => Previous::MayRun {
                bound: match recorded {
                    0 => bound(timings),
                    ms => Duration::from_millis(ms),
                },
                why: match (previous, recorded) {
                    (2, _) => "expired",
                    (_, 0) => "no_record",
                    _ => "taken_away",
                },
            },
        };
        return Ok(Attempt::Won {
            conn,
            fence,
            previous,
            sent,
        });
    }
    let read = describe_holder(&mut conn, keys, timings.check_timeout).await;
    *slot = Some(conn);
    let (holder, expires_in) = read.unwrap_or_else(|| {
        (
            HolderInfo::default().with("holder", "unknown (released while being looked up)"),
            Duration::ZERO,
        )
    });
    Ok(Attempt::Held { holder, expires_in })
}

async fn subscribe(target: &RedisTarget, keys: &Keys, limit: Duration) -> Option<PubSub> {
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
async fn wait_for_release(releases: &mut Option<PubSub>, nap: Duration) {
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

/// Who holds `name` now, without taking it.
pub async fn status(
    target: &RedisTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<HolderInfo>, LockError> {
    let keys = Keys::new(&target.prefix, name.as_str());
    let mut conn = connected(target, connect_limit).await?;
    match timeout(answer, read_lease(&mut conn, &keys)).await {
        Ok(Ok(lease)) => Ok(lease.map(|(holder, _)| holder)),
        Ok(Err(e)) => Err(lock_error(target, &e)),
        Err(_) => Err(no_answer(target, answer)),
    }
}

/// The lock's record, without taking the lock: held while the lease lives, released when the last
/// lease's owner released it; a lease that ran out or was taken away was never released.
pub async fn last_record(
    target: &RedisTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<RecordFacts>, LockError> {
    let keys = Keys::new(&target.prefix, name.as_str());
    let mut conn = connected(target, connect_limit).await?;
    let mut pipe = redis::pipe();
    pipe.exists(&keys.lock).get(&keys.fence).get(&keys.clean);
    let read = pipe.query_async::<(bool, Option<u64>, Option<String>)>(&mut conn);
    let (held, counter, clean) = match timeout(answer, read).await {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => return Err(lock_error(target, &e)),
        Err(_) => return Err(no_answer(target, answer)),
    };
    let released = clean
        .as_deref()
        .and_then(|clean| clean.split(' ').next()?.parse::<u64>().ok())
        == counter;
    Ok(counter.map(|token| RecordFacts {
        state: if !held && released {
            RecordState::Released
        } else {
            RecordState::Held
        },
        token,
    }))
}

/// The holder's identity and fencing token from the key's value (never its secret token), and how
/// long its lease still runs. `None` once the key is gone or unreadable.
async fn describe_holder(
    conn: &mut Conn,
    keys: &Keys,
    limit: Duration,
) -> Option<(HolderInfo, Duration)> {
    timeout(limit, read_lease(conn, keys)).await.ok()?.ok()?
}

async fn read_lease(
    conn: &mut Conn,
    keys: &Keys,
) -> Result<Option<(HolderInfo, Duration)>, RedisError> {
    let (value, remaining_ms): (Option<String>, i64) = redis::pipe()
        .get(&keys.lock)
        .pttl(&keys.lock)
        .query_async(conn)
        .await?;
    Ok(value.map(|value| {
        let about = value.split_once(' ').map_or("", |(_, rest)| rest);
        let fence = about
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("fence="));
        let remaining = Duration::from_millis(remaining_ms.max(0) as u64);
        let holder = HolderInfo::default()
            .with("fencing_token", fence.unwrap_or("unknown"))
            .with_guard(Holder::parse(about))
            .with("ttl_remaining_ms", remaining.as_millis());
        (holder, remaining)
    }))
}

/// A held lease, kept alive by a renewal task.
pub struct RedisLock {
    /// For the scheduled runs' claims, which prove the lease is ours with its token.
    target: Box<RedisTarget>,
    keys: Box<Keys>,
    token: String,
    fence: i64,
    previous: Previous,
    watched: WatchedLock,
}

#[async_trait]
impl Held for RedisLock {
    fn previous(&self) -> Previous {
        self.previous
    }

    fn fencing_token(&self) -> Option<String> {
        Some(self.fence.to_string())
    }

    /// The release marker is trusted only where it survives a failover (see `ACQUIRE`).
    fn released_cleanly(&self) -> bool {
        self.previous == Previous::Gone("released")
    }

    fn app_deadline(&self) -> Option<tokio::sync::watch::Receiver<Deadline>> {
        Some(self.watched.app_deadline())
    }

    /// A lease needs nothing: it expires on the server's schedule.
    fn farewell(&self) -> Farewell<'_> {
        Farewell::none()
    }

    fn loss_reports(&self) -> Option<tokio::sync::watch::Receiver<Option<LockLoss>>> {
        Some(self.watched.loss_reports())
    }

    async fn lost(&mut self) -> LockLoss {
        self.watched.lost().await
    }

    /// Nothing to prepare: the release is one script on the renewal's connection.
    fn release_coming(&self) {}

    async fn give_back(self: Box<Self>) -> Result<(), LockError> {
        self.watched.release().await
    }
}

#[async_trait]
impl WindowStore for RedisLock {
    async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        let window = request.window;
        // The script dates the claim with the server's clock.
        let record = Claim::head(window.start, &request.holder.id, &request.holder.host);
        let script = Script::new(CLAIM);
        let mut invocation = script.key(&self.keys.lock);
        invocation
            .key(&self.keys.window)
            .arg(&self.token)
            .arg(window.start)
            .arg(window.end)
            .arg(record);
        let (claimed, last): (i64, String) =
            run_script(&self.target, &invocation, request.timings).await?;
        Ok(match claimed {
            1 => ClaimAnswer::Ours,
            0 => {
                let Some(last) = Claim::parse(&last) else {
                    return Err(LockError::Refused(format!(
                        "{} holds a window claim this guard cannot read; delete the key if nothing \
                         else writes it",
                        self.keys.window
                    )));
                };
                let outcome = last
                    .blocks(window)
                    .unwrap_or(WindowOutcome::ClaimedElsewhere);
                ClaimAnswer::Blocked(outcome, last)
            }
            -1 => ClaimAnswer::NotNow("the lease is no longer ours"),
            _ => ClaimAnswer::NotNow("the server's clock is outside the window"),
        })
    }

    async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError> {
        let script = Script::new(RECORD_END);
        let mut invocation = script.key(&self.keys.window);
        invocation
            .arg(request.window.start)
            .arg(&request.holder.id)
            .arg(exit.code)
            .arg(exit.text_mark());
        let recorded: i64 = run_script(&self.target, &invocation, request.timings).await?;
        if recorded == 0 {
            warn!(
                event = "run_end_unrecorded",
                window = request.window.index,
                "the window's claim is no longer this run's (lost in a failover?); its end is not recorded"
            );
        }
        Ok(())
    }
}

/// One script on a connection of its own, bounded by connect-timeout and check-timeout.
async fn run_script<T: redis::FromRedisValue>(
    target: &RedisTarget,
    invocation: &redis::ScriptInvocation<'_>,
    timings: &Timings,
) -> Result<T, LockError> {
    let mut conn = connected(target, timings.connect_timeout).await?;
    match timeout(timings.check_timeout, invocation.invoke_async(&mut conn)).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(e)) => Err(lock_error(target, &e)),
        Err(_) => Err(no_answer(target, timings.check_timeout)),
    }
}

/// The server's `TIME` in microseconds.
pub async fn server_clock(
    target: &RedisTarget,
    timings: &Timings,
) -> Result<UnixMicros, LockError> {
    let mut conn = connected(target, timings.connect_timeout).await?;
    let time = redis::cmd("TIME");
    match timeout(
        timings.check_timeout,
        time.query_async::<(i64, i64)>(&mut conn),
    )
    .await
    {
        Ok(Ok((secs, micros))) => Ok(secs * 1_000_000 + micros),
        Ok(Err(e)) => Err(lock_error(target, &e)),
        Err(_) => Err(no_answer(target, timings.check_timeout)),
    }
}

/// The last claimed window of `name`, for `status` and the scheduler.
pub async fn last_claim(
    target: &RedisTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<Claim>, LockError> {
    let keys = Keys::new(&target.prefix, name.as_str());
    let mut conn = connected(target, connect_limit).await?;
    let mut get = redis::cmd("GET");
    get.arg(&keys.window);
    match timeout(answer, get.query_async::<Option<String>>(&mut conn)).await {
        Ok(Ok(value)) => Ok(value.as_deref().and_then(Claim::parse)),
        Ok(Err(e)) => Err(lock_error(target, &e)),
        Err(_) => Err(no_answer(target, answer)),
    }
}

/// `WAIT`s until `--redis-min-replicas` replicas have every write made on `conn` so far, within what
/// is left of `limit` since `sent`.
async fn acknowledged(
    conn: &mut Conn,
    target: &RedisTarget,
    keys: &Keys,
    sent: Deadline,
    limit: Duration,
) -> Result<(), ScriptFailure> {
    let wanted = target.min_replicas;
    let left = limit.saturating_sub(sent.elapsed());
    let failure = |outcome, message| Err(ScriptFailure { outcome, message });
    // The server answers with its count a little before the guard stops listening.
    match timeout(left, conn.wait(keys, wanted, left * 9 / 10)).await {
        Ok(Ok(acked)) if acked >= i64::from(wanted) => Ok(()),
        Ok(Ok(acked)) => failure(
            CheckOutcome::Timeout,
            format!(
                "{acked} of --redis-min-replicas {wanted} replicas acknowledged within {}",
                crate::vocab::show_duration(round(limit))
            ),
        ),
        Ok(Err(e)) => failure(CheckOutcome::Error, target.url.scrub(e)),
        Err(_) => failure(
            CheckOutcome::Timeout,
            format!(
                "WAIT for {wanted} replicas did not answer within {}",
                crate::vocab::show_duration(round(limit))
            ),
        ),
    }
}

struct Lease {
    target: RedisTarget,
    keys: Keys,
    token: String,
    /// Written with each renewal into the lease record.
    fence: i64,
    /// Dropped after any error or timeout: a connection in an unknown state is never reused.
    conn: Option<Conn>,
    timings: Timings,
    /// Send time of the last confirmed acquire or renewal + ttl - drift margin.
    valid_until: Deadline,
    observer: Arc<dyn Observer>,
}

/// A script invocation that did not answer with a value.
struct ScriptFailure {
    outcome: CheckOutcome,
    message: String,
}

enum Renewal {
    Confirmed {
        sent: Deadline,
    },
    NotOwner,
    /// The server answered `ROLE` as a replica: demoted in place.
    Demoted(String),
    Failed(String),
}

enum Step {
    Renewed(Renewal),
    MustStop,
    Release,
}

impl Lease {
    async fn run(mut self, acquired_at: Deadline, mut ends: WatcherEnds) -> Result<(), LockError> {
        let retry = self.timings.renew_interval.min(MAX_RETRY_INTERVAL);
        let mut next_attempt = acquired_at + self.timings.renew_interval;
        loop {
            // The app needs grace-period to stop before the lease can run out.
            let stop_at = self.valid_until.minus(self.timings.grace_period);
            let step = tokio::select! {
                biased;
                _ = deadline::sleep_until(stop_at) => Step::MustStop,
                _ = &mut ends.release => Step::Release,
                renewal = self.renew_at(next_attempt) => Step::Renewed(renewal),
            };
            match step {
                Step::Renewed(Renewal::Confirmed { sent }) => {
                    self.valid_until = sent + self.timings.lease_validity();
                    ends.app_dead_by(self.valid_until);
                    next_attempt = sent + self.timings.renew_interval;
                    debug!("redis lease renewed");
                }
                Step::Renewed(Renewal::NotOwner) => {
                    ends.report(LockLoss {
                        reason: LossReason::NotOwner,
                        detail: format!(
                            "{} is gone, expired or holds another token",
                            self.keys.lock
                        ),
                    });
                    return Ok(());
                }
                Step::Renewed(Renewal::Demoted(detail)) => {
                    ends.report(LockLoss {
                        reason: LossReason::PrimaryDemoted,
                        detail,
                    });
                    return Ok(());
                }
                Step::Renewed(Renewal::Failed(error)) => {
                    let left = self.valid_until.remaining();
                    warn!(event = "renewal_failed", error = %error, lease_left = %crate::vocab::show_duration(round(left)), "redis lease renewal failed; retrying");
                    next_attempt = Deadline::after(retry);
                }
                Step::MustStop => {
                    ends.report(LockLoss {
                        reason: LossReason::LeaseExpiring,
                        detail: format!(
                            "no renewal confirmed in time; the lease may run out in {}",
                            crate::vocab::show_duration(round(self.valid_until.remaining()))
                        ),
                    });
                    return Ok(());
                }
                Step::Release => return self.release().await,
            }
        }
    }

    async fn renew_at(&mut self, at: Deadline) -> Renewal {
        deadline::sleep_until(at).await;
        // Sent before the role is asked, so the time it takes counts against the renewal's budget
        // and the lease is counted from no later than the question.
        let sent = Deadline::now();
        if let Some(role) = self.demoted().await {
            return Renewal::Demoted(format!(
                "the server now answers ROLE as {role}: it was demoted from primary while holding the lock"
            ));
        }
        let renew = Script::new(RENEW);
        let mut invocation = renew.key(&self.keys.lock);
        invocation
            .key(&self.keys.lease)
            .arg(&self.token)
            .arg(millis(self.timings.ttl))
            .arg(self.fence)
            .arg(millis(bound(&self.timings)));
        let result = match self.bounded(&invocation).await {
            Ok(1) if self.target.min_replicas > 0 => self.replicated(sent).await.map(|()| 1),
            answered => answered,
        };
        let outcome = match &result {
            Ok(1) => CheckOutcome::Ok,
            Ok(_) => CheckOutcome::Error,
            Err(failure) => failure.outcome,
        };
        let took = sent.elapsed();
        self.observer.check(outcome, took);
        match result {
            // A confirmation read after check-timeout proves nothing about now: the guard may have
            // been frozen while the lease ran out and another instance took it.
            Ok(1) if took > self.timings.check_timeout => Renewal::Failed(format!(
                "the renewal was confirmed after {}, beyond --check-timeout",
                crate::vocab::show_duration(round(took))
            )),
            Ok(1) => Renewal::Confirmed { sent },
            Ok(_) => Renewal::NotOwner,
            Err(failure) => Renewal::Failed(failure.message),
        }
    }

    /// The role of the server a kept connection reaches, if it is no longer the primary. A replica
    /// configured with `replica-read-only no` would go on accepting the renewals while the new
    /// primary's copy of the key runs out; the sentinels may not be there to say so. (New
    /// connections check `ROLE` as they are made; Cluster nodes answer `MOVED`.) Without an answer
    /// the renewal itself finds out what is wrong.
    async fn demoted(&mut self) -> Option<&'static str> {
        let (conn, sentinel) = match self.conn.as_mut() {
            Some(Conn::Node(conn)) => (conn, false),
            Some(Conn::Primary { conn, .. }) => (conn, true),
            _ => return None,
        };
        let role = timeout(
            self.timings.check_timeout / 2,
            redis::cmd("ROLE").query_async::<Role>(conn),
        )
        .await;
        match role {
            Ok(Ok(Role::Primary { .. })) | Ok(Err(_)) | Err(_) => None,
            // With Sentinel a demoted node is a failover to ride through: the renewal reconnects
            // to the primary the sentinels name, and counts only where the token is still ours.
            Ok(Ok(_)) if sentinel => {
                self.conn = None;
                None
            }
            Ok(Ok(Role::Replica { .. })) => Some("a replica"),
            Ok(Ok(_)) => Some("something other than a primary"),
        }
    }

    /// Runs one script invocation within check-timeout, on the kept connection or a new one.
    async fn bounded(
        &mut self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<i64, ScriptFailure> {
        let limit = self.timings.check_timeout;
        let target = &self.target;
        let slot = &mut self.conn;
        let result = timeout(limit, async {
            forget_demoted(target, slot, limit / 2).await;
            if let Some(conn) = slot.as_mut() {
                match invocation.invoke_async::<i64>(conn).await {
                    // Broken since its last use (a server restart, say): one more try on a fresh
                    // connection, within the same bound. Every script here is safe to run twice.
                    Err(e) if e.is_connection_dropped() || e.is_io_error() => *slot = None,
                    answered => return answered,
                }
            }
            let conn = slot.insert(connect(target, limit).await?);
            invocation.invoke_async::<i64>(conn).await
        })
        .await;
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                self.conn = None;
                Err(ScriptFailure {
                    outcome: CheckOutcome::Error,
                    message: self.target.url.scrub(e),
                })
            }
            Err(_) => {
                self.conn = None;
                Err(ScriptFailure {
                    outcome: CheckOutcome::Timeout,
                    message: format!("no answer within {}", crate::vocab::show_duration(limit)),
                })
            }
        }
    }

    /// The renewal sent at `sent` reached `--redis-min-replicas` replicas within check-timeout.
    async fn replicated(&mut self, sent: Deadline) -> Result<(), ScriptFailure> {
        let limit = self.timings.check_timeout;
        let Some(conn) = self.conn.as_mut() else {
            return Err(ScriptFailure {
                outcome: CheckOutcome::Error,
                message: "the connection was lost before WAIT".to_owned(),
            });
        };
        let result = acknowledged(conn, &self.target, &self.keys, sent, limit).await;
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    /// Compare-and-delete, then a message on the release channel for waiting instances. A key that
    /// holds another token is never deleted.
    async fn release(mut self) -> Result<(), LockError> {
        let release = Script::new(RELEASE);
        let mut invocation = release.key(&self.keys.lock);
        invocation
            .key(&self.keys.clean)
            .key(&self.keys.released)
            .arg(&self.token);
        match self.bounded(&invocation).await {
            Ok(1) => info!(event = "lock_released", key = %self.keys.lock, "redis lease released"),
            Ok(_) => {
                warn!(event = "release_failed", key = %self.keys.lock, "redis lease was no longer ours at release")
            }
            Err(failure) => {
                warn!(event = "release_failed", error = %failure.message, "redis lease release failed; it expires within ttl")
            }
        }
        Ok(())
    }
}

/// Durations in logs, to the millisecond.
fn round(d: Duration) -> Duration {
    Duration::from_millis(millis(d))
}

#[cfg(test)]
mod tests {
    use super::Keys;

    #[test]
    fn every_key_of_a_lock_is_in_the_slot_of_its_name() {
        // The slots the Redis Cluster tutorial shows for `foo` and `hello`.
        assert_eq!(Keys::new("sentinel-guard", "foo").slot(), 12182);
        assert_eq!(Keys::new("other:prefix", "hello").slot(), 866);
    }
}
