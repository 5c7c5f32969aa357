//! `--metrics-addr` (`/metrics`, `/healthz`, `/leader`) and `--log-format json`, observed from outside
//! the way Prometheus, a kubelet and a log pipeline see them.

mod common;

use std::collections::HashSet;
use std::net::TcpListener;
use std::time::Duration;

use common::endpoints::{status, Metrics};
use common::mariadb::MariaDb;
use common::redis::Redis;
use common::*;

const LONG: Duration = Duration::from_secs(15);

fn metrics_addr(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// Scrapes until `condition` holds on a scrape; returns that scrape.
fn scrape_until(port: u16, what: &str, condition: impl Fn(&Metrics) -> bool) -> Metrics {
    let mut last = None;
    let held = wait_until(LONG, || {
        last = Metrics::scrape(port);
        last.as_ref().is_some_and(&condition)
    });
    assert!(held, "{what} never showed on port {port}");
    last.unwrap()
}

/// An app that ignores the stop signal, so its guard stays up (and scrapeable) for the whole grace
/// period after the lock is lost.
fn stubborn_app(pidfile: &std::path::Path) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "trap '' TERM; echo $$ > {}; while :; do sleep 0.05; done",
            pidfile.display()
        ),
    ]
}

/// An app that exits 3 once `stopfile` appears, leaving behind a child that ignores the stop
/// signal: the guard then spends its grace period stopping what is left, visibly.
fn exits_leaving_a_child(pidfile: &std::path::Path, stopfile: &std::path::Path) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "echo $$ > {pid}; (trap '' TERM; while :; do sleep 0.05; done) & \
             while [ ! -e {stop} ]; do sleep 0.02; done; exit 3",
            pid = pidfile.display(),
            stop = stopfile.display()
        ),
    ]
}

