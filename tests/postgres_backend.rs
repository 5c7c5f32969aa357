//! The PostgreSQL backend against a private, real PostgreSQL server, with real faults.

mod common;

use std::time::{Duration, SystemTime};

use common::pooler::Pooler;
use common::postgres::{Postgres, PASSWORD, POOLED};
use common::proxy::assert_partition_stops_the_app_before_the_server_frees_the_lock;
use common::*;

const SIGKILL: i32 = 9;
const SIGSTOP: i32 = 19;
const SIGCONT: i32 = 18;

#[test]
fn second_instance_exits_1_names_the_holder_and_never_starts_its_app() {
    let db = Postgres::start();
    let mut lab = Lab::new();
    let url = db.url();
    let (trace, pidfile, env) = (lab.path("trace"), lab.path("pid"), lab.path("env"));
    let app = format!(
        "env > {env}; {}",
        recording_app(&trace, &pidfile)[2],
        env = env.display()
    );
    let mut first = lab.spawn(&lock_args(&url, "billing", &[]), &["sh", "-c", &app]);
    read_pid(&pidfile, Duration::from_secs(10));
    let holder = db.holder_of("billing").expect("the lock is in pg_locks");
    let shown = db.sql(&format!(
        "SELECT application_name FROM pg_stat_activity WHERE pid = {holder}"
    ));
    assert!(shown.starts_with("sentinel-guard "), "{shown}");
    let token = fs_line(&env, "SENTINEL_GUARD_FENCING_TOKEN=");
    assert!(token.parse::<u64>().is_ok(), "fencing token {token:?}");
    assert!(first.log_text().contains("key="), "{}", first.log_text());

    let marker = lab.path("second-ran");
    let (code, log) = lab.run(
        &lock_args(&url, "billing", &[]),
        &["sh", "-c", &format!("touch {}", marker.display())],
        Duration::from_secs(10),
    );
    assert_eq!(code, 1, "{log}");
    assert!(!marker.exists(), "the second app must never start");
    assert!(
        log.contains(&format!("backend_pid={holder}")),
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
        "{}",
        first.log_text()
    );
    assert_eq!(
        db.holder_of("billing"),
        None,
        "lock released after the app ended"
    );

    // The next holder's fencing token is larger.
    let (code, log) = lab.run(
        &lock_args(&url, "billing", &[]),
        &["sh", "-c", &format!("env > {}", env.display())],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
    let next = fs_line(&env, "SENTINEL_GUARD_FENCING_TOKEN=");
    assert!(next.parse::<u64>().unwrap() > token.parse::<u64>().unwrap());
}

/// The value of the line of `path` that starts with `prefix`.
fn fs_line(path: &std::path::Path, prefix: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .unwrap_or_default()
        .to_owned()
}

/// Detection must not depend on --check-interval: with a 30s interval the outstanding `pg_sleep`
/// ends with the session, the guard logs the loss, stops the app and exits 75. Returns the moment
/// the fault's `SystemTime` and the guard's log.
fn assert_fault_stops_app(
    db: &mut Postgres,
    name: &str,
    fault: impl FnOnce(&mut Postgres) -> SystemTime,
) -> (SystemTime, String) {
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
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(30.000)%' \
         AND state = 'active' AND pid <> pg_backend_pid()"
    ) == "1"));

    let faulted = fault(db);
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(!alive(app));
    assert!(trace_lines(&trace).contains(&format!("stop {app}")));
    let log = guard.log_text();
    assert!(log.contains("reason=connection_closed"), "{log}");
    (faulted, log)
}

/// When a guard logged `event`: the timestamp of that line.
fn logged_at(log: &str, event: &str) -> SystemTime {
    let line = log
        .lines()
        .find(|line| line.contains(&format!("event=\"{event}\"")))
        .unwrap_or_else(|| panic!("no {event} line: {log}"));
    let stamp = line.split_whitespace().next().unwrap();
    humantime::parse_rfc3339(stamp).unwrap_or_else(|e| panic!("{stamp}: {e}"))
}

/// Measured on the host's clock from the server's own timestamp of the termination to the guard's
/// log line, so neither test client's start-up is counted.
#[test]
fn pg_terminate_backend_is_seen_within_100ms_and_stops_the_app_with_exit_75() {
    let mut db = Postgres::start();
    let (terminated, log) = assert_fault_stops_app(&mut db, "terminated", |db| {
        let pid = db.holder_of("terminated").expect("lock held");
        let answer = db.sql(&format!(
            "SELECT extract(epoch FROM clock_timestamp()), pg_terminate_backend({pid})"
        ));
        let (epoch, done) = answer.split_once('|').unwrap();
        assert_eq!(done, "t");
        SystemTime::UNIX_EPOCH + Duration::from_secs_f64(epoch.parse().unwrap())
    });
    let seen = logged_at(&log, "lock_lost")
        .duration_since(terminated)
        .unwrap_or_default();
    eprintln!("pg_terminate_backend: loss logged {seen:?} after it");
    assert!(
        seen < Duration::from_millis(100),
        "loss logged {seen:?} after the termination"
    );
}

