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

    /// Whether a check is still running (or, killed at its timeout, not yet ended).
    pub fn running(&self) -> bool {
        self.running
    }

    /// A check started at `now`.
    pub fn started(&mut self, now: Deadline) {
        self.next_at = None;
        self.running = true;
        self.kill_at = Some(now + self.check.timeout);
    }

    /// The running check outlived its timeout and was killed: a failure, counted now, not when its
    /// end is reaped. The next check is due an interval from now, whether or not this one has ended
    /// by then (`lingers`).
    pub fn timed_out(&mut self, now: Deadline) -> Verdict {
        self.kill_at = None;
        self.next_at = Some(now + self.check.interval);
        self.count(CheckEnd::TimedOut, now)
    }

    /// The next check is due, but the one killed at its timeout has not ended (a process stuck in
    /// the kernel, on a hung mount say): each interval it lingers counts as one more failure, so an
    /// app whose checks hang that way still turns unhealthy.
    pub fn lingers(&mut self, now: Deadline) -> Verdict {
        self.next_at = Some(now + self.check.interval);
        self.count(CheckEnd::TimedOut, now)
    }

    /// The running check ended (with `end`), or could not start at all (`Failed`).
    pub fn ended(&mut self, end: CheckEnd, now: Deadline) -> Verdict {
        let counted_already = self.running && self.kill_at.is_none();
        self.running = false;
        self.kill_at = None;
        if counted_already {
            // Its timeout counted it, and set when the next check is due.
            return Verdict {
                counted: None,
                change: None,
            };
        }
        self.next_at = Some(now + self.check.interval);
        self.count(end, now)
    }

    fn count(&mut self, end: CheckEnd, now: Deadline) -> Verdict {
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
        Verdict {
            counted: Some(end),
            change: (self.state != before).then_some(self.state),
        }
    }
}

/// What one check's end did: how it counted (none for the end of a check its timeout already
/// counted), and the app's health, if that changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub counted: Option<CheckEnd>,
    pub change: Option<HealthState>,
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

    /// Runs one check that starts and ends at `secs` with `end`; the change it made.
    fn run(health: &mut Health<'_>, secs: u64, end: CheckEnd) -> Option<HealthState> {
        health.started(at(secs));
        health.ended(end, at(secs)).change
    }

    #[test]
    fn retries_failures_in_a_row_make_the_app_unhealthy_and_a_pass_resets_them() {
        let check = check(3, Duration::ZERO);
        let mut health = Health::new(&check, T0);
        assert_eq!(health.next_check(), Some(at(10)));
        health.started(at(10));
        assert_eq!(health.next_check(), None);
        assert_eq!(health.kill_at(), Some(at(15)));
        let passed = health.ended(CheckEnd::Passed, at(11));
        assert_eq!(passed.change, Some(HealthState::Healthy));
        assert_eq!(passed.counted, Some(CheckEnd::Passed));
        assert_eq!(health.next_check(), Some(at(21)));
        assert_eq!(
            run(&mut health, 21, CheckEnd::Failed),
            Some(HealthState::Failing)
        );
        assert_eq!(run(&mut health, 31, CheckEnd::Failed), None);
        assert_eq!(health.failures(), 2);
        assert_eq!(
            run(&mut health, 41, CheckEnd::Passed),
            Some(HealthState::Healthy)
        );
        assert_eq!(health.failures(), 0);
        assert_eq!(
            run(&mut health, 51, CheckEnd::Failed),
            Some(HealthState::Failing)
        );
        assert_eq!(run(&mut health, 61, CheckEnd::Failed), None);
        assert_eq!(
            run(&mut health, 71, CheckEnd::Failed),
            Some(HealthState::Unhealthy)
        );
    }

    #[test]
    fn a_timeout_counts_once_when_it_happens_not_again_when_the_check_is_reaped() {
        let check = check(2, Duration::ZERO);
        let mut health = Health::new(&check, T0);
        health.started(at(10));
        let timed_out = health.timed_out(at(15));
        assert_eq!(timed_out.change, Some(HealthState::Failing));
        assert_eq!(timed_out.counted, Some(CheckEnd::TimedOut));
        assert_eq!(health.kill_at(), None);
        assert_eq!(health.next_check(), Some(at(25)));
        let reaped = health.ended(CheckEnd::Failed, at(16));
        assert_eq!(reaped.counted, None, "counted once, at its timeout");
        assert_eq!(health.failures(), 1);
        assert_eq!(health.next_check(), Some(at(25)));
        health.started(at(25));
        assert_eq!(
            health.timed_out(at(30)).change,
            Some(HealthState::Unhealthy)
        );
    }

    #[test]
    fn a_killed_check_that_never_ends_counts_a_failure_each_interval() {
        let check = check(3, Duration::ZERO);
        let mut health = Health::new(&check, T0);
        health.started(at(10));
        health.timed_out(at(15));
        assert!(health.running());
        assert_eq!(health.lingers(at(25)).change, None);
        assert_eq!(health.failures(), 2);
        assert_eq!(health.next_check(), Some(at(35)));
        assert_eq!(health.lingers(at(35)).change, Some(HealthState::Unhealthy));
    }

    #[test]
    fn failures_in_the_start_period_count_only_after_a_pass() {
        let check = check(1, Duration::from_secs(30));
        let mut health = Health::new(&check, T0);
        assert_eq!(run(&mut health, 10, CheckEnd::Failed), None);
        assert_eq!(health.state(), HealthState::Starting);
        assert_eq!(health.failures(), 0);
        // After the start period, the first failure counts.
        assert_eq!(
            run(&mut health, 30, CheckEnd::Failed),
            Some(HealthState::Unhealthy)
        );

        let mut health = Health::new(&check, T0);
        assert_eq!(
            run(&mut health, 10, CheckEnd::Passed),
            Some(HealthState::Healthy)
        );
        assert_eq!(
            run(&mut health, 20, CheckEnd::Failed),
            Some(HealthState::Unhealthy),
            "a pass ends the start period"
        );
    }
}
