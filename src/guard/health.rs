//! `--health-cmd`: Docker's HEALTHCHECK rules over the checks' results. The first check runs one
//! interval after the app starts, each next one an interval after the previous one ended; a check
//! that fails or outlives its timeout is a failure; failures inside the start period are not counted
//! until a check has passed; `retries` failures in a row make the app unhealthy. Pure: the guard's
//! supervise loop runs the checks and passes the time in.

use crate::config::HealthCheck;
use crate::deadline::Deadline;
use crate::vocab::HealthState;

pub struct Health<'a> {
    check: &'a HealthCheck,
    /// Failures before this are not counted, unless a check has passed.
    start_period_ends: Deadline,
    passed_once: bool,
    failures: u32,
    state: HealthState,
    /// When the next check starts; none while one runs.
    next_at: Option<Deadline>,
    /// While a check runs: when it is killed (none once it was, until it has ended).
    kill_at: Option<Deadline>,
    running: bool,
}

/// How a check ended, as the rules count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckEnd {
    Passed,
    Failed,
    TimedOut,
}

impl<'a> Health<'a> {
    /// The app started at `now`.
    pub fn new(check: &'a HealthCheck, now: Deadline) -> Health<'a> {
        Health {
            check,
            start_period_ends: now + check.start_period,
            passed_once: false,
            failures: 0,
            state: HealthState::Starting,
            next_at: Some(now + check.interval),
            kill_at: None,
            running: false,
        }
    }

    pub fn state(&self) -> HealthState {
        self.state
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn retries(&self) -> u32 {
        self.check.retries
    }

    pub fn timeout(&self) -> std::time::Duration {
        self.check.timeout
    }

    /// When the next check is due; none while one runs.
    pub fn next_check(&self) -> Option<Deadline> {
        self.next_at
    }

    /// When the running check is to be killed.
    pub fn kill_at(&self) -> Option<Deadline> {
        self.kill_at
    }

    /// A check started at `now`.
    pub fn started(&mut self, now: Deadline) {
        self.next_at = None;
        self.running = true;
        self.kill_at = Some(now + self.check.timeout);
    }

    /// The running check outlived its timeout and was killed: a failure, counted now, not when its
    /// end is reaped. The new state, if it changed.
    pub fn timed_out(&mut self, now: Deadline) -> Option<HealthState> {
        self.kill_at = None;
        self.count(CheckEnd::TimedOut, now)
    }

    /// The running check ended (with `end`), or could not start at all (`Failed`). The new state,
    /// if it changed.
    pub fn ended(&mut self, end: CheckEnd, now: Deadline) -> Option<HealthState> {
        let counted = self.running && self.kill_at.is_none();
        self.running = false;
        self.kill_at = None;
        self.next_at = Some(now + self.check.interval);
        if counted {
            // Its timeout already counted it.
            return None;
        }
        self.count(end, now)
    }

    fn count(&mut self, end: CheckEnd, now: Deadline) -> Option<HealthState> {
        let before = self.state;
        if end == CheckEnd::Passed {
            self.passed_once = true;
            self.failures = 0;
            self.state = HealthState::Healthy;
        } else if self.passed_once || now >= self.start_period_ends {
            self.failures += 1;
            self.state = if self.failures >= self.check.retries {
                HealthState::Unhealthy
            } else {
                HealthState::Failing
            };
        }
        (self.state != before).then_some(self.state)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn check(retries: u32, start_period: Duration) -> HealthCheck {
        HealthCheck {
            command: "true".to_owned(),
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            retries,
            start_period,
        }
    }

    const T0: Deadline = Deadline::from_nanos(1_000_000_000_000);

    fn at(secs: u64) -> Deadline {
        T0 + Duration::from_secs(secs)
    }

    #[test]
    fn retries_failures_in_a_row_make_the_app_unhealthy_and_a_pass_resets_them() {
        let check = check(3, Duration::ZERO);
        let mut health = Health::new(&check, T0);
        assert_eq!(health.next_check(), Some(at(10)));
        health.started(at(10));
        assert_eq!(health.next_check(), None);
        assert_eq!(health.kill_at(), Some(at(15)));
        assert_eq!(
            health.ended(CheckEnd::Passed, at(11)),
            Some(HealthState::Healthy)
        );
        assert_eq!(health.next_check(), Some(at(21)));
        for (n, expected) in [(1, Some(HealthState::Failing)), (2, None)] {
            health.started(at(20 * n));
            assert_eq!(health.ended(CheckEnd::Failed, at(20 * n)), expected);
            assert_eq!(health.failures(), n as u32);
        }
        health.started(at(60));
        assert_eq!(
            health.ended(CheckEnd::Passed, at(60)),
            Some(HealthState::Healthy)
        );
        assert_eq!(health.failures(), 0);
        for n in 1..=3 {
            health.started(at(100 + n));
            let change = health.ended(CheckEnd::Failed, at(100 + n));
            assert_eq!(change.is_some(), n != 2, "failure {n}");
        }
        assert_eq!(health.state(), HealthState::Unhealthy);
    }

    #[test]
    fn a_timeout_counts_once_when_it_happens_not_again_when_the_check_is_reaped() {
        let check = check(2, Duration::ZERO);
        let mut health = Health::new(&check, T0);
        health.started(at(10));
        assert_eq!(health.timed_out(at(15)), Some(HealthState::Failing));
        assert_eq!(health.kill_at(), None);
        assert_eq!(
            health.next_check(),
            None,
            "no new check before the killed one ended"
        );
        assert_eq!(health.ended(CheckEnd::Failed, at(16)), None);
        assert_eq!(health.failures(), 1);
        assert_eq!(health.next_check(), Some(at(26)));
        health.started(at(26));
        assert_eq!(health.timed_out(at(31)), Some(HealthState::Unhealthy));
    }

    #[test]
    fn failures_in_the_start_period_count_only_after_a_pass() {
        let check = check(1, Duration::from_secs(30));
        let mut health = Health::new(&check, T0);
        health.started(at(10));
        assert_eq!(health.ended(CheckEnd::Failed, at(10)), None);
        assert_eq!(health.state(), HealthState::Starting);
        assert_eq!(health.failures(), 0);
        // After the start period, the first failure counts.
        health.started(at(30));
        assert_eq!(
            health.ended(CheckEnd::Failed, at(30)),
            Some(HealthState::Unhealthy)
        );

        let mut health = Health::new(&check, T0);
        health.started(at(10));
        assert_eq!(
            health.ended(CheckEnd::Passed, at(10)),
            Some(HealthState::Healthy)
        );
        health.started(at(20));
        assert_eq!(
            health.ended(CheckEnd::Failed, at(20)),
            Some(HealthState::Unhealthy),
            "a pass ends the start period"
        );
    }
}
