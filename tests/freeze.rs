//! A whole guard tree frozen past its lock's life (cgroup freezer: the guard, its app and its
//! watchdog all stop at once, as under a paused VM or container) must not let the old app run on
//! once thawed: by then a standby holds the lock, so the old app has to be dead within moments of
//! the thaw, killed outright rather than asked to stop with a grace period it no longer has.

mod common;

use std::fs;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::freeze::{Freezer, FrozenGuard};
use common::procs::{lock_lost_reasons, watchdog_of};
use common::*;

/// How long after the thaw the old app may still record a heartbeat: time for the thawed guard or
/// watchdog to see the deadline has passed and SIGKILL it, nothing like a grace period.
const AFTER_THAW: Duration = Duration::from_millis(50);

/// The backends' tests run one at a time: the bound above is tight, and a second frozen tree and
/// servers starting in parallel on this small machine would only add scheduling noise.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// An app that appends the wall-clock time in ns to `beats` every 10ms, after writing its pid to
/// `pidfile`. On SIGTERM it beats on for 3 more seconds before exiting 0, so a stop that goes
/// through the stop signal and the grace period shows as beats long after the thaw.
fn heartbeat_app(beats: &Path, pidfile: &Path) -> Vec<String> {
    let script = r#"
import os, signal, sys, time
beats, pidfile = sys.argv[1], sys.argv[2]
stop_at = None
def on_term(signum, frame):
    global stop_at
    if stop_at is None:
        stop_at = time.monotonic() + 3
signal.signal(signal.SIGTERM, on_term)
fd = os.open(beats, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
with open(pidfile + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pidfile + ".tmp", pidfile)
while stop_at is None or time.monotonic() < stop_at:
    os.write(fd, b"%d\n" % time.time_ns())
    time.sleep(0.01)
"#;
    vec![
        "python3".to_owned(),
        "-c".to_owned(),
        script.to_owned(),
        beats.display().to_string(),
        pidfile.display().to_string(),
    ]
}

/// The latest heartbeat recorded, in ns since the epoch; a torn last line is ignored.
fn last_beat(beats: &Path) -> Option<u128> {
    fs::read_to_string(beats)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .max()
}

fn epoch_ns(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// Freezes the leader's whole tree until a standby holds the lock, thaws it, and checks that the
/// old app stops beating at once and the leader reports the lost lock.
fn frozen_tree_is_killed_at_thaw(backend: &Backend, timings: &[&str], lock_life: Duration) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut lab = Lab::new();
    let url = backend.url();
    let mut args = vec!["--url", url.as_str(), "--name", "frozen-tree"];
    args.extend_from_slice(timings);
    let (beats, lead_pid) = (lab.path("beats"), lab.path("lead"));
    let (trace, standby_pid) = (lab.path("trace"), lab.path("standby"));

    let cgroup = Freezer::create();
    let cmd = cgroup.command(&lab.command(&args, &as_strs(&heartbeat_app(&beats, &lead_pid))));
    let mut leader = FrozenGuard {
        guard: lab.start(cmd),
        cgroup,
    };
    let lead_app = read_pid(&lead_pid, Duration::from_secs(15));
    let guard_pid = leader.guard.pid();
    let watchdog = watchdog_of(guard_pid, Duration::from_secs(5));
    // The point of the freezer is that all three stop together; make sure they are all inside it.
    let members = leader.cgroup.procs();
    for (what, pid) in [
        ("guard", guard_pid),
        ("app", lead_app),
        ("watchdog", watchdog),
    ] {
        assert!(
            members.contains(&pid),
            "{}: {what} {pid} is not in the freezer cgroup {members:?}",
            backend.name()
        );
    }

    let mut standby = waiting_standby(
        &mut lab,
        &args,
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    assert!(
        wait_until(Duration::from_secs(5), || last_beat(&beats).is_some()),
        "{}: the leader's app never beat",
        backend.name()
    );

    leader.cgroup.freeze();
    let frozen_at = Instant::now();
    // The lock outlives the frozen guard only until the backend frees it; a standby that starts its
    // app is the proof it did. Wait well past that moment.
    read_pid(&standby_pid, lock_life);
    eprintln!(
        "{}: standby took over {:?} into the freeze",
        backend.name(),
        frozen_at.elapsed()
    );
    let thawed_at = leader.cgroup.thaw();
    let thawed_instant = Instant::now();

    let died = wait_until(Duration::from_secs(10), || !alive(lead_app));
    assert!(
        died,
        "{}: the thawed app lives on next to the standby's; log:\n{}",
        backend.name(),
        leader.guard.log_text()
    );
    let last = last_beat(&beats).expect("beats were seen before the freeze");
    let thawed = epoch_ns(thawed_at);
    let late_ms = (last as i128 - thawed as i128) as f64 / 1e6;
    eprintln!(
        "{}: last heartbeat {late_ms:.1}ms after the thaw",
        backend.name()
    );
    assert!(
        last <= thawed + AFTER_THAW.as_nanos(),
        "{}: the old app beat {late_ms:.1}ms after the thaw while the standby held the lock; log:\n{}",
        backend.name(),
        leader.guard.log_text()
    );

    // Within a few seconds of the thaw (time to flush its logs included), not after a grace period.
    let code = leader
        .guard
        .code(Duration::from_secs(5).saturating_sub(thawed_instant.elapsed()));
    let log = leader.guard.log_text();
    assert_eq!(code, 75, "{}: log:\n{log}", backend.name());
    let reasons = lock_lost_reasons(&log);
    assert!(
        reasons
            .iter()
            .any(|r| r == "deadline_passed" || r == "guard_frozen"),
        "{}: lock_lost reasons {reasons:?}; log:\n{log}",
        backend.name()
    );
    // Nothing of the old tree outlives its guard (the watchdog ends once the guard is gone).
    assert!(
        wait_until(Duration::from_secs(10), || leader.cgroup.procs().is_empty()),
        "{}: left in the cgroup after the guard exited: {:?}",
        backend.name(),
        leader.cgroup.procs()
    );

    standby.signal(15);
    assert_eq!(
        standby.code(Duration::from_secs(10)),
        0,
        "{}: standby log:\n{}",
        backend.name(),
        standby.log_text()
    );
}

#[test]
fn mysql_frozen_tree_is_killed_at_thaw() {
    let backend = Backend::Mysql(mariadb::MariaDb::start());
    // Grace 5s: a stop through SIGTERM would leave 3s of beats. The server frees the silent session
    // after wait_timeout = ceil(200ms + 800ms + 5s + 5s) = 11s.
    let timings = fast_with(&["--grace-period", "5s"]);
    frozen_tree_is_killed_at_thaw(&backend, &timings, Duration::from_secs(60));
}

#[test]
fn redis_frozen_tree_is_killed_at_thaw() {
    let backend = Backend::Redis(redis::Redis::start());
    // REDIS_LEASE with grace 5s, which needs a longer ttl to keep the startup rule:
    // ttl 8s - margin 180ms - grace 5s = 2.82s >= renew 500ms + check-timeout 500ms.
    let timings = fast_with(&[
        "--ttl",
        "8s",
        "--renew-interval",
        "500ms",
        "--check-timeout",
        "500ms",
        "--grace-period",
        "5s",
    ]);
    frozen_tree_is_killed_at_thaw(&backend, &timings, Duration::from_secs(30));
}
