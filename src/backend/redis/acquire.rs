//! Taking a Redis lease: the acquire script, run until it grants the lease or patience runs out.

use super::*;

enum Attempt {
    Won(Grant<Conn>),
    Held {
        holder: HolderInfo,
        expires_in: Duration,
    },
}

/// A failed attempt: an error of the server or of the connection to it.
fn redis_failure(target: &RedisTarget, e: &RedisError) -> LeaseFailure {
    LeaseFailure {
        error: lock_error(target, e),
        permanent: is_permanent(e),
        // Only a server addressed directly: a cluster client retries inside, after a script may
        // have gone out, and an old primary refuses while sentinels move to a new one.
        sent_nothing: e.is_connection_refusal()
            && matches!(target.servers, RedisServers::Primary(_)),
    }
}

/// A failed attempt: the server answered, but not so that a grant can count (`why`).
fn unconfirmed(target: &RedisTarget, why: &str) -> LeaseFailure {
    LeaseFailure {
        error: LockError::Unreachable(format!("{}: {why}", target.url)),
        permanent: false,
        sent_nothing: false,
    }
}

/// The server is a replica (a primary demoted under a kept connection).
const NOT_PRIMARY_SAID: &str = "the server answers as a replica";

/// A failed attempt: no answer within `limit`.
fn silent_failure(target: &RedisTarget, limit: Duration) -> LeaseFailure {
    LeaseFailure {
        error: no_answer(target, limit),
        permanent: false,
        sent_nothing: false,
    }
}

pub async fn acquire(
    target: &RedisTarget,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let keys = Keys::new(&target.prefix, request.name.as_str());
    // Subscribed before the first attempt, so a release in between is not missed.
    let releases = match request.patience {
        Patience::None => None,
        _ => subscribe(target, &keys, request.timings.connect_timeout).await,
    };
    let attempts = RedisTry {
        target,
        request,
        token: format!("{:032x}", rand::random::<u128>()),
        keys,
        releases,
        conn: None,
    };
    acquire_lease(attempts, request).await
}

/// Taking a Redis lease: the acquire script, run until it grants the lease.
struct RedisTry<'a> {
    target: &'a RedisTarget,
    request: &'a LockRequest<'a>,
    token: String,
    keys: Keys,
    /// The release channel, while subscribed.
    releases: Option<PubSub>,
    /// Kept between attempts while it works.
    conn: Option<Conn>,
}

impl LeaseTry for RedisTry<'_> {
    /// The connection the lease was granted on.
    type Lease = Conn;
    /// How long the lease found has left.
    type Found = Duration;

    async fn attempt(&mut self) -> Result<LeaseAnswer<Conn, Duration>, LeaseFailure> {
        let timings = self.request.timings;
        let keys = &self.keys;
        let lease_keys = [keys.lock.as_str(), &keys.fence, &keys.clean, &keys.lease];
        let mut call = ScriptCall::new(ACQUIRE, &lease_keys);
        call.arg(&self.token)
            .arg(self.request.holder.to_string())
            .arg(millis(timings.ttl))
            .arg(millis(bound(timings)));
        match attempt(self.target, &mut self.conn, &call, &self.keys, timings).await? {
            Attempt::Won(won) => Ok(LeaseAnswer::Granted(won)),
            Attempt::Held { holder, expires_in } => Ok(LeaseAnswer::Held(holder, expires_in)),
        }
    }

    fn hold(self, won: Grant<Conn>) -> HeldLock {
        let (target, timings) = (self.target, *self.request.timings);
        let Grant {
            lease: conn,
            fence,
            previous,
            sent,
        } = won;
        info!(
            event = "lock_acquired",
            fencing_token = fence,
            key = %self.keys.lock,
            topology = target.topology(),
            min_replicas = target.min_replicas,
            ttl = %crate::vocab::show_duration(timings.ttl),
            previous = %previous.reason(),
            "redis lease acquired"
        );
        let lease = Lease {
            target: target.clone(),
            keys: self.keys.clone(),
            token: self.token.clone(),
            fence,
            conn: Some(conn),
            timings,
            observer: Arc::clone(self.request.observer),
        };
        let valid_until = sent + timings.lease_validity();
        HeldLock::new(RedisLock {
            target: Box::new(target.clone()),
            keys: Box::new(self.keys),
            token: self.token,
            fence,
            previous,
            watched: WatchedLock::spawn(valid_until, |ends| {
                renewing::keep(lease, sent, valid_until, ends)
            }),
        })
    }

    async fn wait_for_release(&mut self, expires_in: Duration, patience: Patience) {
        // A crashed holder's key frees only by expiry, which announces nothing.
        let jitter = Duration::from_millis(rand::random_range(0..MAX_JITTER_MS));
        wait_for_release(
            &mut self.releases,
            patience.cap(expires_in.min(MAX_POLL) + jitter),
        )
        .await;
    }
}

