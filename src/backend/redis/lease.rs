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
        let sent = Deadline::now();
        let mut renew = ScriptCall::new(RENEW, &[self.keys.lock.as_str(), &self.keys.lease]);
        renew
            .arg(&self.token)
            .arg(millis(self.timings.ttl))
            .arg(self.fence)
            .arg(millis(bound(&self.timings)));
        let wait = replicas_wait(&self.target, self.timings.check_timeout);
        let result = match self.bounded(&renew, wait).await {
            Ok((answer @ (1 | RENEWED_ROLE_UNASKED), acked)) => {
                match replicated(&self.target, acked, self.timings.check_timeout) {
                    Ok(()) if answer == 1 => Ok(1),
                    Ok(()) => self.role_after(sent).await,
                    Err(failure) => {
                        // The connection's next write would be waited on with this one unconfirmed.
                        self.conn = None;
                        Err(failure)
                    }
                }
            }
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
            Ok(NOT_PRIMARY) => self.demoted(),
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
    /// A renewal whose script could not read the server's role (`INFO` refused): `ROLE` after it,
    /// within what is left of the renewal's budget. No answer confirms nothing.
    async fn role_after(&mut self, sent: Deadline) -> Result<i64, ScriptFailure> {
        let left = self.timings.check_timeout.saturating_sub(sent.elapsed());
        let Some(conn) = self.conn.as_mut() else {
            return Err(ScriptFailure {
                outcome: CheckOutcome::Error,
                message: "the connection was gone before its role was read".to_owned(),
            });
        };
        match answers_as_primary(&self.target, conn, left).await {
            Ok(true) => Ok(1),
            Ok(false) => Ok(NOT_PRIMARY),
            Err(failure) => {
                self.conn = None;
                Err(failure)
            }
        }
    }

    /// The server the renewal reached answered as a replica. A server addressed directly that was
    /// demoted while holding the lock has lost it: configured with `replica-read-only no` it would
    /// go on accepting the renewals while the new primary's copy of the key runs out, and the
    /// sentinels may not be there to say so. Behind Sentinel (or in a Cluster) a demoted node is a
    /// failover to ride through: the next renewal goes to the primary they name, and counts only
    /// where the token is still ours.
    fn demoted(&mut self) -> Renewed {
        self.conn = None;
        if matches!(self.target.servers, RedisServers::Primary(_)) {
            return Renewed::Lost(LockLoss {
                reason: LossReason::PrimaryDemoted,
                detail: "the server answers as a replica: it was demoted from primary while holding the lock"
                    .to_owned(),
            });
        }
        Renewed::Failed(
            "the server answers as a replica; the renewal goes to the new primary".to_owned(),
        )
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
                match conn.call(keys, call, wait, false).await {
                    // Broken since its last use (a server restart, say): one more try on a fresh
                    // connection, within the same bound. Every script here is safe to run twice.
                    Err(e) if e.is_connection_dropped() || e.is_io_error() => *slot = None,
                    answered => return answered,
                }
            }
            let conn = slot.insert(connect(target, limit).await?);
            conn.call(keys, call, wait, true).await
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
