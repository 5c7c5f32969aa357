//! The etcd backend against a private, real three-member etcd cluster, with real faults: members
//! killed, quorum lost, a silent link, the guard SIGKILLed and SIGSTOPped.

mod common;

use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::proxy::Proxy;
use common::*;

const SIGSTOP: i32 = 19;

/// After a fault at `t`, the last acknowledged keep-alive was sent no earlier than `t - 550ms`, so
/// the cluster cannot expire the lease before `t + 4s - 550ms`; the guard stops the app by
/// `t + 2.86s`.
const STOPPED_WITHIN: Duration = Duration::from_millis(3_400);

fn args<'a>(url: &'a str, name: &'a str) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", name];
    v.extend_from_slice(ETCD_LEASE);
    v
}

/// A guard running the recording app, with the app's pid.
fn leader(lab: &mut Lab, url: &str, name: &str) -> (GuardProcess, i32) {
    let (trace, pidfile) = (lab.path("trace"), lab.path("lead"));
    let guard = lab.spawn(&args(url, name), &as_strs(&recording_app(&trace, &pidfile)));
    let app = read_pid(&pidfile, Duration::from_secs(10));
    (guard, app)
}

fn standby(lab: &mut Lab, url: &str, name: &str) -> GuardProcess {
    let (trace, pidfile) = (lab.path("trace"), lab.path("standby"));
    waiting_standby(
        lab,
        &args(url, name),
        &as_strs(&recording_app(&trace, &pidfile)),
    )
}

/// Waits for the standby's app, asserting the leader's app was dead when it started.
fn standby_app_after(lab: &Lab, lead_app: i32, limit: Duration) -> Duration {
    let pidfile = lab.path("standby");
    let began = Instant::now();
    assert!(
        wait_until(limit, || pidfile.exists()),
        "the standby's app did not start within {limit:?}"
    );
    let took = began.elapsed();
    assert!(
        !alive(lead_app),
        "the standby's app started while the old app ran"
    );
    took
}

fn key(name: &str) -> String {
    format!("sentinel-guard/lock/{name}")
}

fn get(etcd: &Etcd, key: &str) -> String {
    stdout_of({
        let mut cmd = etcd.ctl();
        cmd.args(["get", "--print-value-only", key]);
        cmd
    })
    .unwrap_or_default()
}

#[test]
fn second_instance_exits_1_status_names_the_holder_and_a_clean_exit_releases() {
    let etcd = Etcd::cluster(3);
    let mut lab = Lab::new();
    let url = etcd.url();
    let (mut first, _) = leader(&mut lab, &url, "contended");
    let marker = lab.path("second-ran");
    let (code, log) = lab.run(
        &args(&url, "contended"),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(10),
    );
    assert_eq!(code, 1, "{log}");
    assert!(!marker.exists());
    assert!(log.contains(&format!("pid={}", first.pid())), "{log}");
    let status = stdout_of({
        let mut cmd = std::process::Command::new(GUARD);
        cmd.args(["status", "--url", &url, "--name", "contended"]);
        cmd
    })
    .unwrap();
    assert!(
        status.contains("state=held") && status.contains(&format!("pid={}", first.pid())),
        "{status}"
    );
    assert!(status.contains("ttl_remaining_ms="), "{status}");
    assert!(get(&etcd, &key("contended")).contains("holder_id="));

    first.signal(15);
    assert_eq!(first.code(Duration::from_secs(5)), 0);
    assert_eq!(
        get(&etcd, &key("contended")),
        "",
        "a clean exit deletes the key"
    );
    let record = get(&etcd, "sentinel-guard/record/contended");
    assert!(record.starts_with("released "), "{record}");
}

#[test]
fn a_waiting_standby_takes_over_within_milliseconds_of_a_clean_exit() {
    let etcd = Etcd::cluster(3);
    let mut lab = Lab::new();
    let url = etcd.url();
    let (mut lead, lead_app) = leader(&mut lab, &url, "handover");
    let mut next = standby(&mut lab, &url, "handover");
    lead.signal(15);
    assert_eq!(lead.code(Duration::from_secs(5)), 0);
    let took = standby_app_after(&lab, lead_app, Duration::from_secs(2));
    assert!(took < Duration::from_secs(1), "hand-over took {took:?}");
    assert!(
        next.log_text().contains("previous=released"),
        "{}",
        next.log_text()
    );
    assert_eq!(assert_no_overlap(&lab.path("trace")), 2);
    next.signal(15);
    assert_eq!(next.code(Duration::from_secs(5)), 0);
}

#[test]
fn guard_sigkill_hands_over_within_a_second_once_the_app_is_dead() {
    let etcd = Etcd::cluster(3);
    let mut lab = Lab::new();
    let url = etcd.url();
    let (mut lead, lead_app) = leader(&mut lab, &url, "crash");
    let mut next = standby(&mut lab, &url, "crash");
    lead.signal(9);
    lead.wait(Duration::from_secs(5));
    // The watchdog revokes the lease once the app's tree is gone: no wait for the 4s ttl.
    let took = standby_app_after(&lab, lead_app, Duration::from_secs(3));
    assert!(took < Duration::from_secs(1), "took over after {took:?}");
    next.signal(15);
    assert_eq!(next.code(Duration::from_secs(5)), 0);
}

