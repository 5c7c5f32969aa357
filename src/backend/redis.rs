//! A Redis lease: a key that expires unless renewed, taken and kept by compare-and-set scripts.
//!
//! A lease is not a connection, so its safety comes from a deadline kept on the guard's monotonic
//! clock, not from a socket: the lease is known valid until the *send* time of the last confirmed
//! acquire or renewal + ttl - drift margin. The app is told to stop grace-period before that deadline
//! and is SIGKILLed by it, whether or not Redis answers. A dropped connection is not a lost lease while
//! the deadline holds: the guard reconnects and retries.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, Script};
use tokio::time::{sleep_until, timeout, Instant};
use tracing::{debug, info, warn};

use super::watched::{WatchedLock, WatcherEnds};
use super::{Acquisition, HeldLock, LockError, LockLoss, LockRequest, LossReason};
use crate::config::{RedisTarget, Timings};

/// The value is `<token> fence=<n> <holder>`; the token is its first word.
const ACQUIRE: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  if string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return tonumber(string.match(current, ' fence=(%d+)'))
  end
  return 0
end
local fence = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' fence=' .. fence .. ' ' .. ARGV[2], 'NX', 'PX', ARGV[3])
return fence
";

const RENEW: &str = r"
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

const RELEASE: &str = r"
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[2], ARGV[1])
  return 1
end
return 0
";

/// After a failed renewal the guard retries at least this often.
const MAX_RETRY_INTERVAL: Duration = Duration::from_secs(1);
/// Pause between acquisition attempts whose reply was lost.
const ACQUIRE_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The `{name}` hash tag keeps all three keys in one Redis Cluster slot.
#[derive(Clone)]
struct Keys {
    lock: String,
    fence: String,
    released: String,
}

impl Keys {
    fn new(prefix: &str, name: &str) -> Keys {
        let lock = format!("{prefix}:{{{name}}}");
        Keys {
            fence: format!("{lock}:fence"),
            released: format!("{lock}:released"),
            lock,
        }
    }
}

async fn connect(
    target: &RedisTarget,
    limit: Duration,
) -> Result<MultiplexedConnection, RedisError> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit));
    target
        .client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// A failure that a retry cannot mend (wrong password, bad configuration, script error).
fn is_permanent(e: &RedisError) -> bool {
    !(e.is_io_error() || e.is_timeout() || e.is_connection_dropped())
}

fn lock_error(target: &RedisTarget, e: &RedisError) -> LockError {
    let message = format!("{}: {}", target.url, target.url.scrub(e));
    match e.kind() {
        ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig => {
            LockError::Refused(message)
        }
        _ => LockError::Unreachable(message),
    }
}

fn no_answer(target: &RedisTarget, limit: Duration) -> LockError {
    LockError::Unreachable(format!(
        "{}: no answer within {}",
        target.url,
        humantime::format_duration(limit)
    ))
}

fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

pub async fn try_acquire(
    target: &RedisTarget,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let timings = *request.timings;
    let keys = Keys::new(&target.prefix, request.name.as_str());
    let token = format!("{:032x}", rand::random::<u128>());
    let give_up_at = Instant::now() + timings.connect_timeout;
    // The script is idempotent for our token: a reply lost to a timeout cannot lock us out, so an
    // ambiguous attempt is simply repeated until connect-timeout is spent.
    let acquire = Script::new(ACQUIRE);
    let mut invocation = acquire.key(&keys.lock);
    invocation
        .key(&keys.fence)
        .arg(&token)
        .arg(request.holder.to_string())
        .arg(millis(timings.ttl));
    loop {
        let remaining = give_up_at.saturating_duration_since(Instant::now());
        let failure = match timeout(remaining, connect(target, remaining)).await {
            Err(_) => no_answer(target, timings.connect_timeout),
            Ok(Err(e)) if is_permanent(&e) => return Err(lock_error(target, &e)),
            Ok(Err(e)) => lock_error(target, &e),
            Ok(Ok(mut conn)) => {
                let sent = Instant::now();
                match timeout(
                    timings.check_timeout,
                    invocation.invoke_async::<i64>(&mut conn),
                )
                .await
                {
                    Ok(Ok(0)) => {
                        let holder = describe_holder(&mut conn, &keys, timings.check_timeout).await;
                        return Ok(Acquisition::HeldElsewhere(holder));
                    }
                    Ok(Ok(fence)) => {
                        info!(
                            fencing_token = fence,
                            key = %keys.lock,
                            ttl = %humantime::format_duration(timings.ttl),
                            "redis lease acquired"
                        );
                        let lease = Lease {
                            target: target.clone(),
                            keys,
                            token,
                            conn: Some(conn),
                            timings,
                            valid_until: sent + timings.redis_lease_validity(),
                        };
                        return Ok(Acquisition::Acquired(HeldLock::Redis(RedisLock {
                            fence,
                            watched: WatchedLock::spawn(|ends| lease.run(sent, ends)),
                        })));
                    }
                    Ok(Err(e)) if is_permanent(&e) => return Err(lock_error(target, &e)),
                    Ok(Err(e)) => lock_error(target, &e),
                    Err(_) => no_answer(target, timings.check_timeout),
                }
            }
        };
        if Instant::now() + ACQUIRE_RETRY_PAUSE >= give_up_at {
            return Err(failure);
        }
        debug!(error = %failure, "redis acquisition attempt failed; retrying");
        tokio::time::sleep(ACQUIRE_RETRY_PAUSE).await;
    }
}

