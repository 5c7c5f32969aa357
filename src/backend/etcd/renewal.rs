//! A held etcd lease: kept alive on time, revoked at release, and ended by the watchdog of a guard
//! that died holding it.

use super::*;

/// The renewal task of a held lease.
pub(super) struct Renewal {
    pub(super) target: EtcdTarget,
    pub(super) client: Client,
    pub(super) keys: Keys,
    pub(super) lease: i64,
    pub(super) fence: i64,
    pub(super) holder_id: String,
    pub(super) timings: Timings,
    pub(super) observer: Arc<dyn Observer>,
}

#[async_trait]
impl Renewable for Renewal {
    const KIND: &'static str = "etcd lease";

    fn timings(&self) -> &Timings {
        &self.timings
    }

    fn server(&self) -> String {
        self.client.member().to_string()
    }

    /// A keep-alive, then the proof that the key still holds this lease from this acquisition.
    async fn renew_at(&mut self, at: Deadline) -> Renewed {
        deadline::sleep_until(at).await;
        let sent = Deadline::now();
        let limit = self.timings.check_timeout;
        let txn = json!({ "compare": compare_ours(&self.keys, self.lease, self.fence) });
        let client = &mut self.client;
        let lease = self.lease;
        let result = timeout(limit, async {
            if keep_alive(client, lease, limit).await? <= 0 {
                return Ok(Some("the lease expired or was revoked"));
            }
            let answer = client.call("/v3/kv/txn", &txn, limit).await?;
            Ok::<_, CallError>(
                (answer["succeeded"].as_bool() != Some(true))
                    .then_some("the key is gone or holds another lease"),
            )
        })
        .await
        .unwrap_or_else(|_| {
            // Cut off mid-request: the connection's state is unknown, and is never reused.
            self.client.disconnect();
            Err(CallError::Silent(limit))
        });
        let took = sent.elapsed();
        let outcome = match &result {
            Ok(None) => CheckOutcome::Ok,
            Ok(Some(_)) | Err(CallError::Refused(_) | CallError::Failed(_)) => CheckOutcome::Error,
            Err(CallError::Silent(_) | CallError::Unreachable(_)) => CheckOutcome::Timeout,
        };
        self.observer.check(outcome, took);
        match result {
            Ok(None) => Renewed::Confirmed { sent },
            Ok(Some(detail)) => Renewed::Lost(LockLoss {
                reason: LossReason::NotOwner,
                detail: format!("{}: {detail}", self.keys.lock),
            }),
            Err(e) => Renewed::Failed(self.target.url.scrub(e)),
        }
    }

    async fn release(mut self) {
        let limit = self.timings.check_timeout;
        match end_lease(
            &mut self.client,
            &self.keys,
            self.lease,
            self.fence,
            RecordState::Released,
            &self.holder_id,
            limit,
        )
        .await
        {
            Ok(true) => {
                info!(event = "lock_released", key = %self.keys.lock, "etcd lease released")
            }
            Ok(false) => {
                warn!(event = "release_failed", key = %self.keys.lock, "etcd lease was no longer ours at release")
            }
            Err(e) => {
                warn!(event = "release_failed", error = %self.target.url.scrub(e), "etcd lease release failed; it expires within ttl")
            }
        }
    }
}

/// Deletes the key and writes the record in `state`, only if the key still holds `lease` and was
/// created at `fence`; then revokes the lease. Whether the key was ours.
async fn end_lease(
    client: &mut Client,
    keys: &Keys,
    lease: i64,
    fence: i64,
    state: RecordState,
    holder_id: &str,
    limit: Duration,
) -> Result<bool, CallError> {
    let record = record_value(state, fence, Duration::ZERO, holder_id);
    let txn = json!({
        "compare": compare_ours(keys, lease, fence),
        "success": [
            { "request_delete_range": { "key": base64(&keys.lock) } },
            { "request_put": { "key": base64(&keys.record), "value": base64(&record) } },
        ],
    });
    let ended = client.call("/v3/kv/txn", &txn, limit).await?;
    let ours = ended["succeeded"].as_bool() == Some(true);
    revoke(client, lease, limit).await;
    Ok(ours)
}

/// The watchdog's farewell for a guard that died holding the lease: once the app's tree is gone, the
/// record says so and the lease is revoked, if the key still holds it.
pub fn end_session(farewell: &SessionFarewell) -> Result<String, String> {
    let target = match farewell.target()? {
        Target::Etcd(target) => target,
        _ => return Err("not an etcd:// URL".to_owned()),
    };
    let name = LockName::parse(&farewell.name).map_err(|e| e.to_string())?;
    let keys = Keys::of(&target, &name);
    let lease = farewell.session_id as i64;
    let fence = farewell.revision as i64;
    farewell.on_runtime(async {
        let mut client = Client::new(&target).map_err(|e| target.url.scrub(e))?;
        let ours = end_lease(
            &mut client,
            &keys,
            lease,
            fence,
            RecordState::TreeGone,
            &farewell.holder_id,
            farewell.timeout,
        )
        .await
        .map_err(|e| target.url.scrub(e))?;
        Ok(if ours {
            format!("revoked lease {lease:x}")
        } else {
            format!("lease {lease:x} no longer held the lock; revoked it")
        })
    })
}