#[test]
fn a_frozen_guard_has_its_app_stopped_before_the_lease_expires() {
    let etcd = Etcd::cluster(3);
    let mut lab = Lab::new();
    let url = etcd.url();
    let (mut lead, lead_app) = leader(&mut lab, &url, "frozen");
    let mut next = standby(&mut lab, &url, "frozen");
    let frozen = Instant::now();
    send(lead.pid(), SIGSTOP);
    assert!(
        wait_until(Duration::from_secs(6), || !alive(lead_app)),
        "the frozen guard's app still runs"
    );
    let dead_after = frozen.elapsed();
    assert!(
        dead_after < STOPPED_WITHIN,
        "app died {dead_after:?} after the guard froze, after the lease could expire"
    );
    standby_app_after(&lab, lead_app, Duration::from_secs(10));
    lead.signal(9);
    lead.wait(Duration::from_secs(5));
    next.signal(15);
    assert_eq!(next.code(Duration::from_secs(5)), 0);
}

#[test]
fn the_guard_rides_through_the_loss_of_the_leading_member() {
    let mut etcd = Etcd::cluster(3);
    let mut lab = Lab::new();
    let url = etcd.url();
    let (mut guard, app) = leader(&mut lab, &url, "failover");
    let killed = etcd.leader();
    etcd.kill(killed);
    // Two ttls: every keep-alive in them went through the failover.
    let lost = wait_until(Duration::from_secs(8), || !alive(app));
    assert!(!lost, "the app was stopped: {}", guard.log_text());
    assert_ne!(etcd.leader(), killed);
    assert!(
        !guard.log_text().contains("lock_lost"),
        "{}",
        guard.log_text()
    );
    guard.exits_0_on_sigterm();
}

#[test]
fn quorum_lost_stops_the_app_before_the_lease_could_expire_with_exit_75() {
    let mut etcd = Etcd::cluster(3);
    let mut lab = Lab::new();
    let url = etcd.url();
    let (mut guard, app) = leader(&mut lab, &url, "quorum");
    let lost = Instant::now();
    etcd.kill(0);
    etcd.kill(1);
    assert!(
        wait_until(Duration::from_secs(6), || !alive(app)),
        "the app still runs without a quorum"
    );
    let dead_after = lost.elapsed();
    assert!(
        dead_after < STOPPED_WITHIN,
        "app died {dead_after:?} after quorum loss"
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
    assert!(trace_lines(&lab.path("trace")).contains(&format!("stop {app}")));
}

#[test]
fn a_silent_link_to_the_cluster_stops_the_app_before_the_lease_expires() {
    let etcd = Etcd::cluster(3);
    let proxy = Proxy::start(etcd.client_port(0));
    let mut lab = Lab::new();
    let proxied = format!("etcd://127.0.0.1:{}", proxy.port);
    let (mut guard, app) = leader(&mut lab, &proxied, "partition");
    let silent = Instant::now();
    proxy.partition();
    assert!(
        wait_until(Duration::from_secs(6), || !alive(app)),
        "the app still runs behind a silent link"
    );
    let dead_after = silent.elapsed();
    assert!(
        dead_after < STOPPED_WITHIN,
        "app died {dead_after:?} after the partition"
    );
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        75,
        "{}",
        guard.log_text()
    );
    // The lease runs out on the cluster's side; a guard that reaches it directly takes over.
    let url = etcd.url();
    let mut next = lab.spawn(
        &[args(&url, "partition"), vec!["--wait"]].concat(),
        &as_strs(&recording_app(&lab.path("trace"), &lab.path("standby"))),
    );
    standby_app_after(&lab, app, Duration::from_secs(10));
    assert_eq!(assert_no_overlap(&lab.path("trace")), 2);
    next.signal(15);
    assert_eq!(next.code(Duration::from_secs(5)), 0);
}

#[test]
fn fencing_tokens_increase_over_acquisitions() {
    let etcd = Etcd::cluster(3);
    let mut lab = Lab::new();
    let url = etcd.url();
    let tokens: Vec<u64> = (0..3)
        .map(|round| token_seen_by_app(&mut lab, &args(&url, "fenced"), round))
        .collect();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

#[test]
fn scheduled_runs_and_unsafe_timings_are_refused_with_exit_2() {
    let mut lab = Lab::new();
    let url = "etcd://127.0.0.1:1";
    let (code, log) = lab.run(
        &[args(url, "job"), vec!["--every", "1m"]].concat(),
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("etcd has no clock"), "{log}");
    let (code, log) = lab.run(
        &[
            "--url",
            url,
            "--name",
            "job",
            "--ttl",
            "2s",
            "--grace-period",
            "5s",
        ],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("unsafe lease timings"), "{log}");
}

#[test]
fn an_unreachable_cluster_fails_closed_with_exit_69() {
    let mut lab = Lab::new();
    let url = format!("etcd://127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let marker = lab.path("ran");
    let (code, log) = lab.run(
        &args(&url, "nobody"),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(15),
    );
    assert_eq!(code, 69, "{log}");
    assert!(!marker.exists());
}

#[test]
fn authentication_works_and_a_wrong_password_exits_69_unprinted() {
    let mut etcd = Etcd::cluster(1);
    etcd.enable_auth("r00tpw", "guard", "s3cretpw", "sentinel-guard/");
    let mut lab = Lab::new();
    let port = etcd.client_port(0);
    let url = format!("etcd://guard:s3cretpw@127.0.0.1:{port}");
    let (mut guard, _) = leader(&mut lab, &url, "authed");
    let log = guard.log_text();
    assert!(log.contains("etcd lease acquired"), "{log}");
    assert!(!log.contains("s3cretpw"), "password leaked: {log}");
    guard.exits_0_on_sigterm();
    assert!(!guard.log_text().contains("s3cretpw"));
    assert_wrong_password_exits_69_unprinted(
        &format!("etcd://guard:wr0ngpw@127.0.0.1:{port}"),
        "wr0ngpw",
        "s3cretpw",
        "authentication failed",
    );
}
