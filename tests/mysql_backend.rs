//! The MySQL/MariaDB backend against a private, real MariaDB server, with real faults.

mod common;

use std::time::{Duration, Instant};

use common::mariadb::{MariaDb, PASSWORD};
use common::proxy::assert_partition_stops_the_app_before_the_server_frees_the_lock;
use common::*;

const SIGKILL: i32 = 9;
const SIGSTOP: i32 = 19;
const SIGCONT: i32 = 18;

#[test]
fn second_instance_exits_1_names_the_holder_and_never_starts_its_app() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut first = lab.spawn(
        &lock_args(&url, "billing", &[]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    read_pid(&pidfile, Duration::from_secs(10));

    let marker = lab.path("second-ran");
    let (code, log) = lab.run(
        &lock_args(&url, "billing", &[]),
        &["sh", "-c", &format!("touch {}", marker.display())],
        Duration::from_secs(10),
    );
    assert_eq!(code, 1, "{log}");
    assert!(!marker.exists(), "the second app must never start");
    assert!(
        log.contains("connection_id="),
        "holder not described: {log}"
    );
    assert!(
        log.contains(&format!("pid={}", first.pid())),
        "holder's guard not named: {log}"
    );

    first.signal(15);
    assert_eq!(
        first.code(Duration::from_secs(10)),
        0,
        "app traps TERM and exits 0"
    );
    assert_eq!(
        db.holder_of("billing"),
        None,
        "lock released after the app ended"
    );
}

#[test]
fn sigkill_of_the_guard_kills_the_app_and_frees_the_lock() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &lock_args(&url, "sigkill", &[]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    let app = read_pid(&pidfile, Duration::from_secs(10));
    assert!(db.holder_of("sigkill").is_some());

    guard.signal(SIGKILL);
    guard.wait(Duration::from_secs(5));
    assert!(
        wait_until(Duration::from_secs(2), || !alive(app)),
        "app {app} outlived its SIGKILLed guard"
    );
    assert!(
        wait_until(Duration::from_secs(5), || db.holder_of("sigkill").is_none()),
        "the server did not free the lock of a dead guard"
    );
}

/// The server would notice the dead guard's session only when its 30s check `SLEEP` ends; the
/// watchdog ends the session once the app's group is gone, so a standby takes over at once.
#[test]
fn a_sigkilled_guards_lock_is_free_at_once_whatever_the_check_interval() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let mut leader = lab.spawn(
        &lock_args(&url, "orphaned", &["--check-interval", "30s"]),
        &as_strs(&recording_app(&trace, &lead_pid)),
    );
    let lead_app = read_pid(&lead_pid, Duration::from_secs(10));
    let mut standby = lab.spawn(
        &lock_args(&url, "orphaned", &["--wait"]),
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    assert!(wait_until(Duration::from_secs(5), || standby
        .log_text()
        .contains("waiting")));

    leader.signal(SIGKILL);
    leader.wait(Duration::from_secs(5));
    read_pid(&standby_pid, Duration::from_secs(5));
    // SIGKILLed with its guard, so it leaves no stop line to compare; it must simply be gone.
    assert!(!alive(lead_app), "the leader's app outlived its guard");
    assert!(
        wait_until(Duration::from_secs(5), || leader
            .log_text()
            .contains("event=\"watchdog_farewell\"")),
        "{}",
        leader.log_text()
    );

    // A guard that exits on its own leaves its session to itself.
    standby.signal(15);
    assert_eq!(standby.code(Duration::from_secs(10)), 0);
    assert!(
        !standby.log_text().contains("event=\"watchdog"),
        "{}",
        standby.log_text()
    );
}

/// Detection must not depend on --check-interval: with a 30s interval the app is still asked to stop
/// within 5s (typically tens of milliseconds; the bound leaves room for a heavily loaded machine).
fn assert_fault_stops_app_fast(db: &mut MariaDb, name: &str, fault: impl FnOnce(&mut MariaDb)) {
    let mut lab = Lab::new();
    let url = db.url();
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &lock_args(&url, name, &["--check-interval", "30s"]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    let app = read_pid(&pidfile, Duration::from_secs(10));
    // The outstanding check must be on the wire before the fault.
    assert!(wait_until(Duration::from_secs(5), || db.sql(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT SLEEP%'"
    ) == "1"));

    let faulted = Instant::now();
    fault(db);
    assert!(
        wait_until(Duration::from_secs(5), || trace_lines(&trace)
            .contains(&format!("stop {app}"))),
        "app not asked to stop within 5s of the fault; log:\n{}",
        guard.log_text()
    );
    let detected = faulted.elapsed();
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(!alive(app));
    assert!(
        guard.log_text().contains("reason=connection_closed"),
        "{}",
        guard.log_text()
    );
    eprintln!("{name}: app stopped {detected:?} after the fault");
}

#[test]
fn kill_of_the_connection_stops_the_app_with_exit_75() {
    let mut db = MariaDb::start();
    assert_fault_stops_app_fast(&mut db, "conn-kill", |db| {
        let id = db.holder_of("conn-kill").expect("lock held");
        db.sql(&format!("KILL {id}"));
    });
}

#[test]
fn sigkilled_server_stops_the_app_with_exit_75() {
    let mut db = MariaDb::start();
    assert_fault_stops_app_fast(&mut db, "server-death", MariaDb::kill9);
}

#[test]
fn silent_partition_stops_the_app_before_the_server_frees_the_lock() {
    let db = MariaDb::start();
    assert_partition_stops_the_app_before_the_server_frees_the_lock(
        db.port,
        |port| db.url_with_port(port),
        "partition",
        || db.holder_of("partition").is_some(),
    );
}

#[test]
fn wrong_password_exits_69_and_never_prints_the_password() {
    let db = MariaDb::start();
    let wrong = "not-the-pw-9c1f";
    let url = format!("mysql://guard:{wrong}@127.0.0.1:{}/mysql", db.port);
    assert_wrong_password_exits_69_unprinted(&url, wrong, PASSWORD, "Access denied");
}

#[test]
fn read_only_server_is_refused_with_69() {
    let db = MariaDb::start();
    db.sql("SET GLOBAL read_only = 1");
    let mut lab = Lab::new();
    let marker = lab.path("ran");
    let (code, log) = lab.run(
        &lock_args(&db.url(), "replica", &[]),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(10),
    );
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("read_only"), "{log}");
    assert!(!marker.exists());
}

#[test]
fn sigstopped_server_is_a_check_timeout() {
    let mut db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &lock_args(&url, "paused", &[]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    let app = read_pid(&pidfile, Duration::from_secs(10));
    send(db.pid(), SIGSTOP);
    let code = guard.code(Duration::from_secs(10));
    send(db.pid(), SIGCONT);
    assert_eq!(code, 75, "{}", guard.log_text());
    assert!(
        guard.log_text().contains("reason=check_timeout"),
        "{}",
        guard.log_text()
    );
    assert!(trace_lines(&trace).contains(&format!("stop {app}")));
    db.kill9();
}

/// `?socket=`: the server reached over its Unix socket.
#[test]
fn a_unix_socket_reaches_the_server() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    assert_lock_works_over(&mut lab, &db.socket_url());
}
