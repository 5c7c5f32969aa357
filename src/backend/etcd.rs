//! An etcd lease: a key attached to a lease that expires unless kept alive, taken with a transaction
//! that puts it only if it does not exist.
//!
//! As with Redis, the safety comes from a deadline kept on the guard's monotonic clock, not from a
//! connection: the lease is known valid until the *send* time of the last keep-alive the cluster
//! acknowledged + ttl - drift margin (etcd starts the lease's new ttl when its leader handles the
//! keep-alive, which is after it was sent; a new leader only extends leases). The app is told to
//! stop grace-period before that deadline and is SIGKILLed by it, whatever the cluster says.
//!
//! Every renewal also proves, in a transaction, that the key still holds this lease and was created
//! by this acquisition (its create revision, which is the fencing token: cluster-wide and
//! monotonic); anything else is a lost lock. The lock record (`<prefix>/record/<name>`) is written
//! in the same transaction as each acquisition, release and farewell, so the next holder knows
//! whether the old app's tree is gone; etcd commits through its quorum, so the record survives a
//! failover. A standby watches the key's deletion rather than polling.

mod http;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use tokio::time::{timeout, Instant};
use tracing::{debug, info, warn};

use self::http::{base64, int, text, CallError, Client};
use super::farewell::{Server, SessionFarewell};
use super::renewing::{self, Renewable, Renewed};
use super::watched::WatchedLock;
use super::{
    acquire_lease, Acquisition, ClaimAnswer, ClaimRequest, Grant, Held, HeldLock, HolderInfo,
    LeaseAnswer, LeaseFailure, LeaseTry, LockError, LockLoss, LockRequest, LossReason, Observer,
    Patience, WindowStore,
};
use crate::config::{EtcdTarget, LockName, Target, Timings};
use crate::deadline::{self, Deadline};
use crate::handoff::Farewell;
use crate::holder::Holder;
use crate::record::{Previous, RecordFacts, RecordState};
use crate::vocab::CheckOutcome;
use crate::window::RunExit;

mod renewal;
pub use renewal::end_session;
use renewal::Renewal;

/// The longest a standby sleeps between attempts when its watch did not report the key's deletion.
const MAX_POLL: Duration = Duration::from_secs(2);

/// The keys of one lock.
#[derive(Clone)]
struct Keys {
    lock: String,
    record: String,
}

impl Keys {
    fn of(target: &EtcdTarget, name: &LockName) -> Keys {
        Keys {
            lock: target.lock_key(name.as_str()),
            record: target.record_key(name.as_str()),
        }
    }
}

/// The lock record's value: `<state> <token> <bound ms> <holder id>`. A held record's token is the
/// record's own mod revision (written in the acquisition's transaction, so equal to the key's create
/// revision), which the transaction cannot know before it commits.
fn record_value(state: RecordState, token: i64, bound: Duration, holder_id: &str) -> String {
    format!(
        "{} {token} {} {holder_id}",
        state.as_str(),
        bound.as_millis()
    )
}

/// What a record says of the previous holder; `None` when it is not one this program writes.
fn parse_record(kv: &Value) -> Option<(RecordState, i64, Duration)> {
    let value = text(&kv["value"]);
    let mut words = value.split(' ');
    let state = RecordState::parse(words.next()?)?;
    let token = words.next()?.parse::<i64>().ok()?;
    let bound = Duration::from_millis(words.next()?.parse().ok()?);
    let token = if state == RecordState::Held {
        int(&kv["mod_revision"])
    } else {
        token
    };
    Some((state, token, bound))
}

fn bound(timings: &Timings) -> Duration {
    timings.ttl + timings.grace_period
}

/// The ttl etcd is asked for: whole seconds, rounded up, so the server's lease is never shorter than
/// the one the guard counts.
fn ttl_secs(timings: &Timings) -> u64 {
    timings.ttl.as_secs() + u64::from(timings.ttl.subsec_nanos() > 0)
}

fn lock_error(target: &EtcdTarget, e: CallError) -> LockError {
    let message = target.url.scrub(&e);
    match e {
        CallError::Refused(_) => LockError::Refused(format!("{}: {message}", target.url)),
        CallError::Unreachable(_) | CallError::Silent(_) | CallError::Failed(_) => {
            LockError::Unreachable(format!("{}: {message}", target.url))
        }
    }
}

fn compare_ours(keys: &Keys, lease: i64, fence: i64) -> Value {
    json!([
        { "key": base64(&keys.lock), "target": "CREATE", "result": "EQUAL", "create_revision": fence.to_string() },
        { "key": base64(&keys.lock), "target": "LEASE", "result": "EQUAL", "lease": lease.to_string() },
    ])
}

