//! The app asks the guard: `sentinel-guard held` over `SENTINEL_GUARD_SOCKET`, and the guard steps
//! down when `--health-cmd` says the app is unhealthy (exit 76). Real servers, real processes.

mod common;

use std::fs;
use std::time::Duration;

use common::mariadb::MariaDb;
use common::redis::Redis;
use common::{
    as_strs, assert_no_overlap, fast_with, lock_args, read_pid, recording_app, wait_until,
    waiting_standby, Lab, GUARD, REDIS_LEASE,
};

/// Seconds on `CLOCK_MONOTONIC`, the clock Python's `time.monotonic()` reads.
fn monotonic() -> f64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    now.tv_sec() as f64 + now.tv_nsec() as f64 / 1e9
}

/// An app that asks `sentinel-guard held` every 20ms and appends `<monotonic seconds> <exit code>`
/// to `out`; on SIGTERM it goes on asking for one more second, then exits 0.
fn asking_app(out: &std::path::Path, ready: &std::path::Path) -> Vec<String> {
    let script = r#"
import signal, subprocess, sys, time
out, ready, guard = sys.argv[1], sys.argv[2], sys.argv[3]
until = [None]
def term(*_):
    until[0] = time.monotonic() + 1.0
signal.signal(signal.SIGTERM, term)
with open(out, "a", buffering=1) as f:
    while until[0] is None or time.monotonic() < until[0]:
        rc = subprocess.call([guard, "held"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The stop signal goes to the app's whole group: a question it cut short has no answer.
        if rc >= 0:
            f.write(f"{time.monotonic()} {rc}\n")
        open(ready, "w").close()
        time.sleep(0.02)
"#;
    vec![
        "python3".into(),
        "-c".into(),
        script.into(),
        out.display().to_string(),
        ready.display().to_string(),
        GUARD.into(),
    ]
}

#[test]
fn held_answers_inside_the_app_in_text_and_json_and_refuses_more_validity_than_a_lease_gives() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let out = lab.path("answers");
    let script = format!(
        "{g} held > {o}.text; echo \"text $?\" >> {o}; \
         {g} held --format json > {o}.json; echo \"json $?\" >> {o}; \
         {g} held --min-validity 100ms; echo \"min100ms $?\" >> {o}; \
         {g} held --min-validity 3s 2> {o}.err; echo \"min3s $?\" >> {o}",
        g = GUARD,
        o = out.display()
    );
    let (code, log) = lab.run(
        &lock_args(&url, "asks", REDIS_LEASE),
        &["sh", "-c", &script],
        Duration::from_secs(20),
    );
    assert_eq!(code, 0, "{log}");
    let codes = fs::read_to_string(&out).unwrap();
    // The 3s lease, less the 1s grace period, never promises 3s.
    assert_eq!(codes, "text 0\njson 0\nmin100ms 0\nmin3s 75\n", "{log}");
    let text = fs::read_to_string(lab.path("answers.text")).unwrap();
    assert!(
        text.contains("held=true") && text.contains("name=asks") && text.contains("backend=redis"),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(lab.path("answers.json")).unwrap()).unwrap();
    assert_eq!(json["held"], true, "{json}");
    assert_eq!(json["name"], "asks", "{json}");
    let token = json["fencing_token"]
        .as_str()
        .expect("a Redis lock has a token");
    assert!(token.parse::<u64>().is_ok(), "{json}");
    let valid = json["valid_for_ms"].as_u64().expect("a lease has a bound");
    assert!(
        valid > 0 && valid < 2000,
        "a 3s lease less 1s grace: {json}"
    );
    let err = fs::read_to_string(lab.path("answers.err")).unwrap();
    assert!(err.contains("less than --min-validity 3s"), "{err}");
}

#[test]
fn held_turns_not_held_within_a_check_of_a_kill_and_never_back() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let (out, ready) = (lab.path("answers"), lab.path("ready"));
    let mut guard = lab.spawn(
        &lock_args(&url, "asks", &[]),
        &as_strs(&asking_app(&out, &ready)),
    );
    assert!(
        wait_until(Duration::from_secs(20), || ready.exists()),
        "{}",
        guard.log_text()
    );
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = monotonic();
    db.sql(&format!(
        "KILL {}",
        db.holder_of("asks").expect("the guard holds the lock")
    ));
    assert_eq!(
        guard.code(Duration::from_secs(20)),
        75,
        "{}",
        guard.log_text()
    );
    let answers: Vec<(f64, i32)> = fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|line| {
            let (at, code) = line.split_once(' ').unwrap();
            (at.parse().unwrap(), code.parse().unwrap())
        })
        .collect();
    assert!(
        answers
            .iter()
            .any(|(at, code)| *at < killed_at && *code == 0),
        "held before the KILL: {answers:?}"
    );
    let first_no = answers
        .iter()
        .position(|(_, code)| *code != 0)
        .unwrap_or_else(|| panic!("never not held: {answers:?}"));
    // The check interval is 200ms; a question takes a few milliseconds.
    assert!(
        answers[first_no].0 - killed_at < 0.2 + 0.3,
        "not held only {:.3}s after the KILL: {answers:?}",
        answers[first_no].0 - killed_at
    );
    assert!(
        answers[first_no..].iter().all(|(_, code)| *code == 75),
        "once not held, never held again: {answers:?}"
    );
    assert!(
        answers.len() - first_no >= 5,
        "the app kept asking during its stop: {answers:?}"
    );
}

