//! Hot standby (`--wait`), takeover with and without `--takeover-delay`, and the `status` command, on
//! every backend.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn guard_args<'a>(backend: &Backend, url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", "standby"];
    v.extend(backend.fast_args());
    v.extend_from_slice(extra);
    v
}

/// A standby started with `args` (which include `--wait`), once it says it is waiting.
fn waiting_standby(lab: &mut Lab, args: &[&str], app: &[&str]) -> GuardProcess {
    let standby = lab.spawn(args, app);
    assert!(wait_until(Duration::from_secs(5), || standby
        .log_text()
        .contains("waiting")));
    standby
}

#[test]
fn standby_takes_over_when_the_leaders_app_exits() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let trace = lab.path("trace");
        let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
        let mut leader = lab.spawn(
            &guard_args(&backend, &url, &[]),
            &as_strs(&recording_app(&trace, &lead_pid)),
        );
        read_pid(&lead_pid, Duration::from_secs(10));
        let mut standby = lab.spawn(
            &guard_args(&backend, &url, &["--wait"]),
            &as_strs(&recording_app(&trace, &standby_pid)),
        );
        // The standby must still be waiting, not exited and not running its app.
        assert!(!wait_until(Duration::from_millis(700), || standby_pid
            .exists()
            || standby.child.try_wait().unwrap().is_some()));
        assert!(
            standby.log_text().contains("waiting"),
            "{}: {}",
            backend.name(),
            standby.log_text()
        );

        leader.signal(15);
        assert_eq!(leader.code(Duration::from_secs(10)), 0);
        read_pid(&standby_pid, Duration::from_secs(5));
        assert_eq!(assert_no_overlap(&trace), 2, "{}", backend.name());
        standby.signal(15);
        assert_eq!(standby.code(Duration::from_secs(10)), 0);
    }
}

#[test]
fn standby_takes_over_when_the_leader_guard_is_sigkilled() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let trace = lab.path("trace");
        let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
        let leader = lab.spawn(
            &guard_args(&backend, &url, &[]),
            &as_strs(&recording_app(&trace, &lead_pid)),
        );
        let lead_app = read_pid(&lead_pid, Duration::from_secs(10));
        let mut standby = waiting_standby(
            &mut lab,
            &guard_args(&backend, &url, &["--wait"]),
            &as_strs(&recording_app(&trace, &standby_pid)),
        );

        leader.signal(9);
        // Redis frees the key only when the 3s lease expires; the others at once.
        let standby_app = read_pid(&standby_pid, Duration::from_secs(6));
        assert!(
            !alive(lead_app),
            "{}: the leader's app outlived its guard",
            backend.name()
        );
        assert_ne!(standby_app, lead_app);
        standby.signal(15);
        assert_eq!(standby.code(Duration::from_secs(10)), 0);
    }
}

/// A clean release cuts the lock session's outstanding check short, with the connection for that
/// opened while the leader's app was torn down: with a 30s check interval, the standby still takes
/// over at once.
#[test]
fn a_clean_release_cuts_the_check_short_with_what_the_teardown_opened() {
    for backend in [
        Backend::Mysql(common::mariadb::MariaDb::start()),
        Backend::Postgres(common::postgres::Postgres::start()),
    ] {
        let mut lab = Lab::new();
        let url = backend.url();
        let trace = lab.path("trace");
        let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
        let mut cmd = lab.command(
            &lock_args(&url, "standby", &["--check-interval", "30s"]),
            &as_strs(&recording_app(&trace, &lead_pid)),
        );
        cmd.env("SENTINEL_GUARD_LOG", "debug");
        let mut leader = lab.start(cmd);
        read_pid(&lead_pid, Duration::from_secs(10));
        let mut standby = waiting_standby(
            &mut lab,
            &guard_args(&backend, &url, &["--wait"]),
            &as_strs(&recording_app(&trace, &standby_pid)),
        );
        let asked = Instant::now();
        leader.signal(15);
        assert_eq!(leader.code(Duration::from_secs(10)), 0);
        read_pid(&standby_pid, Duration::from_secs(10));
        let took = asked.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "{}: took {took:?}: {}",
            backend.name(),
            leader.log_text()
        );
        assert!(
            leader.log_text().contains("opened_ahead=true"),
            "{}: {}",
            backend.name(),
            leader.log_text()
        );
        assert_eq!(assert_no_overlap(&trace), 2, "{}", backend.name());
        standby.signal(15);
        assert_eq!(standby.code(Duration::from_secs(10)), 0);
    }
}

