//! `--rejoin`: a leader that loses its lock stops its app, becomes a standby in the same process, and
//! takes the lock again (with a new app) when the other holder releases it. Never two apps at once.

mod common;

use std::time::Duration;

use common::mariadb::MariaDb;
use common::*;

const LIMIT: Duration = Duration::from_secs(20);

fn starts(trace: &std::path::Path) -> usize {
    trace_lines(trace)
        .iter()
        .filter(|l| l.starts_with("start"))
        .count()
}

#[test]
fn a_leader_that_loses_its_lock_rejoins_as_standby_and_leads_again_later() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    // The server frees the lock on KILL while the old app may still be stopping: the takeover delay
    // (grace period + 1s) keeps the next app from starting before it is dead.
    let mut args = vec!["--url", url.as_str(), "--name", "rejoin"];
    args.extend(fast_with(&["--takeover-delay", "3s"]));
    let trace = lab.path("trace");
    let (a_pid, b_pid) = (lab.path("a.pid"), lab.path("b.pid"));
    let mut a_args = args.clone();
    a_args.extend(["--wait", "--rejoin"]);
    let mut a = lab.spawn(&a_args, &as_strs(&recording_app(&trace, &a_pid)));
    let first_app = read_pid(&a_pid, LIMIT);
    // So that the next pid read is the next app's.
    std::fs::remove_file(&a_pid).unwrap();
    let mut b = waiting_standby(&mut lab, &args, &as_strs(&recording_app(&trace, &b_pid)));

    // A's session is killed: A stops its app and rejoins; B takes over.
    let session = db.holder_of("rejoin").expect("A holds the lock");
    db.sql(&format!("KILL {session}"));
    let b_app = read_pid(&b_pid, LIMIT);
    assert!(!alive(first_app), "A's first app outlived the lost lock");
    assert!(
        wait_until(LIMIT, || a.log_text().contains("event=\"rejoining\"")
            || a.log_text().contains("event=rejoining")),
        "{}",
        a.log_text()
    );
    assert!(
        wait_until(LIMIT, || a.log_text().contains("lock_waiting")),
        "A does not wait again: {}",
        a.log_text()
    );
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "A exited instead of rejoining"
    );
    assert_eq!(starts(&trace), 2);

    // B ends cleanly: A takes the lock again and starts a new app.
    b.signal(15);
    assert_eq!(b.code(LIMIT), 0, "{}", b.log_text());
    assert!(!alive(b_app));
    assert!(
        wait_until(LIMIT, || starts(&trace) == 3),
        "A did not lead again: {:?}\n{}",
        trace_lines(&trace),
        a.log_text()
    );
    let second_app = read_pid(&a_pid, LIMIT);
    assert_ne!(second_app, first_app);
    assert!(db.holder_of("rejoin").is_some());

    a.signal(15);
    assert_eq!(a.code(LIMIT), 0, "{}", a.log_text());
    assert_eq!(assert_no_overlap(&trace), 3);
    // One guard process throughout, and a fresh acquisition for each app.
    assert_eq!(
        a.log_text().matches("event=\"app_started\"").count()
            + a.log_text().matches("event=app_started").count(),
        2,
        "{}",
        a.log_text()
    );
}

#[test]
fn rejoin_without_wait_is_a_usage_error() {
    let mut lab = Lab::new();
    let url = lab.file_url("x.lock");
    let (code, log) = lab.run(
        &["--url", &url, "--name", "x", "--rejoin"],
        &["true"],
        LIMIT,
    );
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("--rejoin needs --wait"), "{log}");
}
