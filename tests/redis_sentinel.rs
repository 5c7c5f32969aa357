//! Redis behind Sentinel, for real: a primary, two replicas and three sentinels on loopback. A
//! leader and a `--wait --takeover-delay` standby, both running apps that record start and stop in
//! one trace; then a failover (`SENTINEL FAILOVER`, a SIGKILLed primary, a failover that loses the
//! lease). Whatever happens, no two apps overlap: the leader keeps its lease on the new primary
//! (its token was replicated, and a replica acknowledged its renewals there) or stops its app before
//! the standby starts one. A guard started later
//! with the same URL finds the new primary.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

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

/// A failover under a leader with `--redis-min-replicas 1` and a waiting standby. The new primary
/// holds the leader's exact token. Ten seconds after the fault the deadline of every renewal
/// confirmed before it has passed (ttl 10s - margin - grace = 8.8s), so one of two things is true:
/// the leader renewed on the new primary (acknowledged by the remaining replica once the sentinels
/// reconfigured it) and its app runs on while the standby waits; or no renewal could be acknowledged
/// in time, and the leader stopped its app (exit 75) before the key could expire anywhere. Either way
/// the standby takes over on the new primary (at once after the leader's release, or once the key
/// expired) without overlap, and a guard started afterwards with the same URL acquires there too.
fn assert_failover_is_safe(group: &mut Sentinels, failover: impl FnOnce(&mut Sentinels) -> u16) {
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
    // The decision point: every deadline from before the fault has passed.
    let held = wait_until(Duration::from_secs(10), || {
        faulted.elapsed() >= Duration::from_secs(10)
    }) && alive(pair.lead_app);
    assert!(!pair.standby_pid.exists(), "the standby started an app");
    let released_at = if held {
        eprintln!("the leader kept its lease through the failover");
        assert_eq!(group.cli(new, &["GET", KEY]), token);
        let (code, shown) = status(&url);
        assert_eq!(code, 0, "{shown}");
        assert!(
            shown.contains(&format!("pid={}", pair.leader.pid())),
            "{shown}"
        );
        let released_at = SystemTime::now();
        pair.leader.signal(15);
        assert_eq!(pair.leader.code(Duration::from_secs(10)), 0);
        Some(released_at)
    } else {
        eprintln!(
            "the leader stopped its app: no renewal was acknowledged in time: {}",
            pair.leader.log_text()
        );
        assert_eq!(
            pair.leader.code(Duration::from_secs(10)),
            75,
            "{}",
            pair.leader.log_text()
        );
        None
    };
    // A standby whose attempts failed during the failover may be in its backoff (250ms doubling, to
    // 2s with these timings).
    assert!(
        wait_until(Duration::from_secs(40), || pair.standby_pid.exists()),
        "the standby did not take over: {}",
        pair.standby.log_text()
    );
    let standby_app = read_pid(&pair.standby_pid, Duration::from_secs(1));
    if let Some(released_at) = released_at {
        // A release acknowledged by a replica is a clean hand-over, unless an attempt of the
        // standby's failed after it (a grant unacknowledged while the remaining replica still
        // syncs with the new primary, or answered too late on a loaded machine): its lease may then
        // have run out before the retry found it, and the hand-over waits as after any unclear one.
        let log = pair.standby.log_text();
        let failed_after = log.lines().any(|line| {
            let stamp = line.split_whitespace().next().unwrap_or_default();
            line.contains("event=\"backend_retry\"")
                && humantime::parse_rfc3339(stamp).is_ok_and(|at| at >= released_at)
        });
        assert!(
            log.contains("previous=released") || (failed_after && log.contains("previous=expired")),
            "a release acknowledged by a replica is a clean hand-over: {log}"
        );
    }
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
fn sentinel_failover_never_overlaps() {
    let mut group = Sentinels::start();
    assert_failover_is_safe(&mut group, |group| group.failover());
}

#[test]
fn primary_sigkill_never_overlaps() {
    let mut group = Sentinels::start();
    assert_failover_is_safe(&mut group, |group| {
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
/// (here it is undone there right after the failover: the lease deleted, the counter and the lease
/// record set back to what they were at the clean release, as replication lag would leave them). The
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
    let record = group.cli(primary, &["GET", "sentinel-guard:{failover}:lease"]);
    let mut pair = leader_and_standby(&url, &[]);
    let new = group.failover();
    group.cli(new, &["DEL", KEY]);
    group.cli(new, &["SET", "sentinel-guard:{failover}:fence", &released]);
    group.cli(new, &["SET", "sentinel-guard:{failover}:lease", &record]);
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