#[test]
fn standby_after_a_killed_leader_connection_waits_out_the_takeover_delay() {
    let backend = Backend::Mysql(common::mariadb::MariaDb::start());
    let Backend::Mysql(db) = &backend else {
        unreachable!()
    };
    let mut lab = Lab::new();
    let url = backend.url();
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    // The leader's app takes 1s to stop; the standby's delay (detection ~0 + grace 2s) covers it.
    let slow_app = format!(
        "trap 'sleep 1; echo stop $$ >> {t}; exit 0' TERM; echo start $$ >> {t}; echo $$ > {p}; while :; do sleep 0.05; done",
        p = lead_pid.display(),
        t = trace.display()
    );
    let mut leader = lab.spawn(&guard_args(&backend, &url, &[]), &["sh", "-c", &slow_app]);
    read_pid(&lead_pid, Duration::from_secs(10));
    let mut standby = waiting_standby(
        &mut lab,
        &guard_args(&backend, &url, &["--wait", "--takeover-delay", "2s"]),
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    let id = db.holder_of("standby").expect("leader holds the lock");
    db.sql(&format!("KILL {id}"));
    assert_eq!(
        leader.code(Duration::from_secs(10)),
        75,
        "{}",
        leader.log_text()
    );
    read_pid(&standby_pid, Duration::from_secs(10));
    assert_eq!(assert_no_overlap(&trace), 2);
    assert!(
        standby.log_text().contains("event=\"takeover_delayed\""),
        "{}",
        standby.log_text()
    );
    standby.signal(15);
    assert_eq!(standby.code(Duration::from_secs(10)), 0);
}

#[test]
fn redis_standby_skips_the_takeover_delay_after_a_clean_release() {
    let backend = Backend::Redis(common::redis::Redis::start());
    let mut lab = Lab::new();
    let url = backend.url();
    let (code, log) = lab.run(
        &guard_args(&backend, &url, &["--takeover-delay", "5s"]),
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
    assert!(
        log.contains("event=\"takeover_delayed\" reason=no_record"),
        "a first acquisition is not known clean: {log}"
    );
    let started = Instant::now();
    let (code, log) = lab.run(
        &guard_args(&backend, &url, &["--takeover-delay", "5s"]),
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "delay applied after a clean release: {log}"
    );
    assert!(
        log.contains("event=\"takeover_delay_skipped\" reason=released"),
        "{log}"
    );
}

#[test]
fn bounded_wait_gives_up_with_the_held_code() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let (trace, lead_pid) = (lab.path("trace"), lab.path("lead"));
        let _leader = lab.spawn(
            &guard_args(&backend, &url, &[]),
            &as_strs(&recording_app(&trace, &lead_pid)),
        );
        read_pid(&lead_pid, Duration::from_secs(10));
        let marker = lab.path("ran");
        let started = Instant::now();
        let (code, log) = lab.run(
            &guard_args(&backend, &url, &["--wait=2s", "--held-exit-code", "4"]),
            &["touch", marker.to_str().unwrap()],
            Duration::from_secs(10),
        );
        let waited = started.elapsed();
        assert_eq!(code, 4, "{}: {log}", backend.name());
        assert!(!marker.exists());
        assert!(
            waited >= Duration::from_millis(1900) && waited < Duration::from_secs(5),
            "{}: waited {waited:?}",
            backend.name()
        );
    }
}