/// Keeps lease `id` alive: its ttl as the cluster now counts it; 0 once it has expired or was revoked.
async fn keep_alive(client: &mut Client, id: i64, limit: Duration) -> Result<i64, CallError> {
    let answer = client
        .call(
            "/v3/lease/keepalive",
            &json!({ "ID": id.to_string() }),
            limit,
        )
        .await?;
    Ok(int(&answer["TTL"]))
}

/// A lease the acquisition has drawn, and the send time of the request that last granted or renewed it.
struct Drawn {
    id: i64,
    sent: Deadline,
}

pub async fn acquire(
    target: &EtcdTarget,
    request: &LockRequest<'_>,
) -> Result<Acquisition, LockError> {
    let client = Client::new(target).map_err(|e| lock_error(target, e))?;
    if target.credentials.is_some() && !target.tls {
        warn!(
            event = "credentials_in_clear",
            "the etcd password and token travel unencrypted over etcd://; use etcds://"
        );
    }
    let attempts = EtcdTry {
        target,
        request,
        keys: Keys::of(target, request.name),
        client,
        drawn: None,
    };
    acquire_lease(attempts, request).await
}

/// Taking an etcd lease: a lease drawn, then a transaction that puts the key on it if the key is
/// free.
struct EtcdTry<'a> {
    target: &'a EtcdTarget,
    request: &'a LockRequest<'a>,
    keys: Keys,
    client: Client,
    /// The lease drawn for the key, kept between attempts while it lives.
    drawn: Option<Drawn>,
}

impl LeaseTry for EtcdTry<'_> {
    /// The lease's id.
    type Lease = i64;
    /// The revision the key was found held at: the watch for its deletion starts after it.
    type Found = i64;

    async fn attempt(&mut self) -> Result<LeaseAnswer<i64, i64>, LeaseFailure> {
        match attempt(&mut self.client, &mut self.drawn, &self.keys, self.request).await {
            Ok(answer) => Ok(answer),
            Err(error) => {
                let error = lock_error(self.target, error);
                Err(LeaseFailure {
                    permanent: matches!(error, LockError::Refused(_)),
                    // Whatever failed, an attempt may have drawn a lease or put the key; asked
                    // again, a key found on the instance's own lease is its own.
                    sent_nothing: false,
                    error,
                })
            }
        }
    }

    fn hold(self, grant: Grant<i64>) -> HeldLock {
        let (target, request, timings) = (self.target, self.request, *self.request.timings);
        let Grant {
            lease,
            sent,
            fence,
            previous,
        } = grant;
        info!(
            event = "lock_acquired",
            fencing_token = fence,
            key = %self.keys.lock,
            lease = lease,
            member = %self.client.member(),
            ttl = %crate::vocab::show_duration(timings.ttl),
            previous = %previous.reason(),
            "etcd lease acquired"
        );
        let farewell = SessionFarewell {
            server: Server::Etcd,
            url: target.secret.clone(),
            session_id: lease as u64,
            revision: fence as u64,
            name: request.name.as_str().to_owned(),
            holder_id: request.holder.id.clone(),
            timeout: timings.connect_timeout + timings.check_timeout,
            ca_file: target.ca.as_ref().map(|ca| ca.path.clone()),
        };
        let renewal = Renewal {
            target: target.clone(),
            client: self.client,
            keys: self.keys,
            lease,
            fence,
            holder_id: request.holder.id.clone(),
            timings,
            observer: Arc::clone(request.observer),
        };
        let valid_until = sent + timings.lease_validity();
        HeldLock::new(EtcdLock {
            fence,
            previous,
            farewell: farewell.encode(),
            watched: WatchedLock::spawn(valid_until, |ends| {
                renewing::keep(renewal, sent, valid_until, ends)
            }),
        })
    }

    async fn wait_for_release(&mut self, revision: i64, patience: Patience) {
        let timings = self.request.timings;
        wait_for_deletion(
            &mut self.client,
            &self.keys,
            revision,
            patience.cap(MAX_POLL),
            timings,
        )
        .await;
    }

    /// The lease drawn for the key is revoked: nothing else would end it before its ttl.
    async fn abandon(&mut self) {
        if let Some(drawn) = self.drawn.take() {
            revoke(
                &mut self.client,
                drawn.id,
                self.request.timings.check_timeout,
            )
            .await;
        }
    }
}