/// The holder's identity and fencing token from the key's value (never its secret token), and how
/// long its lease still runs.
async fn describe_holder(conn: &mut MultiplexedConnection, keys: &Keys, limit: Duration) -> String {
    let read = timeout(
        limit,
        redis::pipe()
            .get(&keys.lock)
            .pttl(&keys.lock)
            .query_async::<(Option<String>, i64)>(conn),
    )
    .await;
    match read {
        Ok(Ok((Some(value), remaining_ms))) => {
            let about = value.split_once(' ').map_or("", |(_, rest)| rest);
            let remaining = Duration::from_millis(remaining_ms.max(0) as u64);
            format!(
                "{about} ttl_remaining={}",
                humantime::format_duration(remaining)
            )
        }
        Ok(Ok((None, _))) => "unknown (released while being looked up)".to_owned(),
        _ => "unknown (the holder could not be read)".to_owned(),
    }
}

/// A held lease, kept alive by a renewal task.
pub struct RedisLock {
    fence: i64,
    watched: WatchedLock,
}

impl RedisLock {
    pub fn fencing_token(&self) -> i64 {
        self.fence
    }

    pub async fn lost(&mut self) -> LockLoss {
        self.watched.lost().await
    }

    pub async fn release(self) -> Result<(), LockError> {
        self.watched.release().await
    }
}

struct Lease {
    target: RedisTarget,
    keys: Keys,
    token: String,
    /// Dropped after any error or timeout: a connection in an unknown state is never reused.
    conn: Option<MultiplexedConnection>,
    timings: Timings,
    /// Send time of the last confirmed acquire or renewal + ttl - drift margin.
    valid_until: Instant,
}

enum Renewal {
    Confirmed { sent: Instant },
    NotOwner,
    Failed(String),
}

enum Step {
    Renewed(Renewal),
    MustStop,
    Release,
}

impl Lease {
    async fn run(mut self, acquired_at: Instant, mut ends: WatcherEnds) -> Result<(), LockError> {
        let retry = self.timings.renew_interval.min(MAX_RETRY_INTERVAL);
        let mut next_attempt = acquired_at + self.timings.renew_interval;
        loop {
            // The app needs grace-period to stop before the lease can run out.
            let stop_at = self
                .valid_until
                .checked_sub(self.timings.grace_period)
                .unwrap_or(self.valid_until);
            let step = tokio::select! {
                _ = sleep_until(stop_at) => Step::MustStop,
                _ = &mut ends.release => Step::Release,
                renewal = self.renew_at(next_attempt) => Step::Renewed(renewal),
            };
            match step {
                Step::Renewed(Renewal::Confirmed { sent }) => {
                    self.valid_until = sent + self.timings.redis_lease_validity();
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
                Step::Renewed(Renewal::Failed(error)) => {
                    let left = self.valid_until.saturating_duration_since(Instant::now());
                    warn!(error = %error, lease_left = %humantime::format_duration(round(left)), "redis lease renewal failed; retrying");
                    next_attempt = Instant::now() + retry;
                }
                Step::MustStop => {
                    ends.report(LockLoss {
                        reason: LossReason::LeaseExpiring,
                        detail: format!(
                            "no renewal confirmed in time; the lease may run out in {}",
                            humantime::format_duration(round(
                                self.valid_until.saturating_duration_since(Instant::now())
                            ))
                        ),
                    });
                    return Ok(());
                }
                Step::Release => return self.release().await,
            }
        }
    }

    async fn renew_at(&mut self, at: Instant) -> Renewal {
        sleep_until(at).await;
        let sent = Instant::now();
        let renew = Script::new(RENEW);
        let mut invocation = renew.key(&self.keys.lock);
        invocation.arg(&self.token).arg(millis(self.timings.ttl));
        match self.bounded(&invocation).await {
            Ok(1) => Renewal::Confirmed { sent },
            Ok(_) => Renewal::NotOwner,
            Err(error) => Renewal::Failed(error),
        }
    }

    /// Runs one script invocation within check-timeout, on the kept connection or a new one.
    async fn bounded(&mut self, invocation: &redis::ScriptInvocation<'_>) -> Result<i64, String> {
        let limit = self.timings.check_timeout;
        let target = &self.target;
        let slot = &mut self.conn;
        let result = timeout(limit, async {
            let conn = match slot {
                Some(conn) => conn,
                None => slot.insert(connect(target, limit).await?),
            };
            invocation.invoke_async::<i64>(conn).await
        })
        .await;
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                self.conn = None;
                Err(self.target.url.scrub(e))
            }
            Err(_) => {
                self.conn = None;
                Err(format!(
                    "no answer within {}",
                    humantime::format_duration(limit)
                ))
            }
        }
    }

    /// Compare-and-delete, then a message on the release channel for waiting instances. A key that
    /// holds another token is never deleted.
    async fn release(mut self) -> Result<(), LockError> {
        let token = self.token.clone();
        let (lock, released) = (self.keys.lock.clone(), self.keys.released.clone());
        match self
            .bounded(Script::new(RELEASE).key(&lock).key(&released).arg(&token))
            .await
        {
            Ok(1) => info!(key = %lock, "redis lease released"),
            Ok(_) => warn!(key = %lock, "redis lease was no longer ours at release"),
            Err(error) => {
                warn!(error = %error, "redis lease release failed; it expires within ttl")
            }
        }
        Ok(())
    }
}

/// Durations in logs, to the millisecond.
fn round(d: Duration) -> Duration {
    Duration::from_millis(millis(d))
}
