//! `--rejoin`: a leader that loses its lock stops its app, becomes a standby in the same process, and
//! takes the lock again (with a new app) when the other holder releases it. Never two apps at once.

mod common;

use std::time::Duration;

use common::mariadb::MariaDb;
use common::redis::Redis;
use common::*;

const LIMIT: Duration = Duration::from_secs(20);

fn starts(trace: &std::path::Path) -> usize {
    trace_lines(trace)
        .iter()
        .filter(|l| l.starts_with("start"))
        .count()
}

#[test]
fn a_mysql_leader_whose_session_is_killed_rejoins_and_leads_again_later() {
    let db = MariaDb::start();
    let url = db.url();
    // The server frees the lock on KILL while the old app may still be stopping: the takeover delay
    // (grace period + 1s) keeps the next app from starting before it is dead.
    let timings = fast_with(&["--takeover-delay", "3s"]);
    rejoins_after(&url, &timings, || {
        let session = db.holder_of("rejoin").expect("A holds the lock");
        db.sql(&format!("KILL {session}"));
    });
}

#[test]
fn a_redis_leader_whose_key_is_deleted_rejoins_and_leads_again_later() {
    let redis = Redis::start();
    let url = redis.url();
    // The old holder notices at its next renewal and stops within its grace period:
    // renew-interval 500ms + grace 1s, under the 2s takeover delay.
    let timings = fast_with(&[REDIS_LEASE, &["--takeover-delay", "2s"]].concat());
    rejoins_after(&url, &timings, || {
        redis.cli(&["DEL", "sentinel-guard:{rejoin}"]);
    });
}

/// Guard A (`--wait --rejoin`) leads, B waits; `steal` takes the lock from A. A stops its app and
/// waits again, in the same process; whichever guard takes the lock next starts a new app (A may win
/// the race for a freed Redis key). Once B has ended, A leads with a new app. Never two at once.
fn rejoins_after(url: &str, timings: &[&str], steal: impl FnOnce()) {
    let mut lab = Lab::new();
    let mut args = vec!["--url", url, "--name", "rejoin"];
    args.extend(timings);
    let trace = lab.path("trace");
    let (a_pid, b_pid) = (lab.path("a.pid"), lab.path("b.pid"));
    let mut a_args = args.clone();
    a_args.extend(["--wait", "--rejoin"]);
    let mut a = lab.spawn(&a_args, &as_strs(&recording_app(&trace, &a_pid)));
    let first_app = read_pid(&a_pid, LIMIT);
    // So that the next pid read is the next app's.
    std::fs::remove_file(&a_pid).unwrap();
    let mut b = waiting_standby(&mut lab, &args, &as_strs(&recording_app(&trace, &b_pid)));

    steal();
    assert!(
        wait_until(LIMIT, || a.log_text().contains("rejoining")),
        "A did not rejoin: {}",
        a.log_text()
    );
    assert!(!alive(first_app), "A's first app outlived the lost lock");
    assert!(
        wait_until(LIMIT, || starts(&trace) == 2),
        "no one took the lock again: {:?}",
        trace_lines(&trace)
    );
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "A exited instead of rejoining"
    );

    // B ends (stopping its app if it leads, or its wait): A leads with a new app.
    b.signal(15);
    b.wait(LIMIT);
    let second_app = read_pid(&a_pid, LIMIT);
    assert_ne!(second_app, first_app);
    assert!(alive(second_app));

    a.signal(15);
    assert_eq!(a.code(LIMIT), 0, "{}", a.log_text());
    let apps = assert_no_overlap(&trace);
    assert!(apps == 2 || apps == 3, "{:?}", trace_lines(&trace));
    // One guard process throughout, and an acquisition of its own for each of its apps.
    let log = a.log_text();
    assert_eq!(log.matches("app started").count(), 2, "{log}");
    assert_eq!(log.matches("lock_acquired").count(), 2, "{log}");
}

#[test]
fn a_guard_rejoining_while_the_server_is_down_retries_until_it_is_back() {
    let mut db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let mut args = vec![
        "--url",
        url.as_str(),
        "--name",
        "rejoin",
        "--wait",
        "--rejoin",
    ];
    args.extend(FAST);
    let (trace, pid) = (lab.path("trace"), lab.path("a.pid"));
    let mut a = lab.spawn(&args, &as_strs(&recording_app(&trace, &pid)));
    let first_app = read_pid(&pid, LIMIT);
    std::fs::remove_file(&pid).unwrap();
    db.kill9();
    assert!(
        wait_until(LIMIT, || a.log_text().contains("backend_retry")),
        "no retry while the server is down: {}",
        a.log_text()
    );
    assert!(!alive(first_app), "the app outlived the lost lock");
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "A exited: {}",
        a.log_text()
    );
    db.restart();
    let second_app = read_pid(&pid, LIMIT);
    assert_ne!(second_app, first_app);
    a.signal(15);
    assert_eq!(a.code(LIMIT), 0, "{}", a.log_text());
    assert_eq!(assert_no_overlap(&trace), 2);
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