#[test]
fn metrics_and_leader_follow_acquire_standby_loss_takeover_and_app_exit() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let (lead_port, standby_port) = (free_port(), free_port());
    let (lead_addr, standby_addr) = (metrics_addr(lead_port), metrics_addr(standby_port));
    let (lead_pid, standby_pid, stop) = (lab.path("lead"), lab.path("standby"), lab.path("stop"));

    let mut leader = lab.spawn(
        &[
            &[
                "--url",
                &url,
                "--name",
                "observed",
                "--metrics-addr",
                &lead_addr,
            ],
            &fast_with(&["--grace-period", "3s"])[..],
        ]
        .concat(),
        &as_strs(&stubborn_app(&lead_pid)),
    );
    read_pid(&lead_pid, LONG);
    let lead = scrape_until(lead_port, "two ownership checks", |m| {
        m.value("sentinel_guard_checks_total", &[("outcome", "ok")]) >= 2.0
    });
    let this_lock = [("name", "observed"), ("backend", "mysql")];
    assert_eq!(lead.value("sentinel_guard_lock_held", &this_lock), 1.0);
    assert_eq!(
        lead.value("sentinel_guard_acquire_total", &[("outcome", "acquired")]),
        1.0
    );
    assert_eq!(
        lead.value("sentinel_guard_acquire_total", &[("outcome", "held")]),
        0.0
    );
    assert_eq!(lead.value("sentinel_guard_app_running", &this_lock), 1.0);
    assert_eq!(lead.value("sentinel_guard_unguarded", &this_lock), 0.0);
    assert_eq!(
        lead.value(
            "sentinel_guard_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );
    assert!(lead.value("sentinel_guard_check_duration_seconds_count", &this_lock) >= 2.0);
    let bounded: HashSet<&str> = [
        "name", "backend", "outcome", "reason", "kind", "version", "le",
    ]
    .into_iter()
    .collect();
    for keys in lead.label_keys() {
        assert!(keys.contains(&"name".to_owned()) && keys.contains(&"backend".to_owned()));
        assert!(
            keys.iter().all(|k| bounded.contains(k.as_str())),
            "{keys:?}"
        );
    }
    assert_eq!(status(lead_port, "/leader"), Some(200));
    assert_eq!(status(lead_port, "/healthz"), Some(200));

    // The standby's takeover delay outlasts the leader's grace period, so the apps never overlap.
    let mut standby = lab.spawn(
        &[
            &[
                "--url",
                &url,
                "--name",
                "observed",
                "--metrics-addr",
                &standby_addr,
                "--wait",
                "--takeover-delay",
                "4s",
            ],
            FAST,
        ]
        .concat(),
        &as_strs(&exits_leaving_a_child(&standby_pid, &stop)),
    );
    let waiting = scrape_until(standby_port, "the standby counting a held lock", |m| {
        m.value("sentinel_guard_acquire_total", &[("outcome", "held")]) == 1.0
    });
    assert_eq!(waiting.value("sentinel_guard_lock_held", &this_lock), 0.0);
    assert_eq!(waiting.value("sentinel_guard_app_running", &this_lock), 0.0);
    assert_eq!(status(standby_port, "/leader"), Some(503));
    assert_eq!(status(standby_port, "/healthz"), Some(200));

    let conn = db.holder_of("observed").expect("the leader holds the lock");
    db.sql(&format!("KILL {conn}"));
    let lost = scrape_until(lead_port, "the leader counting the loss", |m| {
        m.value(
            "sentinel_guard_lock_lost_total",
            &[("reason", "connection_closed")],
        ) == 1.0
    });
    assert_eq!(lost.value("sentinel_guard_lock_held", &this_lock), 0.0);
    assert_eq!(
        status(lead_port, "/leader"),
        Some(503),
        "a leader that lost its lock must leave the Service while its app still stops"
    );
    assert_eq!(leader.code(LONG), 75, "{}", leader.log_text());

    assert!(wait_until(LONG, || status(standby_port, "/leader") == Some(200)));
    let took_over = Metrics::scrape(standby_port).unwrap();
    assert_eq!(
        took_over.value("sentinel_guard_acquire_total", &[("outcome", "acquired")]),
        1.0
    );
    assert_eq!(
        took_over.value("sentinel_guard_acquire_total", &[("outcome", "held")]),
        1.0
    );
    assert_eq!(
        took_over.value("sentinel_guard_app_running", &this_lock),
        1.0
    );

    read_pid(&standby_pid, LONG);
    std::fs::write(&stop, "").unwrap();
    let ended = scrape_until(standby_port, "the app's exit", |m| {
        m.value("sentinel_guard_app_exits_total", &[("kind", "exit")]) == 1.0
    });
    assert_eq!(ended.value("sentinel_guard_app_running", &this_lock), 0.0);
    assert_eq!(
        ended.value("sentinel_guard_app_exits_total", &[("kind", "signal")]),
        0.0
    );
    assert_eq!(status(standby_port, "/leader"), Some(503));
    assert_eq!(standby.code(LONG), 3, "{}", standby.log_text());
}

#[test]
fn redis_lease_remaining_stays_within_the_ttl_while_renewed() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let (url, port) = (redis.url(), free_port());
    let addr = metrics_addr(port);
    let pidfile = lab.path("pid");
    let mut guard = lab.spawn(
        &[
            &["--url", &url, "--name", "leased", "--metrics-addr", &addr],
            &fast_with(REDIS_LEASE)[..],
        ]
        .concat(),
        &as_strs(&recording_app(&lab.path("trace"), &pidfile)),
    );
    read_pid(&pidfile, LONG);
    let renewed = scrape_until(port, "two renewals", |m| {
        m.value("sentinel_guard_checks_total", &[("outcome", "ok")]) >= 2.0
    });
    let left = renewed.value(
        "sentinel_guard_lease_remaining_seconds",
        &[("backend", "redis")],
    );
    // ttl 3s minus the drift margin, and at least what a renewal every 500ms leaves.
    assert!(left > 1.5 && left <= 3.0, "lease remaining {left}");
    guard.signal(15);
    assert_eq!(guard.code(LONG), 0, "{}", guard.log_text());
}

