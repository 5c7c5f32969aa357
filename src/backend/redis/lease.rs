//! A held Redis lease: renewed on time, given up with the app stopped before it can run out.

use super::*;

pub(super) struct Lease {
    pub(super) target: RedisTarget,
    pub(super) keys: Keys,
    pub(super) token: String,
    /// Written with each renewal into the lease record.
    pub(super) fence: i64,
    /// Dropped after any error or timeout: a connection in an unknown state is never reused.
    pub(super) conn: Option<Conn>,
    pub(super) timings: Timings,
    pub(super) observer: Arc<dyn Observer>,
}

/// A script invocation that did not answer with a value.
pub(super) struct ScriptFailure {
    pub(super) outcome: CheckOutcome,
    pub(super) message: String,
}

#[async_trait]
impl Renewable for Lease {
    const KIND: &'static str = "redis lease";

    fn timings(&self) -> &Timings {
        &self.timings
    }

    fn server(&self) -> String {
        self.target.url.to_string()
    }

    async fn renew_at(&mut self, at: Deadline) -> Renewed {
        deadline::sleep_until(at).await;
        // Sent before the role is asked, so the time it takes counts against the renewal's budget
        // and the lease is counted from no later than the question.
        let sent = Deadline::now();
        if let Some(role) = self.demoted().await {
            return Renewed::Lost(LockLoss {
                reason: LossReason::PrimaryDemoted,
                detail: format!(
                    "the server now answers ROLE as {role}: it was demoted from primary while holding the lock"
                ),
            });
        }
        let mut renew = ScriptCall::new(RENEW, &[self.keys.lock.as_str(), &self.keys.lease]);
        renew
            .arg(&self.token)
            .arg(millis(self.timings.ttl))
            .arg(self.fence)
            .arg(millis(bound(&self.timings)));
        let wait = replicas_wait(&self.target, self.timings.check_timeout);
        let result = match self.bounded(&renew, wait).await {
            Ok((1, acked)) => match replicated(&self.target, acked, self.timings.check_timeout) {
                Ok(()) => Ok(1),
                Err(failure) => {
                    // The connection's next write would be waited on with this one unconfirmed.
                    self.conn = None;
                    Err(failure)
                }
            },
            answered => answered.map(|(answer, _)| answer),
        };
        let outcome = match &result {
            Ok(1) => CheckOutcome::Ok,
            Ok(_) => CheckOutcome::Error,
            Err(failure) => failure.outcome,
        };
        let took = sent.elapsed();
        self.observer.check(outcome, took);
        match result {
            Ok(1) => Renewed::Confirmed { sent },
            Ok(_) => Renewed::Lost(LockLoss {
                reason: LossReason::NotOwner,
                detail: format!("{} is gone, expired or holds another token", self.keys.lock),
            }),
            Err(failure) => Renewed::Failed(failure.message),
        }
    }

    /// Compare-and-delete, then a message on the release channel for waiting instances. A key that
    /// holds another token is never deleted.
    async fn release(mut self) {
        let keys = [
            self.keys.lock.as_str(),
            &self.keys.clean,
            &self.keys.released,
        ];
        let mut release = ScriptCall::new(RELEASE, &keys);
        release.arg(&self.token);
        match self.bounded(&release, None).await.map(|(answer, _)| answer) {
            Ok(1) => info!(event = "lock_released", key = %self.keys.lock, "redis lease released"),
            Ok(_) => {
                warn!(event = "release_failed", key = %self.keys.lock, "redis lease was no longer ours at release")
            }
            Err(failure) => {
                warn!(event = "release_failed", error = %failure.message, "redis lease release failed; it expires within ttl")
            }
        }
    }
}

impl Lease {
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

    /// Runs one script call (and the `WAIT` after it, if any) within check-timeout, on the kept
    /// connection or a new one.
    async fn bounded(
        &mut self,
        call: &ScriptCall,
        wait: Option<(u32, Duration)>,
    ) -> Result<(i64, Option<i64>), ScriptFailure> {
        let limit = self.timings.check_timeout;
        let (target, keys) = (&self.target, &self.keys);
        let slot = &mut self.conn;
        let result = timeout(limit, async {
            forget_demoted(target, slot, limit / 2).await;
            if let Some(conn) = slot.as_mut() {
                match conn.call(keys, call, wait).await {
                    // Broken since its last use (a server restart, say): one more try on a fresh
                    // connection, within the same bound. Every script here is safe to run twice.
                    Err(e) if e.is_connection_dropped() || e.is_io_error() => *slot = None,
                    answered => return answered,
                }
            }
            let conn = slot.insert(connect(target, limit).await?);
            conn.call(keys, call, wait).await
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
}