#[test]
fn sigterm_ends_the_wait_promptly_without_starting_the_app() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let (trace, lead_pid) = (lab.path("trace"), lab.path("lead"));
        let _leader = lab.spawn(
            &guard_args(&backend, &url, &[]),
            &as_strs(&recording_app(&trace, &lead_pid)),
        );
        read_pid(&lead_pid, Duration::from_secs(10));
        let marker = lab.path("ran");
        let mut standby = waiting_standby(
            &mut lab,
            &guard_args(&backend, &url, &["--wait"]),
            &["touch", marker.to_str().unwrap()],
        );
        let sent = Instant::now();
        standby.signal(15);
        assert_eq!(
            standby.code(Duration::from_secs(5)),
            1,
            "{}",
            standby.log_text()
        );
        assert!(
            sent.elapsed() < Duration::from_secs(1),
            "{}: took {:?}",
            backend.name(),
            sent.elapsed()
        );
        assert!(!marker.exists());
    }
}

#[test]
fn three_standbys_queue_and_take_turns_without_overlap() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let trace = lab.path("trace");
        let script = format!(
            "echo start $$ >> {t}; sleep 0.3; echo stop $$ >> {t}",
            t = trace.display()
        );
        let mut guards: Vec<_> = (0..4)
            .map(|_| {
                lab.spawn(
                    &guard_args(&backend, &url, &["--wait"]),
                    &["sh", "-c", &script],
                )
            })
            .collect();
        for guard in &mut guards {
            assert_eq!(
                guard.code(Duration::from_secs(20)),
                0,
                "{}: {}",
                backend.name(),
                guard.log_text()
            );
        }
        assert_eq!(assert_no_overlap(&trace), 4, "{}", backend.name());
    }
}

#[test]
fn status_reports_held_free_and_unreachable() {
    for backend in Backend::all() {
        let mut lab = Lab::new();
        let url = backend.url();
        let status = |lab: &mut Lab, format: &str| {
            let mut cmd = lab.command(&[], &[]);
            cmd.args([
                "status", "--url", &url, "--name", "standby", "--format", format,
            ]);
            cmd.stdout(std::process::Stdio::piped());
            let out = cmd.output().unwrap();
            (
                out.status.code().unwrap(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        };
        let (code, out) = status(&mut lab, "text");
        assert_eq!(code, 3, "{}: {out}", backend.name());
        assert!(out.contains("state=free"), "{out}");

        let (trace, lead_pid) = (lab.path("trace"), lab.path("lead"));
        let leader = lab.spawn(
            &guard_args(&backend, &url, &[]),
            &as_strs(&recording_app(&trace, &lead_pid)),
        );
        read_pid(&lead_pid, Duration::from_secs(10));
        let (code, out) = status(&mut lab, "json");
        assert_eq!(code, 0, "{}: {out}", backend.name());
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(json["state"], "held");
        assert_eq!(json["backend"], backend.name());
        assert_eq!(
            json["holder"]["pid"],
            leader.pid(),
            "{}: {out}",
            backend.name()
        );
        // RFC 3339, as every time status shows.
        let started = json["holder"]["started"].as_str().unwrap_or_default();
        assert!(
            humantime::parse_rfc3339(started).is_ok(),
            "{}: {out}",
            backend.name()
        );
        assert!(!out.contains(common::mariadb::PASSWORD));
    }
    let mut lab = Lab::new();
    for url in [
        format!("mysql://u:p@127.0.0.1:{}/x", free_port()),
        format!("redis://127.0.0.1:{}", free_port()),
    ] {
        let mut cmd = lab.command(&[], &[]);
        cmd.args([
            "status",
            "--url",
            &url,
            "--name",
            "standby",
            "--connect-timeout",
            "1s",
        ]);
        let code = lab.start(cmd).code(Duration::from_secs(10));
        assert_eq!(code, 69, "{url}");
    }
}
