//! The timing knobs, what they bound, and the inequality every backend's timings must keep.

use std::time::Duration;

use super::*;

/// The timing knobs and the one inequality they must keep.
///
/// Every duration is measured on the guard's monotonic clock. The guard proves ownership every
/// `check_interval`; a proof that takes longer than `check_timeout` counts as a lost lock; once the lock
/// is lost the command gets `grace_period` between the stop signal and SIGKILL. A Redis lease lasts
/// `ttl` from the moment its last renewal was sent and is renewed every `renew_interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    pub check_interval: Duration,
    pub check_timeout: Duration,
    pub connect_timeout: Duration,
    pub grace_period: Duration,
    pub ttl: Duration,
    pub renew_interval: Duration,
}

impl Timings {
    /// The longest a silent (partitioned or stalled) backend can go unnoticed: one check is outstanding
    /// for at most `check_interval + check_timeout`.
    pub fn detection_bound(&self) -> Duration {
        self.check_interval + self.check_timeout
    }

    /// The shortest time, in whole seconds, after which a server may end a silent session and free
    /// its lock: MySQL's `wait_timeout`; PostgreSQL's `idle_session_timeout`, `tcp_user_timeout` and
    /// TCP keepalive idle time. The guard has detected the silence and killed its command by then.
    ///
    /// The server counts a session idle from when it *sent* its last answer, the guard from when it
    /// sends its next question, and an answer counts if it arrives within its budget. So the worst
    /// case is an answer sent the moment the server could (a check right after its sleep, a grant at
    /// once) that reaches the guard as late as it may, followed by silence: the guard's next
    /// question, sent then, sets the app's deadline one budget and a grace period later still.
    /// - a check: the server answers `check_interval` after the question, the answer may arrive
    ///   `check_interval + check_timeout` after it; the deadline that follows is `2 x (interval +
    ///   timeout) + grace` after the question, `interval + 2 x timeout + grace` after the answer;
    /// - a grant: the server may answer at once, the grant may arrive `chunk + check_timeout` after
    ///   the question (`MAX_LOCK_WAIT_CHUNK`); the deadline that follows is `chunk + interval + 2 x
    ///   timeout + grace` after the answer.
    ///
    /// The second is the longer; the margin covers scheduling on the guard's host.
    pub fn session_timeout_secs(&self) -> u64 {
        let needed = self.worst_answer_to_deadline() + SESSION_SAFETY_MARGIN;
        needed.as_secs() + u64::from(needed.subsec_nanos() > 0)
    }

    /// The longest the guard can rely on a lock after the server sent its last answer (see
    /// `session_timeout_secs`). Also what a MySQL or PostgreSQL holder records as the longest its
    /// app may outlive a lock taken away while the server still answers, and a standby's own bound:
    /// a primary demoted in place (a switchover) right after an answer that found it writable is
    /// noticed only by a later answer, which may come this late (right after a grant, a lock wait
    /// chunk and the record's statements go first).
    pub fn worst_answer_to_deadline(&self) -> Duration {
        MAX_LOCK_WAIT_CHUNK + self.check_interval + 2 * self.check_timeout + self.grace_period
    }

    /// What the guard subtracts from a Redis lease for clock-rate drift between guard and server and
    /// for its own scheduling: 1% of the ttl plus 100ms.
    pub fn lease_drift_margin(&self) -> Duration {
        self.ttl / 100 + Duration::from_millis(100)
    }

    /// How long after a renewal was sent the guard may rely on the lease.
    pub fn lease_validity(&self) -> Duration {
        self.ttl.saturating_sub(self.lease_drift_margin())
    }

    pub fn validate(&self, target: Option<&Target>) -> Result<(), ConfigError> {
        at_least("--check-interval", self.check_interval, MIN_CHECK_INTERVAL)?;
        at_least("--check-timeout", self.check_timeout, MIN_CHECK_TIMEOUT)?;
        if self.connect_timeout.is_zero() {
            return Err(invalid("--connect-timeout must be longer than 0s"));
        }
        match target {
            Some(Target::Mysql(_)) => MysqlTarget::check_timings(self)?,
            Some(Target::Redis(_) | Target::Etcd(_)) => self.validate_lease()?,
            Some(Target::Postgres(_) | Target::File(_)) | None => {}
        }
        Ok(())
    }

    /// A renewal attempt starts every renew-interval and gives up after check-timeout; the app must be
    /// told to stop grace-period before the lease can run out. So one renewal must always fit between
    /// the last confirmed one and the moment the stop begins.
    fn validate_lease(&self) -> Result<(), ConfigError> {
        let show = |d: Duration| crate::vocab::show_duration(d);
        if self.renew_interval.is_zero() {
            return Err(invalid("--renew-interval must be longer than 0s"));
        }
        let margin = self.lease_drift_margin();
        let budget = self
            .ttl
            .saturating_sub(margin)
            .saturating_sub(self.grace_period);
        let needed = self.renew_interval + self.check_timeout;
        if self.ttl <= margin + self.grace_period || budget < needed {
            return Err(invalid(format!(
                "unsafe lease timings: ttl {} - drift margin {} - grace-period {} = {} must be at least \
                 renew-interval {} + check-timeout {} = {}, or the app could outlive its lease; \
                 raise --ttl, or lower --grace-period, --renew-interval or --check-timeout",
                show(self.ttl),
                show(margin),
                show(self.grace_period),
                show(budget),
                show(self.renew_interval),
                show(self.check_timeout),
                show(needed),
            )));
        }
        Ok(())
    }
}
