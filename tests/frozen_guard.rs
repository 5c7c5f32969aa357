//! A guard that is itself frozen (SIGSTOP) cannot stop its app, yet its lock runs out on the
//! backend's schedule. Its watchdog process must stop the app first, so a standby that takes over
//! never overlaps it, and the guard, once resumed, reports the lost lock instead of carrying on.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn frozen_guards_app_is_stopped_before_a_standby_takes_over() {
    for backend in [
        Backend::Mysql(mariadb::MariaDb::start()),
        Backend::Redis(redis::Redis::start()),
    ] {
        let mut lab = Lab::new();
        let LeaderAndStandby {
            mut leader,
            lead_app,
            mut standby,
            standby_pid,
            trace,
        } = LeaderAndStandby::start(&mut lab, &backend, "frozen");

        leader.signal(19); // SIGSTOP
                           // MySQL frees the silent session after wait_timeout (8s here); the Redis lease expires in 3s.
        read_pid(&standby_pid, Duration::from_secs(15));
        assert!(
            !alive(lead_app),
            "{}: the frozen guard's app outlived its lock",
            backend.name()
        );
        assert_eq!(assert_no_overlap(&trace), 2, "{}", backend.name());

        leader.signal(18); // SIGCONT
        assert_eq!(
            leader.code(Duration::from_secs(10)),
            75,
            "{}: {}",
            backend.name(),
            leader.log_text()
        );
        standby.signal(15);
        assert_eq!(standby.code(Duration::from_secs(10)), 0);
    }
}
