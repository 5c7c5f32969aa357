//! `--ca-file`: a private CA verifies on every TLS backend, and a wrong one is a clear exit 69 that
//! prints no secret. The servers' certificates come from a CA each test makes with `openssl`.

mod common;

use std::path::Path;
use std::time::Duration;

use common::mariadb::{MariaDb, PASSWORD};
use common::redis::Redis;
use common::tls::make_ca;
use common::*;

const LIMIT: Duration = Duration::from_secs(20);

fn tls_url(db: &MariaDb) -> String {
    format!("{}?require_ssl=true", db.url())
}

/// The guard on `url` trusting `ca` (or the default roots), running `app`: (exit code, log).
fn guard_trusting(lab: &mut Lab, url: &str, ca: Option<&Path>, app: &[&str]) -> (i32, String) {
    let mut args = vec!["--url", url, "--name", "tls"];
    args.extend(
        ca.map(|ca| ["--ca-file", ca.to_str().unwrap()])
            .into_iter()
            .flatten(),
    );
    lab.run(&args, app, LIMIT)
}

/// `status` on `url` trusting `ca`: (exit code, stderr).
fn status_trusting(lab: &Lab, url: &str, ca: &Path) -> (Option<i32>, String) {
    let args = [
        "status",
        "--url",
        url,
        "--name",
        "tls",
        "--ca-file",
        ca.to_str().unwrap(),
    ];
    let out = lab.command(&args, &[]).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_untrusted(code: i32, log: &str) {
    assert_eq!(code, 69, "{log}");
    assert!(
        log.contains("TLS certificate not trusted") && log.contains("--ca-file"),
        "no clear reason: {log}"
    );
    assert!(!log.contains(PASSWORD), "the password leaked: {log}");
}

#[test]
fn mysql_verifies_against_the_ca_file_and_a_wrong_ca_exits_69_naming_the_certificate() {
    let db = MariaDb::start_tls();
    let mut lab = Lab::new();
    let url = tls_url(&db);
    let ca = db.ca_cert();
    let (code, log) = guard_trusting(&mut lab, &url, Some(&ca), &["true"]);
    assert_eq!(code, 0, "{log}");
    assert_eq!(status_trusting(&lab, &url, &ca).0, Some(3));
    // Without --ca-file the built-in roots do not know the test's CA.
    let (code, log) = guard_trusting(&mut lab, &url, None, &["true"]);
    assert_untrusted(code, &log);

    make_ca(lab.dir.path(), "wrong");
    let wrong = lab.path("wrong.pem");
    let marker = lab.path("ran");
    let app = ["touch", marker.to_str().unwrap()];
    let (code, log) = guard_trusting(&mut lab, &url, Some(&wrong), &app);
    assert_untrusted(code, &log);
    assert!(!marker.exists(), "the app ran without a verified backend");
    let (code, stderr) = status_trusting(&lab, &url, &wrong);
    assert_eq!(code, Some(69), "{stderr}");
    assert!(!stderr.contains(PASSWORD), "the password leaked: {stderr}");
}

#[test]
fn redis_verifies_against_the_ca_file_and_a_wrong_ca_exits_69() {
    let redis = Redis::start_tls();
    let mut lab = Lab::new();
    let (code, log) = guard_trusting(&mut lab, &redis.url(), Some(&redis.ca_cert()), &["true"]);
    assert_eq!(code, 0, "{log}");
    make_ca(lab.dir.path(), "wrong");
    let wrong = lab.path("wrong.pem");
    let (code, log) = guard_trusting(&mut lab, &redis.url(), Some(&wrong), &["true"]);
    assert_untrusted(code, &log);
}

#[test]
fn a_ca_file_that_cannot_apply_is_a_usage_error_before_any_connection() {
    let mut lab = Lab::new();
    make_ca(lab.dir.path(), "ca");
    let ca = lab.path("ca.pem");
    let ca = ca.to_str().unwrap();
    let not_pem = lab.path("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let file_url = lab.file_url("x.lock");
    let cases: [(&str, &str, &str); 5] = [
        ("mysql://u:pw@127.0.0.1:1/db", ca, "require_ssl=true"),
        ("redis://127.0.0.1:1", ca, "rediss://"),
        (&file_url, ca, "uses no TLS"),
        (
            "rediss://127.0.0.1:1",
            not_pem.to_str().unwrap(),
            "no PEM certificate",
        ),
        (
            "rediss://127.0.0.1:1",
            "/nonexistent/ca.pem",
            "/nonexistent/ca.pem",
        ),
    ];
    for (url, ca, says) in cases {
        let (code, log) = lab.run(
            &["--url", url, "--name", "x", "--ca-file", ca],
            &["true"],
            LIMIT,
        );
        assert_eq!(code, 2, "{url} {ca}: {log}");
        assert!(
            log.contains("--ca-file") && log.contains(says),
            "{url}: {log}"
        );
    }
}

/// The watchdog of a SIGKILLed guard ends its MySQL session over TLS with the same --ca-file, so a
/// standby takes over in well under the check interval the server would otherwise need, and only
/// once the killed guard's app is dead.
#[test]
fn the_watchdog_of_a_killed_guard_frees_a_tls_lock_with_the_ca_file() {
    let db = MariaDb::start_tls();
    let mut lab = Lab::new();
    let url = tls_url(&db);
    let ca = db.ca_cert();
    let args = [
        "--url",
        &url,
        "--name",
        "tls-farewell",
        "--ca-file",
        ca.to_str().unwrap(),
        "--check-interval",
        "30s",
    ];
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let leader = lab.spawn(&args, &as_strs(&recording_app(&trace, &lead_pid)));
    let lead_app = read_pid(&lead_pid, LIMIT);
    let mut standby = waiting_standby(
        &mut lab,
        &args,
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    let killed = std::time::Instant::now();
    send(leader.pid(), 9);
    read_pid(&standby_pid, LIMIT);
    assert!(!alive(lead_app), "the killed guard's app outlived its lock");
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "takeover took {:?}: the farewell did not end the session",
        killed.elapsed()
    );
    standby.signal(15);
    assert_eq!(standby.code(LIMIT), 0, "{}", standby.log_text());
}

/// PostgreSQL: `--ca-file` turns verification on under the default `sslmode=prefer` (as libpq's
/// `sslrootcert` does); a wrong CA is the same clear exit 69 as on the other backends.
#[test]
fn postgres_verifies_against_the_ca_file_and_a_wrong_ca_exits_69() {
    let (db, ca) = common::postgres::Postgres::start_with_tls();
    let mut lab = Lab::new();
    let (code, log) = guard_trusting(&mut lab, &db.url(), Some(&ca), &["true"]);
    assert_eq!(code, 0, "{log}");
    make_ca(lab.dir.path(), "wrong");
    let wrong = lab.path("wrong.pem");
    let (code, log) = guard_trusting(&mut lab, &db.url(), Some(&wrong), &["true"]);
    assert_untrusted(code, &log);
    assert!(!log.contains(common::postgres::PASSWORD), "{log}");
}