/// Inodes of the TCP sockets in LISTEN state on this host.
fn listening_inodes() -> HashSet<String> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| {
            text.lines()
                .skip(1)
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    (fields.get(3) == Some(&"0A")).then(|| fields.get(9).map(|s| s.to_string()))?
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// How many listening TCP sockets the process `pid` has open.
fn listening_sockets_of(pid: i32) -> usize {
    let listening = listening_inodes();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_owned(),
            )
        })
        .filter(|inode| listening.contains(inode))
        .count()
}

#[test]
fn metrics_are_off_by_default_and_open_no_port() {
    let mut lab = Lab::new();
    let url = lab.file_url("quiet.lock");
    let (quiet_pid, served_pid) = (lab.path("quiet"), lab.path("served"));
    let mut quiet = lab.spawn(
        &["--url", &url, "--name", "quiet"],
        &as_strs(&recording_app(&lab.path("trace"), &quiet_pid)),
    );
    read_pid(&quiet_pid, LONG);
    assert_eq!(listening_sockets_of(quiet.pid()), 0);

    // The same count sees the listener when one is asked for.
    let served_url = lab.file_url("served.lock");
    let addr = metrics_addr(free_port());
    let mut served = lab.spawn(
        &[
            "--url",
            &served_url,
            "--name",
            "served",
            "--metrics-addr",
            &addr,
        ],
        &as_strs(&recording_app(&lab.path("trace2"), &served_pid)),
    );
    read_pid(&served_pid, LONG);
    assert_eq!(listening_sockets_of(served.pid()), 1);

    for guard in [&mut quiet, &mut served] {
        guard.signal(15);
        assert_eq!(guard.code(LONG), 0);
    }
}

#[test]
fn a_metrics_address_in_use_is_exit_2_before_any_lock_is_taken() {
    let mut lab = Lab::new();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let lock = lab.path("never.lock");
    let marker = lab.path("app-ran");
    let (code, log) = lab.run(
        &[
            "--url",
            &format!("file://{}", lock.display()),
            "--name",
            "busy",
            "--metrics-addr",
            &addr,
        ],
        &["touch", marker.to_str().unwrap()],
        LONG,
    );
    assert_eq!(code, 2, "{log}");
    assert!(
        log.contains("--metrics-addr") && log.contains(&addr) && log.contains("in use"),
        "{log}"
    );
    assert!(!lock.exists(), "no lock may be taken: {log}");
    assert!(!marker.exists(), "the app must not start");
}

#[test]
fn json_logs_carry_the_same_keys_on_every_line() {
    let mut lab = Lab::new();
    let lock = lab.path("json.lock");
    let pidfile = lab.path("pid");
    let mut guard = lab.spawn(
        &[
            "--url",
            &format!("file://{}", lock.display()),
            "--name",
            "json-demo",
            "--log-format",
            "json",
            "--check-interval",
            "100ms",
        ],
        // Silent, so every line on the guard's stderr is the guard's own.
        &[
            "sh",
            "-c",
            &format!("echo $$ > {}; exec sleep 30", pidfile.display()),
        ],
    );
    let app_pid = read_pid(&pidfile, LONG);
    std::fs::remove_file(&lock).unwrap();
    assert_eq!(guard.code(LONG), 75, "{}", guard.log_text());

    let lines: Vec<serde_json::Value> = guard
        .log_text()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    for line in &lines {
        for key in ["name", "backend", "holder_id", "event", "reason", "app_pid"] {
            assert!(line.get(key).is_some(), "{key} missing: {line}");
        }
        assert_eq!(line["name"], "json-demo", "{line}");
        assert_eq!(line["backend"], "file", "{line}");
        assert!(line["holder_id"].is_string(), "{line}");
        assert!(line["event"].is_string(), "{line}");
    }
    let event = |name: &str| {
        lines
            .iter()
            .find(|line| line["event"] == name)
            .unwrap_or_else(|| panic!("no {name} event in {lines:#?}"))
    };
    event("lock_acquired");
    assert_eq!(event("app_started")["app_pid"], app_pid);
    let lost = event("lock_lost");
    assert_eq!(lost["reason"], "lock_file_deleted");
    assert_eq!(lost["app_pid"], app_pid);
    assert_eq!(event("guard_exiting")["exit_code"], 75);
}