/// One run of the acquire script, on the kept connection or a new one; a failed connection is dropped.
async fn attempt(
    target: &RedisTarget,
    slot: &mut Option<Conn>,
    call: &ScriptCall,
    keys: &Keys,
    timings: &Timings,
) -> Result<Attempt, LeaseFailure> {
    forget_demoted(target, slot, timings.check_timeout / 2).await;
    let (mut conn, fresh) = match slot.take() {
        Some(conn) => (conn, false),
        None => match timeout(
            timings.connect_timeout,
            connect(target, timings.connect_timeout),
        )
        .await
        {
            Ok(Ok(conn)) => (conn, true),
            Ok(Err(e)) => return Err(redis_failure(target, &e)),
            Err(_) => return Err(silent_failure(target, timings.connect_timeout)),
        },
    };
    let sent = Deadline::now();
    let wait = replicas_wait(target, timings.check_timeout);
    let ((fence, previous, recorded, role_read), acked) = match timeout(
        timings.check_timeout,
        conn.call::<(i64, i64, u64, i64)>(keys, call, wait, fresh),
    )
    .await
    {
        Ok(Ok(reply)) => reply,
        Ok(Err(e)) => return Err(redis_failure(target, &e)),
        Err(_) => return Err(silent_failure(target, timings.check_timeout)),
    };
    if fence == -1 {
        return Err(LeaseFailure {
            error: LockError::Unsafe(set_back_error(
                keys.lock.as_str(),
                &format!("its counter {previous} is below the token {recorded} its records hold"),
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
    if fence == NOT_PRIMARY {
        return Err(unconfirmed(target, NOT_PRIMARY_SAID));
    }
    // A retry that finds its own grant is answered as that grant was (the lock's value keeps what
    // it found of the previous holder; a release only on the same dataset): a lost or late answer
    // costs no knowledge.
    let previous = previous_of(target, timings, previous, recorded);
    // A grant from a server whose role the script could not read: a replica with
    // `replica-read-only no` (a primary demoted under a standby's kept connection) grants what its
    // primary may have granted too.
    if fence > 0 && role_read == 0 {
        let left = timings.check_timeout.saturating_sub(sent.elapsed());
        match answers_as_primary(target, &mut conn, left).await {
            Ok(true) => {}
            Ok(false) => return Err(unconfirmed(target, NOT_PRIMARY_SAID)),
            Err(failure) => return Err(unconfirmed(target, &failure.message)),
        }
    }
    // A late answer (the guard was frozen meanwhile) is asked again: the script is idempotent for
    // our token, and the next answer dates the lease afresh.
    if sent.elapsed() > timings.check_timeout {
        return Err(silent_failure(target, timings.check_timeout));
    }
    if fence > 0 {
        if let Err(failure) = replicated(target, acked, timings.check_timeout) {
            return Err(unconfirmed(target, &failure.message));
        }
        return Ok(Attempt::Won(Grant {
            lease: conn,
            fence,
            previous,
            sent,
        }));
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

/// What the acquire script's `answer` (and the bound `recorded` by the previous holder, in ms; 0
/// for none) says of the previous holder's app.
fn previous_of(target: &RedisTarget, timings: &Timings, answer: i64, recorded: u64) -> Previous {
    // A failover may lose the newest writes, among them an acquisition made after the release or
    // the renewal the records show: they prove nothing then (`release_marker_survives_failover`).
    // A lease that ran out waits too: its holder's guard stopped the app by the deadline, unless
    // the whole tree was frozen with it (`docker pause`, a paused VM), whose app runs again for a
    // moment when thawed.
    match answer {
        1 if target.release_marker_survives_failover() => Previous::Gone("released"),
        _ => Previous::MayRun {
            bound: match recorded {
                0 => bound(timings),
                ms => Duration::from_millis(ms),
            },
            why: match (answer, recorded) {
                (2, _) => "expired",
                (_, 0) => "no_record",
                _ => "taken_away",
            },
        },
    }
}
