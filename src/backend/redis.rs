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
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture, Role,
    Script, ServerErrorKind, ToRedisArgs, Value,
};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use super::renewing::{self, Renewable, Renewed};
use super::watched::WatchedLock;
use super::{
    acquire_lease, connect_failure, Acquisition, ClaimAnswer, ClaimRequest, Grant, Held, HeldLock,
    HolderInfo, LeaseAnswer, LeaseFailure, LeaseTry, LockError, LockLoss, LockRequest, LossReason,
    Observer, Patience, WindowStore,
};
use crate::config::{LockName, RedisServers, RedisTarget, Timings};
use crate::deadline::{self, Deadline};
use crate::handoff::Farewell;
use crate::holder::Holder;
use crate::record::{set_back_error, Previous, RecordFacts, RecordState};
use crate::vocab::CheckOutcome;
use crate::window::{Claim, RunExit, UnixMicros, Window, WindowOutcome};

mod acquire;
mod conn;
mod lease;
mod scripts;
pub use acquire::acquire;
use conn::{
    answers_as_primary, bound, connect, connected, forget_demoted, is_permanent, lock_error,
    millis, no_answer, subscribe, wait_for_release, Conn, ScriptCall,
};
use lease::{Lease, ScriptFailure};
use scripts::{ACQUIRE, CLAIM, NOT_PRIMARY, RECORD_END, RELEASE, RENEW, RENEWED_ROLE_UNASKED};
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

impl RedisLock {
    /// A claim the replicas may not have (`why`): said, and not run.
    fn unkept(&self, window: &Window, why: &str) -> ClaimAnswer {
        warn!(event = "claim_unreplicated", window = window.index, error = %why, "the window's claim may not have reached --redis-min-replicas replicas; a failover could lose it");
        ClaimAnswer::Unkept("the claim may not have reached --redis-min-replicas replicas")
    }
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
        let keys = [self.keys.lock.as_str(), &self.keys.window];
        let mut claim = ScriptCall::new(CLAIM, &keys);
        claim
            .arg(&self.token)
            .arg(window.start)
            .arg(window.end)
            .arg(record);
        // A connection per window, to a server that almost always has the script: loaded only
        // when it says it lacks it.
        let mut conn = connected(&self.target, request.timings.connect_timeout).await?;
        let limit = request.timings.check_timeout;
        let wait = replicas_wait(&self.target, limit);
        let ((claimed, last), acked): ((i64, String), _) =
            match timeout(limit, conn.call(&self.keys, &claim, wait, false)).await {
                Ok(Ok(answer)) => answer,
                // No answer, or a connection lost under it: the claim may be stored without the
                // replicas having it, and a read of it later could not tell (see below). A Cluster
                // client retries inside, so any error of it may follow a stored claim (an answer
                // is the script's, which knows its own claim).
                Err(_) if self.target.min_replicas > 0 => {
                    return Ok(self.unkept(window, &no_answer(&self.target, limit).to_string()))
                }
                Ok(Err(e))
                    if self.target.min_replicas > 0
                        && (e.is_io_error()
                            || e.is_timeout()
                            || e.is_connection_dropped()
                            || matches!(self.target.servers, RedisServers::Cluster { .. })) =>
                {
                    return Ok(self.unkept(window, &self.target.url.scrub(e)))
                }
                Err(_) => return Err(no_answer(&self.target, limit)),
                // A server's refusal: the script stopped before its one write.
                Ok(Err(e)) => return Err(lock_error(&self.target, &e)),
            };
        // A claim the replicas do not have is lost with the primary: a failover would let another
        // instance claim the window again. Not run, then: at most once, never twice.
        if claimed == 1 {
            if let Err(failure) = replicated(&self.target, acked, limit) {
                return Ok(self.unkept(window, &failure.message));
            }
        }
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
        let mut record = ScriptCall::new(RECORD_END, &[&self.keys.window]);
        record
            .arg(request.window.start)
            .arg(&request.holder.id)
            .arg(exit.code)
            .arg(exit.text_mark());
        let (target, timings) = (&self.target, request.timings);
        let mut conn = connected(target, timings.connect_timeout).await?;
        let limit = timings.check_timeout;
        let wait = replicas_wait(target, limit);
        let (recorded, acked): (i64, _) =
            match timeout(limit, conn.call(&self.keys, &record, wait, false)).await {
                Ok(Ok(reply)) => reply,
                Ok(Err(e)) => return Err(lock_error(target, &e)),
                Err(_) => return Err(no_answer(target, limit)),
            };
        if recorded == 0 {
            warn!(
                event = "run_end_unrecorded",
                window = request.window.index,
                "the window's claim is not this run's (lost in a failover, or never stored); its end is not recorded"
            );
            return Ok(());
        }
        // Recorded on the primary only, the end could be lost with it: said, as a failure to record.
        replicated(target, acked, limit).map_err(|failure| {
            LockError::Unreachable(format!("{}: {}", target.url, failure.message))
        })
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

/// The `WAIT` a write is followed by for `--redis-min-replicas`, within most of `limit`: the server
/// answers with its count a little before the guard stops listening.
fn replicas_wait(target: &RedisTarget, limit: Duration) -> Option<(u32, Duration)> {
    (target.min_replicas > 0).then(|| (target.min_replicas, limit * 9 / 10))
}

/// Whether the `WAIT` that followed a write (`acked`, if one was asked for) counted
/// `--redis-min-replicas` replicas.
fn replicated(
    target: &RedisTarget,
    acked: Option<i64>,
    limit: Duration,
) -> Result<(), ScriptFailure> {
    let wanted = target.min_replicas;
    match acked {
        Some(acked) if acked < i64::from(wanted) => Err(ScriptFailure {
            outcome: CheckOutcome::Timeout,
            message: format!(
                "{acked} of --redis-min-replicas {wanted} replicas acknowledged within {}",
                crate::vocab::show_duration(limit)
            ),
        }),
        _ => Ok(()),
    }
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
