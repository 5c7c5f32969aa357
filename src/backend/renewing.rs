//! The loop that keeps a lease alive (Redis, etcd), written once: renew on time, retry quickly after
//! a failure, stop the app a grace period before the lease could run out, release when asked. Each
//! backend says only how one renewal and the release are done.

use std::time::Duration;

use async_trait::async_trait;
use tracing::{debug, warn};

use super::watched::WatcherEnds;
use super::{LockError, LockLoss};
use crate::config::Timings;
use crate::deadline::{self, Deadline};
use crate::vocab::{show_duration, LossReason};

/// After a failed renewal the guard reconnects and retries this often (or every renew-interval, if
/// shorter): a restarted server is found quickly, without a busy loop against a dead one.
const MAX_RETRY_INTERVAL: Duration = Duration::from_millis(250);

/// What one renewal found.
pub(super) enum Renewed {
    /// The server confirmed the lease as the instance's own; it counts from `sent`, when the
    /// renewal was sent.
    Confirmed { sent: Deadline },
    /// The server says the lock is no longer the instance's.
    Lost(LockLoss),
    /// No confirmation: retried until the lease could run out.
    Failed(String),
}

/// A held lease, as the renewal loop drives it.
#[async_trait]
pub(super) trait Renewable: Send + 'static {
    /// What the log calls it ("redis lease").
    const KIND: &'static str;

    fn timings(&self) -> &Timings;

    /// The server the last renewal went to, for the log.
    fn server(&self) -> String;

    /// One renewal, sent at `at`.
    async fn renew_at(&mut self, at: Deadline) -> Renewed;

    /// Gives the lock up, if it is still the instance's; a failure is logged, never returned: the
    /// lease then runs out on its own.
    async fn release(self);
}

/// Keeps `lease`, acquired with a request sent at `acquired_at` and valid until `valid_until`
/// (already less the drift margin), until it is lost, could run out, or is released.
pub(super) async fn keep<L: Renewable>(
    mut lease: L,
    acquired_at: Deadline,
    mut valid_until: Deadline,
    mut ends: WatcherEnds,
) -> Result<(), LockError> {
    let timings = *lease.timings();
    let retry = timings.renew_interval.min(MAX_RETRY_INTERVAL);
    let mut next_attempt = acquired_at + timings.renew_interval;
    loop {
        // The app needs grace-period to stop before the lease can run out.
        let stop_at = valid_until.minus(timings.grace_period);
        let renewed = tokio::select! {
            biased;
            _ = deadline::sleep_until(stop_at) => {
                ends.report(LockLoss {
                    reason: LossReason::LeaseExpiring,
                    detail: format!(
                        "no renewal confirmed in time; the lease may run out in {}",
                        show_duration(valid_until.remaining())
                    ),
                });
                return Ok(());
            }
            _ = &mut ends.release => {
                lease.release().await;
                return Ok(());
            }
            renewed = lease.renew_at(next_attempt) => renewed,
        };
        // A confirmation read after check-timeout proves nothing about now: the guard may have been
        // frozen while the lease ran out and another instance took it.
        let renewed = match renewed {
            Renewed::Confirmed { sent } if sent.elapsed() > timings.check_timeout => {
                Renewed::Failed(format!(
                    "the renewal was confirmed after {}, beyond --check-timeout",
                    show_duration(sent.elapsed())
                ))
            }
            renewed => renewed,
        };
        match renewed {
            Renewed::Confirmed { sent } => {
                valid_until = sent + timings.lease_validity();
                ends.move_app_deadline(valid_until);
                next_attempt = sent + timings.renew_interval;
                debug!("{} renewed", L::KIND);
            }
            Renewed::Lost(loss) => {
                ends.report(loss);
                return Ok(());
            }
            Renewed::Failed(error) => {
                warn!(event = "renewal_failed", error = %error, server = %lease.server(), lease_left = %show_duration(valid_until.remaining()), "{} renewal failed; retrying", L::KIND);
                next_attempt = Deadline::after(retry);
            }
        }
    }
}
