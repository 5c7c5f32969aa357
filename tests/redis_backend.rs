//! The Redis lease backend against a private, real redis-server, with real faults.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::redis::Redis;
use common::tls::make_ca;
use common::*;

const SIGSTOP: i32 = 19;
const SIGCONT: i32 = 18;

fn args<'a>(url: &'a str, name: &'a str) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", name];
    v.extend_from_slice(REDIS_LEASE);
    v.extend_from_slice(&["--connect-timeout", "2s"]);
    v
}

fn key(name: &str) -> String {
    format!("sentinel-guard:{{{name}}}")
}

/// Starts a guard running the recording app and returns it with the app's pid.
fn leader(lab: &mut Lab, url: &str, name: &str) -> (GuardProcess, i32) {
    let (trace, pidfile) = (lab.path("trace"), lab.path(&format!("pid-{name}")));
    let guard = lab.spawn(&args(url, name), &as_strs(&recording_app(&trace, &pidfile)));
    let app = read_pid(&pidfile, Duration::from_secs(10));
    (guard, app)
}

#[test]
fn second_instance_exits_1_and_shows_holder_and_remaining_ttl() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let (mut first, _) = leader(&mut lab, &url, "contended");
    let marker = lab.path("second-ran");
    let (code, log) = lab.run(
        &args(&url, "contended"),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(10),
    );
    assert_eq!(code, 1, "{log}");
    assert!(!marker.exists());
    assert!(
        log.contains(&format!("pid={}", first.pid())),
        "holder not named: {log}"
    );
    assert!(log.contains("ttl_remaining_ms="), "{log}");
    assert!(log.contains("fencing_token=1"), "{log}");

    first.signal(15);
    assert_eq!(first.code(Duration::from_secs(5)), 0);
    assert_eq!(
        redis.cli(&["EXISTS", &key("contended")]),
        "0",
        "a clean exit deletes the key"
    );
}

#[test]
fn sigkill_of_the_guard_kills_the_app_and_the_lease_expires_within_ttl() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let (mut guard, app) = leader(&mut lab, &url, "crash");
    guard.signal(9);
    guard.wait(Duration::from_secs(5));
    let killed = Instant::now();
    assert!(
        wait_until(Duration::from_secs(1), || !alive(app)),
        "app outlived its SIGKILLed guard"
    );
    let marker = lab.path("next-ran");
    let mut acquired = false;
    while !acquired && killed.elapsed() < Duration::from_secs(4) {
        let (code, _) = lab.run(
            &args(&url, "crash"),
            &["touch", marker.to_str().unwrap()],
            Duration::from_secs(10),
        );
        acquired = code == 0;
    }
    assert!(
        acquired && marker.exists(),
        "no new guard acquired within ttl + 1s"
    );
}

fn assert_key_tampering_is_a_lost_lock(tamper: &[&str]) {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let (mut guard, app) = leader(&mut lab, &url, "tamper");
    let tampered = Instant::now();
    let mut command = tamper.to_vec();
    let key = key("tamper");
    command.insert(1, &key);
    redis.cli(&command);
    let trace = lab.path("trace");
    assert!(
        wait_until(Duration::from_millis(1500), || trace_lines(&trace)
            .contains(&format!("stop {app}"))),
        "app not stopped within renew-interval + 1s of {tamper:?}; log:\n{}",
        guard.log_text()
    );
    eprintln!("{tamper:?}: app stopped {:?} after", tampered.elapsed());
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("reason=not_owner"),
        "{}",
        guard.log_text()
    );
    if tamper[0] == "SET" {
        assert_eq!(
            redis.cli(&["GET", &key]),
            "someone-else",
            "another token's key must never be deleted"
        );
    }
}

#[test]
fn deleting_the_key_stops_the_app_with_exit_75() {
    assert_key_tampering_is_a_lost_lock(&["DEL"]);
}

#[test]
fn overwriting_the_key_stops_the_app_with_exit_75() {
    assert_key_tampering_is_a_lost_lock(&["SET", "someone-else"]);
}

#[test]
fn client_kill_is_survived_by_reconnecting() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let (mut guard, app) = leader(&mut lab, &url, "reconnect");
    let killed = redis.cli(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
    assert_ne!(killed, "0", "the guard's connection was not killed");
    // Longer than the ttl: without a working renewal the lease, and the app, would be gone.
    let survived = !wait_until(Duration::from_secs(4), || {
        !alive(app) || guard.child.try_wait().unwrap().is_some()
    });
    assert!(
        survived,
        "app or guard ended after CLIENT KILL; log:\n{}",
        guard.log_text()
    );
    let ttl: i64 = redis.cli(&["PTTL", &key("reconnect")]).parse().unwrap();
    assert!(
        ttl > 0,
        "lease not renewed after the reconnect (pttl {ttl})"
    );
    guard.signal(15);
    assert_eq!(guard.code(Duration::from_secs(5)), 0);
}

#[test]
fn frozen_server_app_is_stopped_before_the_lease_could_expire() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let (mut guard, app) = leader(&mut lab, &url, "frozen");
    // Every renewal confirmed so far was sent before this instant.
    let frozen = Instant::now();
    send(redis.pid(), SIGSTOP);
    let stopped = wait_until(Duration::from_secs(6), || !alive(app));
    let app_dead_after = frozen.elapsed();
    assert!(stopped, "app still running while the server is frozen");
    assert!(
        app_dead_after < Duration::from_secs(3),
        "app died {app_dead_after:?} after the last possible renewal, past the 3s ttl"
    );
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("reason=lease_expiring"),
        "{}",
        guard.log_text()
    );
    assert!(
        trace_lines(&lab.path("trace")).contains(&format!("stop {app}")),
        "stopped gracefully first"
    );

    // Frozen for 2 x ttl in all, then a new guard takes over; the first app was long dead.
    std::thread::sleep(Duration::from_secs(6).saturating_sub(frozen.elapsed()));
    send(redis.pid(), SIGCONT);
    let (code, log) = lab.run(&args(&url, "frozen"), &["true"], Duration::from_secs(10));
    assert_eq!(code, 0, "{log}");
}