#[test]
fn held_outside_a_guard_exits_2_saying_why() {
    let lab = Lab::new();
    for socket in [None, Some(lab.path("nothing-here.sock"))] {
        let mut cmd = lab.command(&["held"], &[]);
        match &socket {
            None => cmd.env_remove("SENTINEL_GUARD_SOCKET"),
            Some(path) => cmd.env("SENTINEL_GUARD_SOCKET", path),
        };
        let out = cmd.stderr(std::process::Stdio::piped()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{socket:?}: {err}");
        let expected = match socket {
            None => "not run under a guard: SENTINEL_GUARD_SOCKET is not set",
            Some(_) => "no guard answers at",
        };
        assert!(err.contains(expected), "{err}");
    }
}

#[test]
fn the_readme_python_snippet_asks_the_guard() {
    let readme = fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let start = readme
        .find("```python\n")
        .expect("README shows the protocol in Python");
    let snippet = &readme[start + "```python\n".len()..];
    let snippet = &snippet[..snippet.find("```").unwrap()];
    assert!(snippet.contains("SENTINEL_GUARD_SOCKET"), "{snippet}");
    let mut lab = Lab::new();
    let module = lab.path("guard_lock.py");
    fs::write(&module, snippet).unwrap();
    let out = lab.path("out");
    let app = format!(
        "import sys; sys.path.insert(0, {dir:?}); from guard_lock import lock_held; \
         open({out:?}, 'w').write(f'{{lock_held()}} {{lock_held(min_validity_ms=86_400_000)}}')",
        dir = lab.dir.path().display().to_string(),
        out = out.display().to_string()
    );
    let redis = Redis::start();
    let url = redis.url();
    let (code, log) = lab.run(
        &lock_args(&url, "snippet", REDIS_LEASE),
        &["python3", "-c", &app],
        Duration::from_secs(20),
    );
    assert_eq!(code, 0, "{log}");
    assert_eq!(fs::read_to_string(&out).unwrap(), "True False", "{log}");
}

#[test]
fn a_flood_of_connections_to_the_socket_delays_no_renewal() {
    let redis = Redis::start();
    let mut lab = Lab::new();
    let url = redis.url();
    let out = lab.path("lowest");
    // 2,000 connections held open, then connections as fast as the app can make them for 3s (ten
    // lease renewals), while the lowest promise the guard gives is recorded.
    let script = r#"
import json, os, resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
path = os.environ["SENTINEL_GUARD_SOCKET"]
def ask():
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return s
held_open = [ask() for _ in range(2000)]
lowest, asked, end = None, 0, time.monotonic() + 3.0
while time.monotonic() < end:
    s = ask()
    asked += 1
    if asked % 50 == 0:
        answer = json.loads(s.makefile().readline())
        assert answer["held"], answer
        v = answer["valid_for_ms"]
        lowest = v if lowest is None else min(lowest, v)
    s.close()
open(sys.argv[1], "w").write(f"{lowest} {asked}")
"#;
    let (code, log) = lab.run(
        &lock_args(&url, "flood", REDIS_LEASE),
        &["python3", "-c", script, &out.display().to_string()],
        Duration::from_secs(30),
    );
    assert_eq!(code, 0, "{log}");
    let result = fs::read_to_string(&out).unwrap();
    let (lowest, asked) = result.split_once(' ').unwrap();
    let (lowest, asked): (u64, u64) = (lowest.parse().unwrap(), asked.parse().unwrap());
    assert!(asked >= 2000, "{result}");
    // Renewed every 500ms, a 3s lease less the 1s grace period promises between about 1.35s and
    // 1.85s (measured); a renewal held up by 350ms or more would show below 1s.
    assert!(lowest >= 1000, "the promise fell to {lowest}ms: {log}");
    assert!(!log.contains("lock_lost"), "{log}");
}

#[test]
fn an_unhealthy_app_steps_down_exits_76_and_the_standby_takes_over_after_it_ended() {
    let db = MariaDb::start();
    // Default takeover: a clean hand-over starts the standby's app at once.
    let mut lab = Lab::with_default_takeover();
    let url = db.url();
    let healthy = lab.path("healthy");
    fs::write(&healthy, "").unwrap();
    let health_cmd = format!("test -e {}", healthy.display());
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let mut leader_args = lock_args(&url, "steps", &[]);
    leader_args.extend([
        "--health-cmd",
        &health_cmd,
        "--health-interval",
        "200ms",
        "--health-retries",
        "2",
    ]);
    let mut leader = lab.spawn(&leader_args, &as_strs(&recording_app(&trace, &lead_pid)));
    read_pid(&lead_pid, Duration::from_secs(20));
    let standby_args = lock_args(&url, "steps", &[]);
    let mut standby = waiting_standby(
        &mut lab,
        &standby_args,
        &as_strs(&recording_app(&trace, &standby_pid)),
    );
    assert!(
        wait_until(Duration::from_secs(10), || leader
            .log_text()
            .contains("state=\"healthy\"")),
        "{}",
        leader.log_text()
    );
    fs::remove_file(&healthy).unwrap();
    assert_eq!(
        leader.code(Duration::from_secs(20)),
        76,
        "{}",
        leader.log_text()
    );
    let log = leader.log_text();
    assert!(
        log.contains("state=\"failing\"") && log.contains("state=\"unhealthy\""),
        "{log}"
    );
    read_pid(&standby_pid, Duration::from_secs(10));
    assert!(
        !standby.log_text().contains("takeover_delayed"),
        "a step-down is a clean hand-over: {}",
        standby.log_text()
    );
    standby.signal(15);
    assert_eq!(
        standby.code(Duration::from_secs(20)),
        0,
        "{}",
        standby.log_text()
    );
    assert_eq!(assert_no_overlap(&trace), 2);
}

#[test]
fn a_hanging_health_check_fails_at_its_timeout_and_is_killed_with_what_it_started() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let marker = lab.path("check-started");
    // The inner shells name the marker, so `survivors` finds them; `; :` keeps them from exec'ing.
    let health_cmd = format!(
        "echo $$ >> {m}; sh -c 'sleep 300; :' {m} & sh -c 'sleep 300; :' {m}",
        m = marker.display()
    );
    let args = fast_with(&[
        "--health-cmd",
        &health_cmd,
        "--health-interval",
        "100ms",
        "--health-timeout",
        "300ms",
        "--health-retries",
        "2",
    ]);
    let mut all = vec!["--url", url.as_str(), "--name", "hangs"];
    all.extend(args);
    let started = std::time::Instant::now();
    let (code, log) = lab.run(&all, &["sleep", "300"], Duration::from_secs(30));
    assert_eq!(code, 76, "{log}");
    // Two checks of 300ms each, 100ms apart: well under the 300s the check would hang.
    assert!(started.elapsed() < Duration::from_secs(10), "{log}");
    assert!(log.contains("still running after 300ms; killed"), "{log}");
    let shells: Vec<i32> = fs::read_to_string(&marker)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(shells.len(), 2, "{log}");
    // Neither the checks' shells nor the sleeps they started outlive the guard.
    let left = common::survivors(lab.dir.path());
    assert!(left.is_empty(), "left behind: {left:?}");
    for shell in shells {
        assert!(!common::alive(shell), "check {shell} still alive");
    }
}