/// A lease that has a renew-interval's time to live left at least: the one drawn before if a
/// keep-alive says it still lives, else a new one.
async fn fresh_lease(
    client: &mut Client,
    drawn: &mut Option<Drawn>,
    timings: &Timings,
    limit: Duration,
) -> Result<(i64, Deadline), CallError> {
    if let Some(lease) = drawn.as_mut() {
        if lease.sent.elapsed() < timings.renew_interval {
            return Ok((lease.id, lease.sent));
        }
        let sent = Deadline::now();
        if keep_alive(client, lease.id, limit).await? > 0 {
            lease.sent = sent;
            return Ok((lease.id, sent));
        }
    }
    let sent = Deadline::now();
    let answer = client
        .call(
            "/v3/lease/grant",
            &json!({ "TTL": ttl_secs(timings).to_string() }),
            limit,
        )
        .await?;
    let id = int(&answer["ID"]);
    if id == 0 {
        return Err(CallError::Failed(format!(
            "the cluster granted no lease: {}",
            answer["error"].as_str().unwrap_or("no reason given")
        )));
    }
    // etcd grants at least what is asked; a lease shorter than the one the guard counts (a proxy
    // or an etcd-compatible server that caps it) would expire before the app's deadline.
    let granted = int(&answer["TTL"]);
    if granted < i64::try_from(ttl_secs(timings)).unwrap_or(i64::MAX) {
        return Err(CallError::Refused(format!(
            "the cluster granted a lease of {granted}s for --ttl {}: it could expire before the app is stopped",
            crate::vocab::show_duration(timings.ttl)
        )));
    }
    *drawn = Some(Drawn { id, sent });
    Ok((id, sent))
}