#[test]
fn server_restarted_empty_is_a_lost_lock() {
    let mut redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let (mut guard, app) = leader(&mut lab, &url, "amnesia");
    redis.restart();
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("reason=not_owner"),
        "{}",
        guard.log_text()
    );
    assert!(!alive(app));
}

#[test]
fn fencing_token_increases_across_successive_holders() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let tokens: Vec<u64> = (0..3)
        .map(|i| token_seen_by_app(&mut lab, &args(&url, "fenced"), i))
        .collect();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

/// A Redis that restarts empty has lost its counter; the next token must still be greater.
#[test]
fn fencing_token_never_goes_backwards_after_redis_loses_its_data() {
    let mut redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let before = token_seen_by_app(&mut lab, &args(&url, "fenced"), 0);
    redis.restart();
    assert_eq!(redis.cli(&["DBSIZE"]), "0", "the restart kept the data");
    let after = token_seen_by_app(&mut lab, &args(&url, "fenced"), 1);
    assert!(after > before, "token went from {before} to {after}");
}

#[test]
fn unsafe_lease_timings_exit_2_naming_the_numbers() {
    let mut lab = Lab::new();
    let (code, log) = lab.run(
        &[
            "--url",
            "redis://127.0.0.1:1",
            "--name",
            "x",
            "--ttl",
            "10s",
            "--grace-period",
            "10s",
        ],
        &["true"],
        Duration::from_secs(5),
    );
    assert_eq!(code, 2, "{log}");
    assert!(
        log.contains("ttl 10s") && log.contains("grace-period 10s"),
        "{log}"
    );
}

#[test]
fn tls_with_the_right_ca_works_and_a_wrong_ca_exits_69() {
    let redis = Redis::start_tls();
    let mut lab = Lab::new();
    let url = redis.url();
    let mut cmd = lab.command(&args(&url, "tls"), &["true"]);
    cmd.env("SSL_CERT_FILE", redis.ca_cert());
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        0,
        "{}",
        guard.log_text()
    );

    make_ca(lab.dir.path(), "wrong");
    let marker = lab.path("ran");
    let mut cmd = lab.command(&args(&url, "tls"), &["touch", marker.to_str().unwrap()]);
    cmd.env("SSL_CERT_FILE", lab.path("wrong.pem"));
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        69,
        "{}",
        guard.log_text()
    );
    assert!(!marker.exists());
}

/// One of the server's `INFO commandstats` counters for `command` (`calls`, `failed_calls`).
fn command_stat(redis: &Redis, command: &str, counter: &str) -> u32 {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:")))
        .and_then(|stats| {
            stats
                .split(',')
                .find_map(|stat| stat.strip_prefix(&format!("{counter}=")))?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// A server reached on a new connection may lack the scripts (a restart, a promoted replica):
/// the lock's first call there sends its script in front of itself, so no call is answered
/// `NOSCRIPT` (which, with `--redis-min-replicas`, would have sat through its `WAIT` for nothing).
#[test]
fn a_new_connection_sends_the_script_in_front_of_its_first_call() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let (mut guard, app) = leader(&mut lab, &redis.url(), "fresh");
    redis.cli(&["CONFIG", "RESETSTAT"]);
    // In one go, as a restart would have it: no call of the guard's comes between the two.
    let port = redis.port.to_string();
    let mut cli = std::process::Command::new("redis-cli")
        .args(["-p", &port, "--pipe"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    cli.stdin
        .take()
        .unwrap()
        .write_all(b"SCRIPT FLUSH\r\nCLIENT KILL TYPE normal SKIPME yes\r\n")
        .unwrap();
    assert!(cli.wait().unwrap().success());
    assert!(
        wait_until(Duration::from_secs(5), || command_stat(
            &redis,
            "script|load",
            "calls"
        ) >= 1
            && command_stat(&redis, "evalsha", "calls") >= 3),
        "the guard did not renew on a new connection: {}",
        guard.log_text()
    );
    assert_eq!(
        command_stat(&redis, "evalsha", "failed_calls"),
        0,
        "a call was answered NOSCRIPT: {}",
        guard.log_text()
    );
    assert!(alive(app));
    guard.exits_0_on_sigterm();
}

/// A server that lost the guard's scripts (`SCRIPT FLUSH`, as a restart or a promoted replica
/// would have none) answers the first call `NOSCRIPT`: the script is loaded and the same call made
/// again, within the same renewal; nothing fails, and the release is made too.
#[test]
fn scripts_gone_from_the_server_are_sent_again_within_the_same_call() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let (mut guard, app) = leader(&mut lab, &url, "flushed");
    redis.cli(&["CONFIG", "RESETSTAT"]);
    redis.cli(&["SCRIPT", "FLUSH"]);
    let loads = || command_stat(&redis, "script|load", "calls");
    assert!(
        wait_until(Duration::from_secs(5), || loads() >= 1),
        "no renewal loaded its script: {}",
        guard.log_text()
    );
    assert!(alive(app));
    guard.exits_0_on_sigterm();
    let log = guard.log_text();
    assert!(!log.contains("renewal_failed"), "{log}");
    assert!(log.contains("event=\"lock_released\""), "{log}");
    assert!(loads() >= 2, "the release did not load its script");
}
