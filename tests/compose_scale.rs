//! What `docker compose up --scale app=N` and rolling deploys do to a singleton: many guards at once,
//! guards as PID 1 of their own PID namespace, and a new guard started while the old one shuts down.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// Starts `n` guards at once and returns them with the index of the one whose app runs; asserts
/// every other guard exited 1 within `refuse_within`.
fn herd(
    lab: &mut Lab,
    cmds: Vec<std::process::Command>,
    refuse_within: Duration,
) -> (Vec<GuardProcess>, usize) {
    let started = Instant::now();
    let mut guards: Vec<_> = cmds.into_iter().map(|cmd| lab.start(cmd)).collect();
    let mut leader = None;
    for (i, guard) in guards.iter_mut().enumerate() {
        let pidfile = lab.path(&format!("pid-{i}"));
        let decided = wait_until(Duration::from_secs(15), || {
            pidfile.exists() || guard.child.try_wait().unwrap().is_some()
        });
        assert!(
            decided,
            "guard {i} neither ran nor exited: {}",
            guard.log_text()
        );
        if pidfile.exists() {
            assert!(leader.replace(i).is_none(), "two apps started");
        } else {
            assert_eq!(
                guard.code(Duration::from_secs(1)),
                1,
                "{}",
                guard.log_text()
            );
        }
    }
    assert!(
        started.elapsed() < refuse_within,
        "refusals took {:?}",
        started.elapsed()
    );
    (guards, leader.expect("one app runs"))
}

#[test]
fn twenty_guards_started_at_once_run_exactly_one_app() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let trace = lab.path("trace");
        let cmds = (0..20)
            .map(|i| {
                let mut args = vec!["--url", url.as_str(), "--name", "herd"];
                args.extend(backend.fast_args());
                lab.command(
                    &args,
                    &as_strs(&recording_app(&trace, &lab.path(&format!("pid-{i}")))),
                )
            })
            .collect();
        let (mut guards, leader) = herd(&mut lab, cmds, Duration::from_secs(15));
        assert_eq!(assert_no_overlap(&trace), 1, "{}", backend.name());
        guards[leader].signal(15);
        assert_eq!(guards[leader].code(Duration::from_secs(10)), 0);
    }
}

#[test]
fn compose_scale_of_three_pid1_guards_runs_one_app_and_hands_over_on_docker_stop() {
    let db = mariadb::MariaDb::start();
    let url = db.url();
    let mut lab = Lab::new();
    let trace = lab.path("trace");
    let mut args = vec!["--url", url.as_str(), "--name", "compose"];
    args.extend(FAST);
    let cmds = (0..3)
        .map(|i| {
            lab.command_as_pid1(
                &args,
                &as_strs(&recording_app(&trace, &lab.path(&format!("pid-{i}")))),
            )
        })
        .collect();
    let (mut guards, leader) = herd(&mut lab, cmds, Duration::from_secs(5));
    // `docker stop` sends SIGTERM to the container's PID 1: the guard.
    let stopped = Instant::now();
    guards[leader].signal(15);
    assert_eq!(
        guards[leader].code(Duration::from_secs(10)),
        0,
        "{}",
        guards[leader].log_text()
    );
    assert_eq!(
        trace_lines(&trace)
            .iter()
            .filter(|l| l.starts_with("stop"))
            .count(),
        1,
        "the app got SIGTERM"
    );
    assert_eq!(db.holder_of("compose"), None, "lock released");

    let fresh = lab.path("pid-fresh");
    let mut replacement =
        lab.start(lab.command_as_pid1(&args, &as_strs(&recording_app(&trace, &fresh))));
    read_pid(&fresh, Duration::from_secs(3));
    eprintln!(
        "docker stop to replacement app running: {:?}",
        stopped.elapsed()
    );
    assert_eq!(assert_no_overlap(&trace), 2);
    replacement.signal(15);
    assert_eq!(replacement.code(Duration::from_secs(10)), 0);
}

#[test]
fn rolling_restart_starts_the_new_app_only_after_the_old_one_stopped() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let trace = lab.path("trace");
        let mut args = vec!["--url", url.as_str(), "--name", "rolling"];
        args.extend(backend.fast_args());
        // The old app needs half a second to shut down cleanly (within every backend's grace period).
        let old_pid = lab.path("old");
        let slow = format!(
            "trap 'sleep 0.5; echo stop $$ >> {t}; exit 0' TERM; echo start $$ >> {t}; echo $$ > {p}; while :; do sleep 0.05; done",
            t = trace.display(),
            p = old_pid.display()
        );
        let mut old = lab.spawn(&args, &["sh", "-c", &slow]);
        read_pid(&old_pid, Duration::from_secs(10));
        old.signal(15);
        let mut new_args = args.clone();
        new_args.push("--wait");
        let new_pid = lab.path("new");
        let mut new = lab.spawn(&new_args, &as_strs(&recording_app(&trace, &new_pid)));
        assert_eq!(old.code(Duration::from_secs(10)), 0, "{}", old.log_text());
        read_pid(&new_pid, Duration::from_secs(10));
        assert_eq!(assert_no_overlap(&trace), 2, "{}", backend.name());
        new.signal(15);
        assert_eq!(new.code(Duration::from_secs(10)), 0);
    }
}
