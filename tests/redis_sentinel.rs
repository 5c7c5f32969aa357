//! Redis behind Sentinel, for real: a primary, two replicas and three sentinels on loopback. A
//! leader and a `--wait --takeover-delay` standby, both running apps that record start and stop in
//! one trace; then a failover (`SENTINEL FAILOVER`, a SIGKILLed primary, a failover that loses the
//! lease). Whatever happens, no two apps overlap: the leader keeps its lease on the new primary
//! (its token was replicated) or stops its app before the standby starts one. A guard started later
//! with the same URL finds the new primary.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::sentinel::{Sentinels, FAILOVER_LEASE};
use common::*;

const NAME: &str = "failover";
const KEY: &str = "sentinel-guard:{failover}";
fn args<'a>(url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", NAME];
    v.extend_from_slice(FAILOVER_LEASE);
    v.extend_from_slice(&["--connect-timeout", "5s"]);
    v.extend_from_slice(extra);
    v
}

struct Pair {
    lab: Lab,
    leader: GuardProcess,
    lead_app: i32,
    standby: GuardProcess,
    standby_pid: PathBuf,
    trace: PathBuf,
}

fn leader_and_standby(url: &str, extra: &[&str]) -> Pair {
    let mut lab = Lab::new();
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let leader = lab.spawn(
        &args(url, extra),
        &as_strs(&recording_app(&trace, &lead_pid)),
    );
    let lead_app = read_pid(&lead_pid, Duration::from_secs(10));
    let mut standby_args = args(url, extra);
    standby_args.extend_from_slice(&["--takeover-delay", "3s"]);
    let standby = waiting_standby(
        &mut lab,
        &standby_args,
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    Pair {
        lab,
        leader,
        lead_app,
        standby,
        standby_pid,
        trace,
    }
}

/// `sentinel-guard status`: its exit code and what it printed.
fn status(url: &str) -> (i32, String) {
    let out = Command::new(GUARD)
        .args(["status", "--url", url, "--name", NAME])
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// After a failover the leader keeps its app, renews on the new primary (its exact token is there),
/// and the standby keeps waiting. Then the leader stops: the standby takes over at once on the new
/// primary, and a guard started afterwards with the same URL acquires there too.
fn assert_lease_survives(group: &mut Sentinels, failover: impl FnOnce(&mut Sentinels) -> u16) {
    let url = group.url();
    let mut pair = leader_and_standby(&url, &["--redis-min-replicas", "1"]);
    assert!(pair.leader.log_text().contains("topology=\"sentinel\""));
    let old = group.primary_port().unwrap();
    let token = group.cli(old, &["GET", KEY]);
    let faulted = Instant::now();
    let new = failover(group);
    eprintln!("new primary after {:?}", faulted.elapsed());
    assert_ne!(new, old);
    assert_eq!(
        group.cli(new, &["GET", KEY]),
        token,
        "the new primary does not hold the leader's token"
    );
    // Renewed there: each renewal sets the ttl back to 10s.
    let renewed = wait_until(Duration::from_secs(8), || {
        let pttl: i64 = group.cli(new, &["PTTL", KEY]).parse().unwrap_or(0);
        pttl > 9_000 && faulted.elapsed() > Duration::from_secs(3)
    });
    assert!(
        renewed,
        "the leader did not renew on the new primary: {}",
        pair.leader.log_text()
    );
    assert!(
        alive(pair.lead_app),
        "the leader's app was stopped: {}",
        pair.leader.log_text()
    );
    assert!(!pair.standby_pid.exists(), "the standby started an app");
    let (code, shown) = status(&url);
    assert_eq!(code, 0, "{shown}");
    assert!(
        shown.contains(&format!("pid={}", pair.leader.pid())),
        "{shown}"
    );

    pair.leader.signal(15);
    assert_eq!(pair.leader.code(Duration::from_secs(10)), 0);
    // A standby whose attempts failed during the failover may be in its backoff (250ms doubling).
    let standby_app = read_pid(&pair.standby_pid, Duration::from_secs(15));
    assert!(
        pair.standby
            .log_text()
            .contains("previous_release=\"clean\""),
        "a release acknowledged by a replica is a clean hand-over: {}",
        pair.standby.log_text()
    );
    assert!(alive(standby_app));
    pair.standby.signal(15);
    assert_eq!(pair.standby.code(Duration::from_secs(10)), 0);
    assert_no_overlap(&pair.trace);

    let (code, log) = pair
        .lab
        .run(&args(&url, &[]), &["true"], Duration::from_secs(10));
    assert_eq!(
        code, 0,
        "a new guard did not acquire on the new primary: {log}"
    );
}

#[test]
fn sentinel_failover_keeps_a_replicated_lease() {
    let mut group = Sentinels::start();
    assert_lease_survives(&mut group, |group| group.failover());
}

#[test]
fn primary_sigkill_keeps_a_replicated_lease() {
    let mut group = Sentinels::start();
    assert_lease_survives(&mut group, |group| {
        let old = group.primary_port().unwrap();
        group.primary().kill9();
        group.await_new_primary(old, Duration::from_secs(20))
    });
}

/// The fencing token in a guard's `lock_acquired` line.
fn token_in(log: &str) -> u64 {
    log.split_whitespace()
        .find_map(|field| field.strip_prefix("fencing_token="))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no fencing token in {log}"))
}

/// What asynchronous replication can do: the new primary never received the leader's acquisition
/// (here it is undone there right after the failover: the lease deleted, the counter set back). The
/// standby is granted the lock there, but starts only after its takeover delay, even though the new
/// primary holds a clean-release marker that now looks current; its fencing token is still above the
/// leader's; the leader's next renewal finds no token of its own and stops its app first (exit 75).
#[test]
fn a_failover_that_loses_the_lease_stops_the_leader_before_the_standby_starts() {
    let group = Sentinels::start();
    let url = group.url();
    // A clean release first: the marker the lost acquisition would have made stale.
    let mut lab = Lab::new();
    let (code, log) = lab.run(&args(&url, &[]), &["true"], Duration::from_secs(10));
    assert_eq!(code, 0, "{log}");
    let primary = group.primary_port().unwrap();
    let released = group.cli(primary, &["GET", "sentinel-guard:{failover}:fence"]);
    let mut pair = leader_and_standby(&url, &[]);
    let new = group.failover();
    group.cli(new, &["DEL", KEY]);
    group.cli(new, &["SET", "sentinel-guard:{failover}:fence", &released]);
    let lost = Instant::now();
    let stopped = wait_until(Duration::from_secs(10), || !alive(pair.lead_app));
    assert!(stopped, "{}", pair.leader.log_text());
    eprintln!("leader's app stopped {:?} after the loss", lost.elapsed());
    assert_eq!(
        pair.leader.code(Duration::from_secs(5)),
        75,
        "{}",
        pair.leader.log_text()
    );
    assert!(
        pair.leader.log_text().contains("reason=not_owner"),
        "{}",
        pair.leader.log_text()
    );
    read_pid(&pair.standby_pid, Duration::from_secs(15));
    let standby_log = pair.standby.log_text();
    assert!(
        standby_log.contains("takeover_delay"),
        "after a failover a release marker proves nothing: {standby_log}"
    );
    assert!(
        token_in(&standby_log) > token_in(&pair.leader.log_text()),
        "fencing went backwards: {standby_log}"
    );
    pair.standby.signal(15);
    pair.standby.wait(Duration::from_secs(10));
    assert_no_overlap(&pair.trace);
}

/// Fewer replicas than `--redis-min-replicas`: no acquisition is ever confirmed, the app never
/// starts, and the guard fails closed (69) after connect-timeout.
#[test]
fn too_few_replicas_never_start_the_app() {
    let group = Sentinels::start();
    let url = group.url();
    let mut lab = Lab::new();
    let marker = lab.path("ran");
    let started = Instant::now();
    let (code, log) = lab.run(
        &args(&url, &["--redis-min-replicas", "3"]),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(20),
    );
    assert_eq!(code, 69, "{log}");
    assert!(!marker.exists());
    assert!(log.contains("of --redis-min-replicas 3"), "{log}");
    assert!(started.elapsed() < Duration::from_secs(10), "{log}");
}