#[test]
fn sigkilled_server_stops_the_app_with_exit_75_and_the_restarted_one_grants_the_lock() {
    let mut db = Postgres::start();
    assert_fault_stops_app(&mut db, "server-death", |db| {
        let killed = SystemTime::now();
        db.restart();
        killed
    });
    let mut lab = Lab::new();
    let (code, log) = lab.run(
        &lock_args(&db.url(), "server-death", &[]),
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
}

#[test]
fn sigstopped_server_is_a_check_timeout() {
    let mut db = Postgres::start();
    let mut lab = Lab::new();
    let url = db.url();
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &lock_args(&url, "paused", &[]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    let app = read_pid(&pidfile, Duration::from_secs(10));
    db.signal_all(SIGSTOP);
    let code = guard.code(Duration::from_secs(10));
    db.signal_all(SIGCONT);
    assert_eq!(code, 75, "{}", guard.log_text());
    assert!(
        guard.log_text().contains("reason=check_timeout"),
        "{}",
        guard.log_text()
    );
    assert!(trace_lines(&trace).contains(&format!("stop {app}")));
    db.kill9();
}

#[test]
fn silent_partition_stops_the_app_before_the_server_frees_the_lock() {
    let db = Postgres::start();
    assert_partition_stops_the_app_before_the_server_frees_the_lock(
        db.port,
        |port| db.url_with_port(port),
        "partition",
        || db.holder_of("partition").is_some(),
    );
}

#[test]
fn a_sigkilled_guards_lock_passes_to_the_standby_at_once_and_leaves_no_orphan() {
    let db = Postgres::start();
    let mut lab = Lab::new();
    let url = db.url();
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let mut leader = lab.spawn(
        &lock_args(&url, "orphaned", &["--check-interval", "30s"]),
        &as_strs(&recording_app(&trace, &lead_pid)),
    );
    let lead_app = read_pid(&lead_pid, Duration::from_secs(10));
    let mut standby = waiting_standby(
        &mut lab,
        &lock_args(&url, "orphaned", &[]),
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    let lead_backend = db.holder_of("orphaned").expect("leader holds the lock");

    // From before the signal is sent to the standby's log line, on the host's clock.
    let killed = SystemTime::now();
    leader.signal(SIGKILL);
    assert!(
        wait_until(Duration::from_secs(5), || db
            .holder_of("orphaned")
            .is_some_and(|pid| pid != lead_backend)),
        "the standby never got the lock: {}",
        leader.log_text()
    );
    leader.wait(Duration::from_secs(5));
    read_pid(&standby_pid, Duration::from_secs(5));
    assert!(!alive(lead_app), "the leader's app outlived its guard");
    assert!(
        wait_until(Duration::from_secs(5), || leader
            .log_text()
            .contains("event=\"watchdog_farewell\"")),
        "{}",
        leader.log_text()
    );
    let handed_over = logged_at(&standby.log_text(), "lock_acquired")
        .duration_since(killed)
        .unwrap_or_default();
    // Typically 10-30 ms (the benchmark's target is 100 ms); the bound leaves room for a loaded
    // machine and a debug build, and is still far below the 38s the server alone would take.
    eprintln!("lock passed to the standby {handed_over:?} after the SIGKILL");
    assert!(
        handed_over < Duration::from_secs(1),
        "standby got the lock only {handed_over:?} after the SIGKILL: {}",
        leader.log_text()
    );
    assert!(
        leader.log_text().contains("done=ended backend"),
        "{}",
        leader.log_text()
    );

    standby.signal(15);
    assert_eq!(standby.code(Duration::from_secs(10)), 0);
    assert!(
        !standby.log_text().contains("event=\"watchdog"),
        "{}",
        standby.log_text()
    );
}

#[test]
fn wrong_password_exits_69_and_never_prints_the_password() {
    let db = Postgres::start();
    let wrong = "not-the-pw-9c1f";
    let url = format!("postgres://guard:{wrong}@127.0.0.1:{}/postgres", db.port);
    assert_wrong_password_exits_69_unprinted(
        &url,
        wrong,
        PASSWORD,
        "password authentication failed",
    );
}

#[test]
fn hot_standby_is_refused_with_69() {
    let primary = Postgres::start();
    let replica = Postgres::standby_of(&primary);
    let mut lab = Lab::new();
    let marker = lab.path("ran");
    let (code, log) = lab.run(
        &lock_args(&replica.url(), "replica", &[]),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(10),
    );
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("hot standby"), "{log}");
    assert!(!marker.exists());
}

#[test]
fn a_transaction_pooler_is_refused_with_69_and_an_explanation() {
    let db = Postgres::start();
    let pooler = Pooler::start(db.port);
    let mut lab = Lab::new();
    let marker = lab.path("ran");
    let url = format!("postgres://{POOLED}@127.0.0.1:{}/postgres", pooler.port);
    let (code, log) = lab.run(
        &lock_args(&url, "pooled", &[]),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(10),
    );
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("pooler in"), "{log}");
    assert!(log.contains("session mode"), "{log}");
    assert!(!marker.exists());
    // The same role straight to the server is fine.
    let direct = format!("postgres://{POOLED}@127.0.0.1:{}/postgres", db.port);
    let (code, log) = lab.run(
        &lock_args(&direct, "pooled", &[]),
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
}

/// libpq's `sslmode` meanings, against a server whose certificate names `db.example` and is signed
/// by a private CA, reached as 127.0.0.1.
#[test]
fn sslmodes_verify_what_they_promise() {
    let (db, ca) = Postgres::start_with_tls();
    let mut lab = Lab::new();
    let url = |query: &str| format!("{}?{query}", db.url());
    let ca = ca.display();
    for (query, code) in [
        ("sslmode=require".to_owned(), 0),
        (format!("sslmode=verify-ca&sslrootcert={ca}"), 0),
        // libpq: `require` with a CA file verifies the chain.
        (format!("sslmode=require&sslrootcert={ca}"), 0),
        // The certificate does not name 127.0.0.1.
        (format!("sslmode=verify-full&sslrootcert={ca}"), 69),
        // The system's store does not know the private CA.
        ("sslmode=verify-ca".to_owned(), 69),
    ] {
        let (got, log) = lab.run(
            &lock_args(&url(&query), "tls", &[]),
            &["true"],
            Duration::from_secs(10),
        );
        assert_eq!(got, code, "{query}: {log}");
        assert!(code == 0 || log.contains("certificate"), "{query}: {log}");
    }
    // The session really is encrypted.
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &lock_args(&url("sslmode=require"), "tls", &[]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    read_pid(&pidfile, Duration::from_secs(10));
    let pid = db.holder_of("tls").expect("held");
    assert_eq!(
        db.sql(&format!("SELECT ssl FROM pg_stat_ssl WHERE pid = {pid}")),
        "t"
    );
    guard.signal(15);
    assert_eq!(guard.code(Duration::from_secs(10)), 0);
}

#[test]
fn status_prints_key_and_holder_as_text_and_json() {
    let db = Postgres::start();
    let mut lab = Lab::new();
    let url = db.url();
    let status = |format: &str| {
        let out = std::process::Command::new(GUARD)
            .args([
                "status", "--url", &url, "--name", "reports", "--format", format,
            ])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, free) = status("text");
    assert_eq!(code, Some(3), "{free}");
    assert!(
        free.contains("backend=postgres") && free.contains("state=free"),
        "{free}"
    );
    let key = free
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("key="))
        .expect("key printed")
        .to_owned();
    assert_eq!(
        db.sql("SELECT ('x' || left(encode(sha256('sentinel-guard:reports'), 'hex'), 16))::bit(64)::int8"),
        key,
        "the documented key function"
    );

    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &lock_args(&url, "reports", &[]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    read_pid(&pidfile, Duration::from_secs(10));
    let backend = db.holder_of("reports").unwrap();
    let (code, held) = status("text");
    assert_eq!(code, Some(0), "{held}");
    assert!(held.contains("state=held"), "{held}");
    assert!(held.contains(&format!("backend_pid={backend}")), "{held}");
    assert!(held.contains(&format!("pid={}", guard.pid())), "{held}");
    assert!(!held.contains(PASSWORD), "{held}");
    let (code, json) = status("json");
    assert_eq!(code, Some(0), "{json}");
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["backend"], "postgres");
    assert_eq!(value["state"], "held");
    assert_eq!(value["key"].to_string(), key);
    // Numbers are JSON numbers.
    assert_eq!(
        value["holder"]["backend_pid"].to_string(),
        backend.to_string()
    );
    assert!(value["holder"]["backend_pid"].is_u64(), "{json}");
    guard.signal(15);
    assert_eq!(guard.code(Duration::from_secs(10)), 0);
}

#[test]
fn metrics_carry_the_postgres_backend_label() {
    let db = Postgres::start();
    let mut lab = Lab::new();
    let url = db.url();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &lock_args(&url, "metered", &["--metrics-addr", &addr]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    read_pid(&pidfile, Duration::from_secs(10));
    let scrape = || {
        ureq::get(&format!("http://{addr}/metrics"))
            .call()
            .ok()
            .and_then(|mut r| r.body_mut().read_to_string().ok())
            .unwrap_or_default()
    };
    let held = "sentinel_guard_lock_held{name=\"metered\",backend=\"postgres\"} 1";
    let checked =
        "sentinel_guard_checks_total{name=\"metered\",backend=\"postgres\",outcome=\"ok\"}";
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            text = scrape();
            text.contains(held) && text.contains(checked)
        }),
        "{text}"
    );
    guard.signal(15);
    assert_eq!(guard.code(Duration::from_secs(10)), 0);
}

/// A Unix socket directory in `host=`, as libpq takes it: connects without TLS whatever `sslmode`
/// says (the server offers none there, and libpq ignores it too).
#[test]
fn a_unix_socket_directory_reaches_the_server_whatever_the_sslmode() {
    let db = Postgres::start();
    let mut lab = Lab::new();
    for query in ["&sslmode=disable", "", "&sslmode=require"] {
        assert_lock_works_over(&mut lab, &db.socket_url(query));
    }
}