#[test]
fn a_stop_asked_for_during_a_check_is_never_turned_into_a_step_down() {
    let mut lab = Lab::new();
    let url = lab.file_url("stop.lock");
    let trace = lab.path("trace");
    let pidfile = lab.path("pid");
    // A check that is running when SIGTERM comes, and would fail: with --rejoin a step-down would
    // take the lock again and start a second app.
    let args = fast_with(&[
        "--wait",
        "--rejoin",
        "--health-cmd",
        "sleep 1; false",
        "--health-interval",
        "100ms",
        "--health-retries",
        "1",
    ]);
    let mut all = vec!["--url", url.as_str(), "--name", "stop"];
    all.extend(args);
    // It takes 1.5s to stop, long enough for the check to fail meanwhile.
    let app = format!(
        "trap 'sleep 1.5; echo stop $$ >> {t}; exit 0' TERM; echo start $$ >> {t}; \
         echo $$ > {p}; while :; do sleep 0.05; done",
        t = trace.display(),
        p = pidfile.display()
    );
    let mut guard = lab.spawn(&all, &["sh", "-c", &app]);
    read_pid(&pidfile, Duration::from_secs(10));
    // The first check has started (100ms after the app) and runs for a second.
    std::thread::sleep(Duration::from_millis(400));
    guard.signal(15);
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        0,
        "{}",
        guard.log_text()
    );
    let log = guard.log_text();
    assert_eq!(log.matches("event=\"app_started\"").count(), 1, "{log}");
    assert!(
        !log.contains("unhealthy") && !log.contains("rejoining"),
        "{log}"
    );
    assert_eq!(assert_no_overlap(&trace), 1);
}