async fn attempt(
    client: &mut Client,
    drawn: &mut Option<Drawn>,
    keys: &Keys,
    request: &LockRequest<'_>,
) -> Result<LeaseAnswer<i64, i64>, CallError> {
    let timings = request.timings;
    let limit = timings.connect_timeout.max(timings.check_timeout);
    let (lease, sent) = fresh_lease(client, drawn, timings, limit).await?;
    let held = record_value(RecordState::Held, 0, bound(timings), &request.holder.id);
    let txn = json!({
        "compare": [{ "key": base64(&keys.lock), "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
        "success": [
            { "request_range": { "key": base64(&keys.record) } },
            { "request_put": { "key": base64(&keys.lock), "value": base64(&request.holder.to_string()), "lease": lease.to_string() } },
            { "request_put": { "key": base64(&keys.record), "value": base64(&held) } },
        ],
        "failure": [{ "request_range": { "key": base64(&keys.lock) } }],
    });
    let answer = client.call("/v3/kv/txn", &txn, limit).await?;
    let revision = int(&answer["header"]["revision"]);
    let range = &answer["responses"][0]["response_range"];
    // Read as zeros and nulls, a stranger's answer would pass for a free or held lock.
    if revision <= 0 || !range.is_object() {
        return Err(CallError::Failed(
            "the transaction's answer is not an etcd answer (no revision or read)".to_owned(),
        ));
    }
    let first = &range["kvs"][0];
    if answer["succeeded"].as_bool() == Some(true) {
        let previous = match parse_record(first) {
            // A first holder cannot tell a first start from a record deleted with the key (an
            // operator's `etcdctl del --prefix`) while the old app still runs: it waits.
            None => Previous::MayRun {
                bound: bound(timings),
                why: "no_record",
            },
            Some((state, _, recorded)) => Previous::from_record(state, recorded),
        };
        // A put may attach the key to a lease that expired between the grant and the put (etcd
        // issue 11456): the lease must still live after the grant.
        let ttl = client
            .call(
                "/v3/lease/timetolive",
                &json!({ "ID": lease.to_string() }),
                limit,
            )
            .await?;
        if int(&ttl["TTL"]) <= 0 {
            *drawn = None;
            let txn = json!({ "compare": compare_ours(keys, lease, revision), "success": [{ "request_delete_range": { "key": base64(&keys.lock) } }] });
            let _ = client.call("/v3/kv/txn", &txn, limit).await;
            return Err(CallError::Failed(
                "the lease expired as the key was put; trying again".to_owned(),
            ));
        }
        return Ok(LeaseAnswer::Granted(Grant {
            lease,
            sent,
            fence: revision,
            previous,
        }));
    }
    // Our own put, whose answer was lost: the record it found is gone with that answer.
    if int(&first["lease"]) == lease {
        return Ok(LeaseAnswer::Granted(Grant {
            lease,
            sent,
            fence: int(&first["create_revision"]),
            previous: Previous::MayRun {
                bound: bound(timings),
                why: "no_record",
            },
        }));
    }
    Ok(LeaseAnswer::Held(holder_of(first), revision))
}

fn holder_of(kv: &Value) -> HolderInfo {
    if kv.is_null() {
        return HolderInfo::default().with("holder", "unknown (released while being looked up)");
    }
    HolderInfo::default()
        .with("fencing_token", int(&kv["create_revision"]))
        .with_guard(Holder::parse(&text(&kv["value"])))
}

/// Sleeps for `nap`, or less if the key is deleted after `revision`. A watch that cannot be opened
/// leaves a plain sleep.
async fn wait_for_deletion(
    client: &mut Client,
    keys: &Keys,
    revision: i64,
    nap: Duration,
    timings: &Timings,
) {
    let until = Instant::now() + nap;
    let opened = client
        .watch(&keys.lock, revision + 1, timings.connect_timeout.min(nap))
        .await;
    match opened {
        Ok(mut watch) => {
            // A watch that ends at once (a member shutting down) must not make a busy loop.
            if let Ok(false) = tokio::time::timeout_at(until, watch.deleted()).await {
                tokio::time::sleep_until(until).await;
            }
        }
        Err(e) => {
            debug!(error = %e, "cannot watch the lock key; polling");
            tokio::time::sleep_until(until).await;
        }
    }
}

async fn revoke(client: &mut Client, lease: i64, limit: Duration) {
    let revoked = client
        .call(
            "/v3/lease/revoke",
            &json!({ "ID": lease.to_string() }),
            limit,
        )
        .await;
    if let Err(e) = revoked {
        debug!(error = %e, "the lease could not be revoked; it expires within ttl");
    }
}

/// Who holds `name` now, without taking it.
pub async fn status(
    target: &EtcdTarget,
    name: &LockName,
    connect: Duration,
    answer: Duration,
) -> Result<Option<HolderInfo>, LockError> {
    let keys = Keys::of(target, name);
    let mut client = Client::new(target).map_err(|e| lock_error(target, e))?;
    let limit = connect + answer;
    let found = client
        .call("/v3/kv/range", &json!({ "key": base64(&keys.lock) }), limit)
        .await
        .map_err(|e| lock_error(target, e))?;
    let kv = &found["kvs"][0];
    if kv.is_null() {
        return Ok(None);
    }
    let ttl = client
        .call("/v3/lease/timetolive", &json!({ "ID": kv["lease"] }), limit)
        .await
        .map_err(|e| lock_error(target, e))?;
    let remaining = Duration::from_secs(int(&ttl["TTL"]).max(0) as u64);
    Ok(Some(
        holder_of(kv).with("ttl_remaining_ms", remaining.as_millis()),
    ))
}

/// The lock's record, without taking the lock.
pub async fn last_record(
    target: &EtcdTarget,
    name: &LockName,
    connect: Duration,
    answer: Duration,
) -> Result<Option<RecordFacts>, LockError> {
    let keys = Keys::of(target, name);
    let mut client = Client::new(target).map_err(|e| lock_error(target, e))?;
    let found = client
        .call(
            "/v3/kv/range",
            &json!({ "key": base64(&keys.record) }),
            connect + answer,
        )
        .await
        .map_err(|e| lock_error(target, e))?;
    Ok(
        parse_record(&found["kvs"][0]).map(|(state, token, _)| RecordFacts {
            state,
            token: token.max(0) as u64,
        }),
    )
}

/// Why scheduled runs are refused on etcd (`config::schedule` says so at start-up).
const NO_CLOCK: &str = "scheduled runs need the backend's clock, and etcd has none";

/// A held lease, kept alive by a renewal task.
pub struct EtcdLock {
    fence: i64,
    previous: Previous,
    farewell: Vec<u8>,
    watched: WatchedLock,
}

#[async_trait]
impl Held for EtcdLock {
    fn previous(&self) -> Previous {
        self.previous
    }

    fn fencing_token(&self) -> Option<String> {
        Some(self.fence.to_string())
    }

    /// etcd commits the release record through its quorum: it survives a failover.
    fn released_cleanly(&self) -> bool {
        self.previous == Previous::Gone("released")
    }

    fn app_deadline(&self) -> Option<tokio::sync::watch::Receiver<Deadline>> {
        Some(self.watched.app_deadline())
    }

    /// The lease, revoked once the app's tree is gone: a standby takes over at once, not at the
    /// lease's end.
    fn farewell(&self) -> Farewell<'_> {
        Farewell {
            message: self.farewell.clone(),
            keep: None,
        }
    }

    fn loss_reports(&self) -> Option<tokio::sync::watch::Receiver<Option<LockLoss>>> {
        Some(self.watched.loss_reports())
    }

    async fn lost(&mut self) -> LockLoss {
        self.watched.lost().await
    }

    /// Nothing to prepare: the release is one transaction on the renewal's connection.
    fn release_coming(&self) {}

    async fn give_back(self: Box<Self>) -> Result<(), LockError> {
        self.watched.release().await
    }
}

#[async_trait]
impl WindowStore for EtcdLock {
    async fn claim(&mut self, _request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        Err(LockError::Refused(NO_CLOCK.to_owned()))
    }

    async fn record_end(
        &mut self,
        _request: &ClaimRequest<'_>,
        _exit: RunExit,
    ) -> Result<(), LockError> {
        Err(LockError::Refused(NO_CLOCK.to_owned()))
    }
}
