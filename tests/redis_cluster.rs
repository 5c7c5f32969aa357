//! A Redis Cluster of three primaries on loopback (`redis-cli --cluster create`): the lease is taken,
//! held, renewed and released on the node that owns the name's slot, whichever seed node the URL
//! names; `status`, a waiting standby and a scheduled window work the same way.

mod common;

use std::process::Command;
use std::time::Duration;

use common::sentinel::Cluster;
use common::*;

fn args<'a>(url: &'a str, name: &'a str) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", name];
    v.extend_from_slice(REDIS_LEASE);
    v.extend_from_slice(&["--connect-timeout", "5s"]);
    v
}

fn status(url: &str, name: &str) -> (i32, String) {
    let out = Command::new(GUARD)
        .args(["status", "--url", url, "--name", name])
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn lease_is_acquired_renewed_and_released_on_the_slot_owner() {
    let cluster = Cluster::start();
    let url = cluster.url();
    let mut lab = Lab::new();
    let trace = lab.path("trace");
    // Names whose slots live on different nodes, the seed nodes and the third alike.
    for name in ["billing", "reports", "alerts", "search"] {
        let key = format!("sentinel-guard:{{{name}}}");
        let owner = cluster.owner(&key);
        let pidfile = lab.path(&format!("pid-{name}"));
        let mut guard = lab.spawn(
            &args(&url, name),
            &as_strs(&recording_app(&trace, &pidfile)),
        );
        let app = read_pid(&pidfile, Duration::from_secs(10));
        assert!(
            guard.log_text().contains("topology=\"cluster\""),
            "{}",
            guard.log_text()
        );
        let value = owner.cli(&["GET", &key]);
        assert!(value.contains("fence="), "{name}: {value:?}");
        // Renewed: longer than the 3s ttl, the key is still there with a fresh ttl.
        std::thread::sleep(Duration::from_millis(3500));
        assert!(alive(app), "{}", guard.log_text());
        let pttl: i64 = owner.cli(&["PTTL", &key]).parse().unwrap();
        assert!(pttl > 2000, "{name}: pttl {pttl}");
        let (code, shown) = status(&url, name);
        assert_eq!(code, 0, "{shown}");
        assert!(shown.contains(&format!("pid={}", guard.pid())), "{shown}");
        // A second instance is refused, naming the holder.
        let (code, log) = lab.run(&args(&url, name), &["true"], Duration::from_secs(10));
        assert_eq!(code, 1, "{log}");
        guard.exits_0_on_sigterm();
        assert_eq!(owner.cli(&["EXISTS", &key]), "0", "{name}: not released");
        let (code, shown) = status(&url, name);
        assert_eq!(code, 3, "{shown}");
    }
    assert_no_overlap(&trace);
}

#[test]
fn a_waiting_standby_takes_over_at_the_release_and_windows_are_claimed_once() {
    let cluster = Cluster::start();
    let url = cluster.url();
    let mut lab = Lab::new();
    let trace = lab.path("trace");
    let (lead, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let mut leader = lab.spawn(
        &args(&url, "handover"),
        &as_strs(&recording_app(&trace, &lead)),
    );
    read_pid(&lead, Duration::from_secs(10));
    let mut standby = waiting_standby(
        &mut lab,
        &args(&url, "handover"),
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    leader.signal(15);
    assert_eq!(leader.code(Duration::from_secs(5)), 0);
    read_pid(&standby_pid, Duration::from_secs(3));
    standby.signal(15);
    assert_eq!(standby.code(Duration::from_secs(5)), 0);
    assert_eq!(assert_no_overlap(&trace), 2);

    let ran = lab.path("ran");
    let job = ["sh", "-c", "echo run >> \"$0\"", ran.to_str().unwrap()];
    let mut once = args(&url, "hourly");
    once.extend_from_slice(&["--once-per", "1h"]);
    for _ in 0..2 {
        let (code, log) = lab.run(&once, &job, Duration::from_secs(10));
        assert_eq!(code, 0, "{log}");
    }
    let runs = std::fs::read_to_string(&ran).unwrap_or_default();
    assert_eq!(runs.lines().count(), 1, "the window ran {runs:?}");
    let window = cluster
        .owner("sentinel-guard:{hourly}:window")
        .cli(&["GET", "sentinel-guard:{hourly}:window"]);
    assert!(window.contains("window_start="), "{window:?}");
}

/// A reshard moves the lock's slot, keys and all, to another node while the lease is held: the
/// guard follows `MOVED` and renews there, and the app never notices.
#[test]
fn a_resharded_slot_is_followed() {
    let cluster = Cluster::start();
    let url = cluster.url();
    let mut lab = Lab::new();
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    // `billing` lives on the third node, which the URL does not name.
    let key = "sentinel-guard:{billing}";
    let mut guard = lab.spawn(
        &args(&url, "billing"),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    let app = read_pid(&pidfile, Duration::from_secs(10));
    let token = cluster.owner(key).cli(&["GET", key]);
    cluster.move_slot(key, 0);
    assert_eq!(cluster.owner(key).port, cluster.nodes[0].port);
    // Longer than the ttl: only renewals on the new owner keep the lease.
    std::thread::sleep(Duration::from_millis(4000));
    assert!(alive(app), "{}", guard.log_text());
    assert_eq!(cluster.nodes[0].cli(&["GET", key]), token);
    let pttl: i64 = cluster.nodes[0].cli(&["PTTL", key]).parse().unwrap();
    assert!(pttl > 2000, "pttl {pttl}: {}", guard.log_text());
    guard.exits_0_on_sigterm();
    assert_eq!(cluster.nodes[0].cli(&["EXISTS", key]), "0");
}