#[test]
fn the_health_settings_and_an_inherited_socket_stay_out_of_the_app_and_no_socket_is_no_failure() {
    let mut lab = Lab::new();
    // Outside /tmp, which the guard will find read-only (and the build tree may be under /tmp).
    let outside = tempfile::tempdir_in("/dev/shm").unwrap();
    let url = format!("file://{}/env.lock", outside.path().display());
    let out = outside.path().join("env");
    let script = format!(
        "env | grep -E '^SENTINEL_GUARD_(HEALTH|SOCKET)' > {o}; {g} held; echo \"held $?\" >> {o}",
        o = out.display(),
        g = GUARD
    );
    // /tmp read-only, and neither XDG_RUNTIME_DIR nor TMPDIR usable: the guard has nowhere for its
    // socket, says so, and runs the app without one (and without the socket it inherited).
    // /tmp stays visible (the guard binary itself may live under it), but read-only.
    let inner = "mount --bind /tmp /tmp && mount -o remount,bind,ro /tmp && exec \"$0\" \"$@\"";
    let mut cmd = lab.command(&["--url", &url, "--name", "env"], &["sh", "-c", &script]);
    cmd.env("SENTINEL_GUARD_HEALTH_CMD", "true")
        .env("SENTINEL_GUARD_HEALTH_INTERVAL", "1h")
        .env("SENTINEL_GUARD_SOCKET", "/run/some-other-guard/held.sock")
        .env("XDG_RUNTIME_DIR", "relative/dir")
        .env("TMPDIR", "/nonexistent");
    let cmd = common::launched_by(&cmd, "unshare", &["--mount", "sh", "-c", inner]);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(20)),
        0,
        "{}",
        guard.log_text()
    );
    let log = guard.log_text();
    assert!(log.contains("event=\"held_socket_unavailable\""), "{log}");
    assert!(
        log.contains("relative/dir: not an absolute directory"),
        "{log}"
    );
    assert_eq!(fs::read_to_string(&out).unwrap(), "held 2\n", "{log}");
}
