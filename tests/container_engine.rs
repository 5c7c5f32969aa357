//! The container story run in a real engine, not simulated with PID namespaces: an image made
//! offline (`docker import` of the guard, its libraries and busybox; there is no registry here),
//! `docker compose up --scale app=3`, and what `docker stop`, `docker kill`, `docker pause` and a
//! terminal's Ctrl-C do to the guard as PID 1, against a private MariaDB and Redis on loopback (the
//! containers use host networking to reach them) and the file backend on a shared bind mount.
//!
//! It runs when a Docker daemon answers and is skipped (with a line saying so) otherwise; with
//! `SENTINEL_REQUIRE_ENGINE=1` (set by `.ci/run`) a missing engine fails the suite instead, so CI
//! cannot go green without it. Every container, network and volume it makes carries a label unique
//! to the run and is removed when the test ends, passed or failed.

mod common;

use std::fmt::Write as _;
use std::fs;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;

/// Marks everything this suite makes, with a value unique to one test's run.
const LABEL: &str = "io.sentinel-guard.test";
/// The pid of the test process that made a container, so a later run can remove what a run that
/// was killed outright (no unwinding, no Drop) left behind.
const OWNER_LABEL: &str = "io.sentinel-guard.test.owner";
const IMAGE_REPO: &str = "sentinel-guard-test";
const APP_EXIT_ON_TERM: i32 = 42;
const APP_EXIT_ON_INT: i32 = 7;
/// How long after `docker unpause` the frozen leader's app may still leave a trace: the bound the
/// freeze-proof work sets (tests/freeze.rs), time to see the passed deadline and SIGKILL, no grace.
const AFTER_THAW: Duration = Duration::from_millis(50);

/// One scenario at a time: the timing bounds are tight on a 2-core machine, and containers of
/// several scenarios starting at once would only add scheduling noise.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The app every container runs: it records its start, a heartbeat about every 10ms, and SIGTERM or
/// SIGINT (then exits with a code of its own) in the trace file named by `$1`, each line
/// `<what> <holder id> <ns since the epoch>`. The holder id tells the apps apart (host networking
/// gives every container the host's name), and coreutils' `date` gives nanoseconds (busybox's has
/// none).
fn app_script() -> String {
    format!(
        r#"t=$1
id=$SENTINEL_GUARD_HOLDER_ID
now() {{ /usr/bin/date +%s%N; }}
trap 'echo "stop $id $(now)" >> "$t"; exit {APP_EXIT_ON_TERM}' TERM
trap 'echo "int $id $(now)" >> "$t"; exit {APP_EXIT_ON_INT}' INT
echo "start $id $(now)" >> "$t"
while :; do
    echo "beat $id $(now)" >> "$t"
    sleep 0.01
done
"#
    )
}

#[test]
fn mysql_in_a_real_engine() {
    let Some(engine) = engine() else { return };
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let db = mariadb::MariaDb::start();
    let url = db.url();
    // wait_timeout = 200ms + 800ms + grace 1s + 5s margin = 7s: the server frees a frozen guard's lock
    // then, so a pause must outlast it.
    let timings = [
        ("SENTINEL_GUARD_CHECK_INTERVAL", "200ms"),
        ("SENTINEL_GUARD_CHECK_TIMEOUT", "800ms"),
        ("SENTINEL_GUARD_GRACE_PERIOD", "1s"),
        ("SENTINEL_GUARD_CONNECT_TIMEOUT", "3s"),
    ];
    let mut scene = Scene::new(engine, "mysql", &url, &url, &timings);
    scene.scale_then_stop();
    // `docker kill` ends the watchdog with the guard, so nothing marks the tree gone: the standby
    // waits the bound the leader recorded (2s lock wait + check-interval + 2 x check-timeout +
    // grace = 4.8s).
    scene.standby_kill_then_pause(Duration::from_secs(6), Some(Duration::from_secs(30)));
    scene.ctrl_c_in_a_terminal();
    scene.finish();
}

#[test]
fn redis_in_a_real_engine() {
    let Some(engine) = engine() else { return };
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let redis = redis::Redis::start();
    let url = redis.url();
    // A short lease that keeps the start-up rule: ttl 3s - margin 130ms - grace 1s = 1.87s >=
    // renew 500ms + check-timeout 500ms.
    let timings = [
        ("SENTINEL_GUARD_TTL", "3s"),
        ("SENTINEL_GUARD_RENEW_INTERVAL", "500ms"),
        ("SENTINEL_GUARD_CHECK_TIMEOUT", "500ms"),
        ("SENTINEL_GUARD_GRACE_PERIOD", "1s"),
        ("SENTINEL_GUARD_CONNECT_TIMEOUT", "3s"),
    ];
    let mut scene = Scene::new(engine, "redis", &url, &url, &timings);
    scene.scale_then_stop();
    // A SIGKILLed leader's lease runs out within the ttl of its last renewal; the standby re-checks
    // at the lease's expiry with up to 50ms of jitter, then waits the bound the leader recorded
    // (ttl + grace = 4s: a lease that ran out may belong to a frozen tree), and its app needs a
    // moment to start.
    scene.standby_kill_then_pause(
        Duration::from_millis(3000 + 4000 + 250),
        Some(Duration::from_secs(15)),
    );
    scene.ctrl_c_in_a_terminal();
    scene.finish();
}

#[test]
fn file_backend_in_a_real_engine() {
    let Some(engine) = engine() else { return };
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let shared = tempfile::tempdir().unwrap();
    // The containers see the shared directory at /shared; the host's `status` sees it where it is.
    let host_url = format!("file://{}/backend.lock", shared.path().display());
    let timings = [
        ("SENTINEL_GUARD_CHECK_INTERVAL", "200ms"),
        ("SENTINEL_GUARD_GRACE_PERIOD", "1s"),
    ];
    let mut scene = Scene::with_shared(
        engine,
        "file",
        shared,
        "file:///shared/backend.lock",
        &host_url,
        &timings,
    );
    scene.scale_then_stop();
    // A frozen guard keeps its flock (nothing expires), so the pause check is that no one takes it.
    scene.standby_kill_then_pause(Duration::from_secs(1), None);
    scene.ctrl_c_in_a_terminal();
    scene.finish();
}

#[test]
fn unguarded_replicas_all_run_and_each_warns() {
    let Some(engine) = engine() else { return };
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The lock URL stays configured, as in the demo's compose file: the switch alone turns it off.
    let mut scene = Scene::new(
        engine,
        "unguarded",
        "file:///shared/backend.lock",
        "file:///nonexistent/backend.lock",
        &[],
    );
    let project = scene.compose_up("unguarded", &[("SINGLE_INSTANCE_GUARD", "false")], 3);
    let trace = scene.trace("unguarded");
    let all_run = wait_until(Duration::from_secs(30), || {
        holders_started(&trace).len() == 3
    });
    let states = scene.states(&project);
    assert!(
        all_run && states.iter().all(|s| s.status == "running"),
        "not all three unguarded apps run: {states:?}; trace starts {:?}\n{}",
        holders_started(&trace),
        scene.logs_of(&project)
    );
    for state in &states {
        let log = container_log(&state.id);
        assert!(
            log.contains("event=\"unguarded\"") && log.contains("WITHOUT ANY LOCK"),
            "{} logged no warning:\n{log}",
            state.id
        );
    }
    scene.compose_down(&project);
    scene.finish();
}

/// One backend's scenes: the shared directory, how containers and the host reach the lock, the
/// guard's timings, and the sweep that removes whatever the scenes made.
struct Scene {
    /// First, so it is dropped first: containers go before the directory they have mounted.
    sweep: Sweep,
    engine: &'static Engine,
    backend: &'static str,
    shared: TempDir,
    host_url: String,
    timings: Vec<(String, String)>,
}

impl Scene {
    fn new(
        engine: &'static Engine,
        backend: &'static str,
        container_url: &str,
        host_url: &str,
        timings: &[(&str, &str)],
    ) -> Scene {
        let shared = tempfile::tempdir().unwrap();
        Scene::with_shared(engine, backend, shared, container_url, host_url, timings)
    }

    fn with_shared(
        engine: &'static Engine,
        backend: &'static str,
        shared: TempDir,
        container_url: &str,
        host_url: &str,
        timings: &[(&str, &str)],
    ) -> Scene {
        // The URL reaches the guard through a file, as the demo's secret does.
        fs::write(shared.path().join("lock_url"), container_url).unwrap();
        fs::write(shared.path().join("app.sh"), app_script()).unwrap();
        Scene {
            sweep: Sweep::new(backend),
            engine,
            backend,
            shared,
            host_url: host_url.to_owned(),
            timings: timings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn trace(&self, phase: &str) -> PathBuf {
        self.shared.path().join(format!("{phase}.trace"))
    }

    /// The guard's environment in every container of `phase`: lock name, URL file and timings,
    /// then `extra`.
    fn env(&self, phase: &str, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut env = vec![
            ("SENTINEL_GUARD_NAME".to_owned(), phase.to_owned()),
            (
                "SENTINEL_GUARD_URL_FILE".to_owned(),
                "/shared/lock_url".to_owned(),
            ),
        ];
        env.extend(self.timings.iter().cloned());
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    }

    /// Writes a compose file for `phase` (a test variant of packaging/compose's `app` service, on the
    /// imported image with host networking) and runs `up -d --scale app=<scale>`.
    fn compose_up(&mut self, phase: &str, extra: &[(&str, &str)], scale: usize) -> Project {
        let name = format!("{}{phase}", self.sweep.compact);
        let file = self.shared.path().join(format!("{phase}.compose.yml"));
        let mut yaml = String::new();
        writeln!(yaml, "services:").unwrap();
        writeln!(yaml, "  app:").unwrap();
        writeln!(yaml, "    image: \"{}\"", self.engine.image).unwrap();
        writeln!(yaml, "    network_mode: host").unwrap();
        writeln!(yaml, "    labels:").unwrap();
        writeln!(yaml, "      {LABEL}: \"{}\"", self.sweep.run).unwrap();
        writeln!(yaml, "      {OWNER_LABEL}: \"{}\"", std::process::id()).unwrap();
        writeln!(yaml, "    environment:").unwrap();
        for (key, value) in self.env(phase, extra) {
            writeln!(yaml, "      {key}: \"{value}\"").unwrap();
        }
        writeln!(yaml, "    volumes:").unwrap();
        writeln!(yaml, "      - \"{}:/shared\"", self.shared.path().display()).unwrap();
        writeln!(
            yaml,
            "    command: [\"sh\", \"/shared/app.sh\", \"/shared/{phase}.trace\"]"
        )
        .unwrap();
        // docker stop's SIGTERM goes to the guard; leave it time to stop the app and release.
        writeln!(yaml, "    stop_grace_period: 10s").unwrap();
        fs::write(&file, yaml).unwrap();
        let project = Project { name, file };
        self.sweep.projects.push(project.clone());
        let out = run(
            self.engine
                .compose(&project)
                .args(["up", "-d", "--scale", &format!("app={scale}")]),
            Duration::from_secs(120),
        );
        assert!(out.ok(), "compose up failed: {}", out.stderr);
        project
    }

    fn compose_down(&self, project: &Project) {
        let out = run(
            self.engine
                .compose(project)
                .args(["down", "-v", "--remove-orphans", "-t", "10"]),
            Duration::from_secs(120),
        );
        assert!(out.ok(), "compose down failed: {}", out.stderr);
    }

    /// Every container of the project, with its state.
    fn states(&self, project: &Project) -> Vec<State> {
        let filter = format!("label=com.docker.compose.project={}", project.name);
        let ids = docker_ok(&["ps", "-aq", "--no-trunc", "--filter", &filter]);
        ids.split_whitespace().map(state).collect()
    }

    fn logs_of(&self, project: &Project) -> String {
        self.states(project)
            .iter()
            .map(|s| format!("--- {} ({:?}):\n{}", s.id, s, container_log(&s.id)))
            .collect()
    }

    /// The container whose guard has `holder` as its holder id: every log line carries it in the
    /// `guard{name=.. backend=".." holder_id=..}` span, while a standby names the leader it waits for
    /// as `holder=holder_id=..`, hence the quote.
    fn container_of(&self, project: &Project, holder: &str) -> String {
        let needle = format!("\" holder_id={holder}");
        let found: Vec<String> = self
            .states(project)
            .into_iter()
            .filter(|s| container_log(&s.id).contains(&needle))
            .map(|s| s.id)
            .collect();
        assert_eq!(found.len(), 1, "containers of holder {holder}: {found:?}");
        found.into_iter().next().unwrap()
    }

    /// `sentinel-guard status` on the host: exit 0 held, 3 free.
    fn lock_status(&self, name: &str) -> (i32, String) {
        let out = run(
            Command::new(GUARD).args([
                "status",
                "--url",
                &self.host_url,
                "--name",
                name,
                "--connect-timeout",
                "2s",
            ]),
            Duration::from_secs(10),
        );
        (out.status.code().unwrap_or(-1), out.stdout)
    }

    /// `--scale app=3`: one app runs and the two other containers exit 1 within 5s, showing
    /// `Exited (1)`; then `docker stop` of the leader: the app gets SIGTERM, the container exits with
    /// the app's status, and the lock is free within 1s.
    fn scale_then_stop(&mut self) {
        let b = self.backend;
        let project = self.compose_up("scale", &[], 3);
        let trace = self.trace("scale");
        let mut states = Vec::new();
        let decided = wait_until(Duration::from_secs(30), || {
            states = self.states(&project);
            states.len() == 3
                && states.iter().filter(|s| s.status == "exited").count() == 2
                && !holders_started(&trace).is_empty()
        });
        assert!(
            decided,
            "{b}: scale=3 did not settle to one app and two refusals: {states:?}\n{}",
            self.logs_of(&project)
        );
        let started = holders_started(&trace);
        assert_eq!(started.len(), 1, "{b}: apps started: {started:?}");
        let running: Vec<&State> = states.iter().filter(|s| s.status == "running").collect();
        assert_eq!(running.len(), 1, "{b}: {states:?}");
        for refused in states.iter().filter(|s| s.status == "exited") {
            assert_eq!(refused.exit_code, 1, "{b}: {refused:?}");
            let ran = refused.ran_for().expect("docker's timestamps parse");
            assert!(ran < Duration::from_secs(5), "{b}: {refused:?} ran {ran:?}");
            let log = container_log(&refused.id);
            assert!(
                log.contains("lock is held by another instance"),
                "{b}: refused container's log:\n{log}"
            );
        }
        // What an operator sees: `docker ps -a` (and `docker compose ps`) say `Exited (1)`.
        let filter = format!("label=com.docker.compose.project={}", project.name);
        let shown = docker_ok(&["ps", "-a", "--filter", &filter, "--format", "{{.Status}}"]);
        assert_eq!(
            shown
                .lines()
                .filter(|l| l.starts_with("Exited (1)"))
                .count(),
            2,
            "{b}: docker ps -a shows:\n{shown}"
        );
        let leader = &running[0].id;
        assert_eq!(
            self.lock_status("scale").0,
            0,
            "{b}: the lock is not held while the leader runs"
        );

        let stop_called = Instant::now();
        docker_ok(&["stop", "-t", "10", leader]);
        let stop_took = stop_called.elapsed();
        let mut status = (0, String::new());
        let freed = wait_until(Duration::from_secs(5), || {
            status = self.lock_status("scale");
            status.0 == 3
        });
        let free_after = stop_called.elapsed();
        eprintln!(
            "container_engine: {b}: docker stop of the leader returned in {stop_took:?}, lock free {free_after:?} after it was called"
        );
        assert!(
            freed && free_after <= Duration::from_secs(1),
            "{b}: lock not free within 1s of docker stop (after {free_after:?}): {status:?}\n{}",
            container_log(leader)
        );
        let stopped = state(leader);
        assert_eq!(
            (stopped.status.as_str(), stopped.exit_code),
            ("exited", APP_EXIT_ON_TERM),
            "{b}: the container exits with the app's status:\n{}",
            container_log(leader)
        );
        let lines = read_trace(&trace);
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.what == "stop" && l.holder == started[0])
                .count(),
            1,
            "{b}: the app got SIGTERM: {:?}",
            lines.iter().rev().take(5).collect::<Vec<_>>()
        );
        self.compose_down(&project);
    }

    /// Standbys (`SENTINEL_GUARD_WAIT=forever`): `docker kill` of the leader lets a standby's app
    /// start within `takeover_bound`, never while the killed leader's app still runs. Then `docker
    /// pause` of the new leader: with `lock_life` (MySQL, Redis), past the lock's life until the last
    /// standby's app runs, and after `docker unpause` the paused app is dead within `AFTER_THAW`;
    /// without (file: a frozen guard keeps its flock), no one takes the lock while it is paused.
    fn standby_kill_then_pause(&mut self, takeover_bound: Duration, lock_life: Option<Duration>) {
        let b = self.backend;
        let project = self.compose_up("standby", &[("SENTINEL_GUARD_WAIT", "forever")], 3);
        let trace = self.trace("standby");
        let settled = wait_until(Duration::from_secs(30), || {
            holders_started(&trace).len() == 1
                && self
                    .states(&project)
                    .iter()
                    .filter(|s| container_log(&s.id).contains("event=\"lock_waiting\""))
                    .count()
                    == 2
        });
        assert!(
            settled,
            "{b}: not one app and two waiting standbys:\n{}",
            self.logs_of(&project)
        );
        let first = holders_started(&trace).remove(0);
        let first_container = self.container_of(&project, &first);

        let kill_at = SystemTime::now();
        let kill_called = Instant::now();
        docker_ok(&["kill", &first_container]);
        let took_over = wait_until(takeover_bound + Duration::from_secs(10), || {
            holders_started(&trace).len() == 2
        });
        let seen_after = kill_called.elapsed();
        assert!(
            took_over,
            "{b}: no standby took over after docker kill:\n{}",
            self.logs_of(&project)
        );
        let second = holders_started(&trace).remove(1);
        let lines = read_trace(&trace);
        let second_start = start_of(&lines, &second);
        let takeover_ns = lines[second_start].ns.expect("the start line has a time") as i128
            - epoch_ns(kill_at) as i128;
        let takeover = Duration::from_nanos(takeover_ns.max(0) as u64);
        eprintln!(
            "container_engine: {b}: docker kill of the leader -> standby's app started: {:.1}ms (seen by the test after {seen_after:?})",
            takeover_ns as f64 / 1e6
        );
        assert!(
            takeover <= takeover_bound,
            "{b}: takeover took {takeover:?}, more than {takeover_bound:?}"
        );
        assert_no_overlap_after(&lines, &first, second_start, Duration::ZERO, b);
        let killed = state(&first_container);
        assert_eq!(
            (killed.status.as_str(), killed.exit_code),
            ("exited", 137),
            "{b}: {killed:?}"
        );

        let second_container = self.container_of(&project, &second);
        let freezer = freezer_state_file(&second_container);
        docker_ok(&["pause", &second_container]);
        let paused_at = Instant::now();
        match lock_life {
            Some(lock_life) => {
                // The lock outlives the frozen guard only until the backend frees it; the last
                // standby's app starting is the proof it did.
                let third_started = wait_until(lock_life, || holders_started(&trace).len() == 3);
                assert!(
                    third_started,
                    "{b}: no standby took over within {lock_life:?} of docker pause:\n{}",
                    self.logs_of(&project)
                );
                eprintln!(
                    "container_engine: {b}: standby took over {:?} into the pause",
                    paused_at.elapsed()
                );
                let app = app_pids(&second_container);
                assert!(!app.is_empty(), "{b}: the paused app's processes not found");
                let unpaused = unpause(&second_container, freezer.as_deref(), &app);
                let thawed_at = unpaused.thawed;
                let app_dead_at = unpaused
                    .app_dead
                    .expect("the unpaused leader's app never died");
                let dead_after = app_dead_at.duration_since(thawed_at).unwrap_or_default();
                eprintln!(
                    "container_engine: {b}: the unpaused leader's app was dead {dead_after:?} after the thaw"
                );
                assert!(
                    dead_after <= AFTER_THAW,
                    "{b}: the unpaused leader's app lived {dead_after:?} past the thaw while the standby held the lock"
                );
                let exited = wait_until(Duration::from_secs(10), || {
                    state(&second_container).status == "exited"
                });
                let log = container_log(&second_container);
                assert!(exited, "{b}: the unpaused leader lives on:\n{log}");
                assert_eq!(
                    state(&second_container).exit_code,
                    75,
                    "{b}: the unpaused leader reports the lost lock:\n{log}"
                );
                if let Some(finished) = rfc3339_ns(&state(&second_container).finished) {
                    eprintln!(
                        "container_engine: {b}: the unpaused leader's container exited {:.1}ms after the thaw",
                        (finished - epoch_ns(thawed_at) as i128) as f64 / 1e6
                    );
                }
                assert!(
                    log.contains("reason=\"deadline_passed\"")
                        || log.contains("reason=\"guard_frozen\"")
                        || log.contains("reason=deadline_passed")
                        || log.contains("reason=guard_frozen"),
                    "{b}: lost for another reason:\n{log}"
                );
                let lines = read_trace(&trace);
                let third = holders_started(&trace).remove(2);
                let third_start = start_of(&lines, &third);
                let last = lines
                    .iter()
                    .filter(|l| l.holder == second)
                    .filter_map(|l| l.ns)
                    .max()
                    .expect("the second app left a trace");
                let late_ms = (last as i128 - epoch_ns(thawed_at) as i128) as f64 / 1e6;
                eprintln!(
                    "container_engine: {b}: the unpaused leader's app left its last trace {late_ms:.1}ms after the thaw"
                );
                // Lines the app wrote before the freeze may land after the new start in the file
                // (a write cut off by the freeze), but none may be stamped after the bound.
                assert_no_overlap_after(
                    &lines,
                    &second,
                    third_start,
                    AFTER_THAW + ns_between(&lines[third_start], thawed_at),
                    b,
                );
                assert!(
                    last <= epoch_ns(thawed_at) + AFTER_THAW.as_nanos(),
                    "{b}: the old app ran {late_ms:.1}ms past docker unpause while the standby held the lock"
                );
            }
            None => {
                // Frozen is not dead: the flock stays with the paused guard, and no standby starts.
                let (code, status) = self.lock_status("standby");
                assert!(
                    code == 0 && status.contains(&format!("holder_id={second}")),
                    "{b}: the paused leader's lock: {status}"
                );
                let thawed_at = unpause(&second_container, freezer.as_deref(), &[]).thawed;
                let beats_again = wait_until(Duration::from_secs(10), || {
                    read_trace(&trace).iter().any(|l| {
                        l.holder == second && l.ns.is_some_and(|ns| ns > epoch_ns(thawed_at))
                    })
                });
                assert!(beats_again, "{b}: the unpaused app does not run on");
                assert_eq!(
                    holders_started(&trace).len(),
                    2,
                    "{b}: a standby started while the leader was paused"
                );
                assert_eq!(state(&second_container).status, "running");
            }
        }
        self.compose_down(&project);
    }

    /// `docker run -it`: Ctrl-C typed at the terminal reaches the app (it is the terminal's
    /// foreground process group), which records it and exits with its own code.
    fn ctrl_c_in_a_terminal(&mut self) {
        let b = self.backend;
        let trace = self.trace("tty");
        let mut args: Vec<String> = [
            "run",
            "-it",
            "--network",
            "host",
            "--label",
            &format!("{LABEL}={}", self.sweep.run),
            "--label",
            &format!("{OWNER_LABEL}={}", std::process::id()),
            "-v",
            &format!("{}:/shared", self.shared.path().display()),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (key, value) in self.env("tty", &[]) {
            args.push("-e".to_owned());
            args.push(format!("{key}={value}"));
        }
        args.extend(
            [
                self.engine.image.as_str(),
                "sh",
                "/shared/app.sh",
                "/shared/tty.trace",
            ]
            .map(str::to_owned),
        );
        let mut terminal = Terminal::spawn(&args);
        let started = wait_until(Duration::from_secs(30), || {
            holders_started(&trace).len() == 1
        });
        assert!(
            started,
            "{b}: the app under docker run -it never started:\n{}",
            terminal.output()
        );
        terminal.type_bytes(b"\x03");
        let status = terminal.wait(Duration::from_secs(15));
        let holder = holders_started(&trace).remove(0);
        let lines = read_trace(&trace);
        assert!(
            lines.iter().any(|l| l.what == "int" && l.holder == holder),
            "{b}: the app never got SIGINT; terminal:\n{}",
            terminal.output()
        );
        assert_eq!(
            status.code(),
            Some(APP_EXIT_ON_INT),
            "{b}: docker run -it exits with the app's status; terminal:\n{}",
            terminal.output()
        );
        eprintln!("container_engine: {b}: Ctrl-C under docker run -it reached the app, which exited {APP_EXIT_ON_INT}");
    }

    /// Removes everything the scenes made and checks that nothing is left.
    fn finish(mut self) {
        let left = self.sweep.clean();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

#[derive(Clone)]
struct Project {
    name: String,
    file: PathBuf,
}

struct Engine {
    /// `docker compose` (v2) or `docker-compose` (v1), whichever is installed.
    compose: Vec<String>,
    image: String,
}

impl Engine {
    fn compose(&self, project: &Project) -> Command {
        let mut cmd = Command::new(&self.compose[0]);
        cmd.args(&self.compose[1..])
            .arg("-p")
            .arg(&project.name)
            .arg("-f")
            .arg(&project.file);
        cmd
    }
}

/// The engine, once per test process; `None` (with a line saying why) when it cannot run here,
/// unless `SENTINEL_REQUIRE_ENGINE=1`, which turns that into a failure.
fn engine() -> Option<&'static Engine> {
    match engine_cell().get_or_init(prepare_engine) {
        Ok(engine) => Some(engine),
        Err(why) => {
            let required = std::env::var("SENTINEL_REQUIRE_ENGINE").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "SENTINEL_REQUIRE_ENGINE=1, but the container engine suite cannot run: {why}"
            );
            // Straight to stderr, not through eprintln!, which the test harness captures and hides
            // for a passing test: a skip must be seen. Once per run is enough.
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "container_engine: skipped: {why} (set SENTINEL_REQUIRE_ENGINE=1 to fail instead)"
                );
            });
            None
        }
    }
}

fn prepare_engine() -> Result<Engine, String> {
    let info = try_run(Command::new("docker").arg("info"), Duration::from_secs(30))?;
    if !info.ok() {
        return Err(format!(
            "no Docker daemon answers (`docker info`: {})",
            info.stderr.trim()
        ));
    }
    let answers = |program: &str, args: &[&str]| {
        try_run(Command::new(program).args(args), Duration::from_secs(30)).is_ok_and(|o| o.ok())
    };
    let compose = if answers("docker", &["compose", "version"]) {
        vec!["docker".to_owned(), "compose".to_owned()]
    } else if answers("docker-compose", &["version"]) {
        vec!["docker-compose".to_owned()]
    } else {
        return Err("neither `docker compose` nor `docker-compose` is installed".to_owned());
    };
    if !Path::new("/bin/busybox").exists() {
        return Err("/bin/busybox is missing (apt-get install busybox-static)".to_owned());
    }
    remove_orphans_of_dead_runs();
    let image = import_image()?;
    Ok(Engine { compose, image })
}

/// Imports the image with packaging/docker/import-image.sh (the offline route the compose README
/// documents), tagged by the guard binary's size and modification time so an unchanged build reuses it;
/// older tags of the test image are removed.
fn import_image() -> Result<String, String> {
    // The static release build when one is named (CI builds it: it is what the Dockerfile ships),
    // else this build's binary.
    let guard = std::env::var("SENTINEL_STATIC_GUARD").unwrap_or_else(|_| GUARD.to_owned());
    let meta = fs::metadata(&guard).map_err(|e| format!("{guard}: {e}"))?;
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default();
    let tag = format!(
        "{IMAGE_REPO}:{}-{}-{}",
        meta.len(),
        modified.as_secs(),
        modified.subsec_nanos()
    );
    let exists = try_run(
        Command::new("docker").args(["image", "inspect", &tag]),
        Duration::from_secs(30),
    )?;
    if !exists.ok() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/docker/import-image.sh");
        let out = try_run(
            Command::new("bash")
                .arg(script)
                .arg(&tag)
                .arg(&guard)
                .arg("/bin/date"),
            Duration::from_secs(120),
        )?;
        if !out.ok() {
            return Err(format!("import-image.sh failed: {}", out.stderr));
        }
    }
    let tags = try_run(
        Command::new("docker").args(["images", IMAGE_REPO, "--format", "{{.Repository}}:{{.Tag}}"]),
        Duration::from_secs(30),
    )?;
    for old in tags.stdout.lines().filter(|t| *t != tag) {
        // An image still used by a container (another run's) stays; that is fine.
        let _ = try_run(
            Command::new("docker").args(["rmi", old]),
            Duration::from_secs(30),
        );
    }
    Ok(tag)
}

/// Removes containers left by a test process that no longer exists (killed before it could clean
/// up); containers of live runs are theirs to remove.
fn remove_orphans_of_dead_runs() {
    let Ok(out) = try_run(
        Command::new("docker").args([
            "ps",
            "-a",
            "--filter",
            &format!("label={OWNER_LABEL}"),
            "--format",
            &format!("{{{{.ID}}}} {{{{.Label \"{OWNER_LABEL}\"}}}}"),
        ]),
        Duration::from_secs(30),
    ) else {
        return;
    };
    for line in out.stdout.lines() {
        let Some((id, owner)) = line.split_once(' ') else {
            continue;
        };
        if !Path::new(&format!("/proc/{owner}")).exists() {
            let _ = try_run(
                Command::new("docker").args(["rm", "-f", "-v", id]),
                Duration::from_secs(30),
            );
        }
    }
}

/// Removes every container, network and volume of one test's run, even when the test fails: its
/// compose projects are taken down, then whatever still carries the run's label or a project's
/// label is removed by force.
struct Sweep {
    run: String,
    /// The run id with letters and digits only, a prefix for compose project names.
    compact: String,
    projects: Vec<Project>,
}

impl Sweep {
    fn new(what: &str) -> Sweep {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let run = format!("{}-{n}-{what}", std::process::id());
        let compact = format!("sgtest{}x{n}", std::process::id());
        Sweep {
            run,
            compact,
            projects: Vec::new(),
        }
    }

    fn filters(&self) -> Vec<String> {
        let mut filters = vec![format!("label={LABEL}={}", self.run)];
        filters.extend(
            self.projects
                .iter()
                .map(|p| format!("label=com.docker.compose.project={}", p.name)),
        );
        filters
    }

    /// Removes what it can and returns what is still there.
    fn clean(&mut self) -> Vec<String> {
        let limit = Duration::from_secs(60);
        for project in &self.projects {
            // Never panic here: this also runs while a failed test unwinds.
            // Scenes exist only once engine() returned one, so it is ready whenever this runs.
            let Some(Ok(engine)) = engine_cell().get() else {
                break;
            };
            let mut cmd = engine.compose(project);
            let _ = try_run(
                cmd.args(["down", "-v", "--remove-orphans", "-t", "1"]),
                limit,
            );
        }
        let list = |kind: &[&str], filter: &str| -> Vec<String> {
            try_run(
                Command::new("docker")
                    .args(kind)
                    .args(["-q", "--filter", filter]),
                limit,
            )
            .map(|o| o.stdout.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default()
        };
        let kinds: [(&[&str], &[&str]); 3] = [
            (&["ps", "-a"], &["rm", "-f", "-v"]),
            (&["network", "ls"], &["network", "rm"]),
            (&["volume", "ls"], &["volume", "rm", "-f"]),
        ];
        let mut left = Vec::new();
        for filter in self.filters() {
            for (ls, rm) in kinds {
                let ids = list(ls, &filter);
                if !ids.is_empty() {
                    let _ = try_run(Command::new("docker").args(rm).args(&ids), limit);
                }
                left.extend(list(ls, &filter));
            }
        }
        left
    }
}

impl Drop for Sweep {
    fn drop(&mut self) {
        let left = self.clean();
        if !left.is_empty() {
            eprintln!("container_engine: could not remove {left:?}");
        }
    }
}

fn engine_cell() -> &'static OnceLock<Result<Engine, String>> {
    static CELL: OnceLock<Result<Engine, String>> = OnceLock::new();
    &CELL
}

#[derive(Debug)]
struct State {
    id: String,
    status: String,
    exit_code: i32,
    started: String,
    finished: String,
}

impl State {
    /// How long the container ran, from docker's own timestamps. A container that exits at once can
    /// be stamped finished before started (the daemon records the start after the process runs), so
    /// that counts as no time.
    fn ran_for(&self) -> Option<Duration> {
        let (start, end) = (rfc3339_ns(&self.started)?, rfc3339_ns(&self.finished)?);
        Some(Duration::from_nanos(
            u64::try_from((end - start).max(0)).ok()?,
        ))
    }
}

fn state(id: &str) -> State {
    let out = docker_ok(&[
        "inspect",
        "-f",
        "{{.State.Status}}|{{.State.ExitCode}}|{{.State.StartedAt}}|{{.State.FinishedAt}}",
        id,
    ]);
    let fields: Vec<&str> = out.trim().split('|').collect();
    assert_eq!(fields.len(), 4, "docker inspect said {out:?}");
    State {
        id: id.to_owned(),
        status: fields[0].to_owned(),
        exit_code: fields[1].parse().unwrap(),
        started: fields[2].to_owned(),
        finished: fields[3].to_owned(),
    }
}

fn container_log(id: &str) -> String {
    let out = run(
        Command::new("docker").args(["logs", id]),
        Duration::from_secs(30),
    );
    out.stdout + &out.stderr
}

/// Nanoseconds since the epoch of a UTC RFC 3339 time as docker prints it
/// (`2026-11-30T18:39:07.499258123Z`).
fn rfc3339_ns(text: &str) -> Option<i128> {
    let (date, time) = text.trim().strip_suffix('Z')?.split_once('T')?;
    let mut ymd = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut parts = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (h, min, s) = (parts.next()??, parts.next()??, parts.next()??);
    let nanos: i64 = format!("{fraction:0<9}").get(..9)?.parse().ok()?;
    // Days since the epoch of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    Some(((days * 86_400 + h * 3600 + min * 60 + s) as i128) * 1_000_000_000 + nanos as i128)
}

fn epoch_ns(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// One line of an app's trace; a `date` killed by the stop signal leaves a line without a time.
#[derive(Debug)]
struct TraceLine {
    what: String,
    holder: String,
    ns: Option<u128>,
}

fn read_trace(trace: &Path) -> Vec<TraceLine> {
    fs::read_to_string(trace)
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let mut fields = line.split_whitespace();
            let what = fields.next().unwrap_or_default().to_owned();
            let holder = fields.next().unwrap_or_default().to_owned();
            assert!(
                ["start", "beat", "stop", "int"].contains(&what.as_str()) && !holder.is_empty(),
                "bad trace line {line:?} in {}",
                trace.display()
            );
            TraceLine {
                what,
                holder,
                ns: fields.next().and_then(|n| n.parse().ok()),
            }
        })
        .collect()
}

/// The holders whose app started, in the order they started.
fn holders_started(trace: &Path) -> Vec<String> {
    read_trace(trace)
        .into_iter()
        .filter(|l| l.what == "start")
        .map(|l| l.holder)
        .collect()
}

fn start_of(lines: &[TraceLine], holder: &str) -> usize {
    lines
        .iter()
        .position(|l| l.what == "start" && l.holder == holder)
        .expect("the holder started")
}

/// How much later than the line `reference` the moment `at` is (zero if earlier).
fn ns_between(reference: &TraceLine, at: SystemTime) -> Duration {
    let start = reference.ns.expect("the start line has a time");
    Duration::from_nanos(u64::try_from(epoch_ns(at).saturating_sub(start)).unwrap_or(u64::MAX))
}

/// The app of `old` did nothing later than `slack` after the start of the app whose start line is
/// `lines[new_start]`: no line of it stamped later, and no line without a stamp after that start.
fn assert_no_overlap_after(
    lines: &[TraceLine],
    old: &str,
    new_start: usize,
    slack: Duration,
    backend: &str,
) {
    let start_ns = lines[new_start].ns.expect("the start line has a time");
    for (i, line) in lines.iter().enumerate().filter(|(_, l)| l.holder == old) {
        let late = match line.ns {
            Some(ns) => ns > start_ns + slack.as_nanos(),
            None => i > new_start,
        };
        assert!(
            !late,
            "{backend}: the old app ({old}) ran on after the new one started ({:?}): {line:?}",
            lines[new_start]
        );
    }
}

/// The file that tells whether a container is frozen, found through its init's cgroup: cgroup v1's
/// `freezer.state` or v2's `cgroup.freeze`.
fn freezer_state_file(container: &str) -> Option<PathBuf> {
    let pid = docker_ok(&["inspect", "-f", "{{.State.Pid}}", container]);
    let cgroups = fs::read_to_string(format!("/proc/{}/cgroup", pid.trim())).ok()?;
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        if controllers.split(',').any(|c| c == "freezer") {
            let file = Path::new("/sys/fs/cgroup/freezer")
                .join(path.trim_start_matches('/'))
                .join("freezer.state");
            return file.exists().then_some(file);
        }
        if controllers.is_empty() {
            let file = Path::new("/sys/fs/cgroup")
                .join(path.trim_start_matches('/'))
                .join("cgroup.freeze");
            if file.exists() {
                return Some(file);
            }
        }
    }
    None
}

/// Host pids of the app's processes in a container: all of it but the guard and its watchdog (both
/// the guard's binary).
fn app_pids(container: &str) -> Vec<i32> {
    docker_ok(&["top", container, "-eo", "pid,args"])
        .lines()
        .skip(1)
        .filter(|line| !line.contains("sentinel-guard"))
        .filter_map(|line| line.split_whitespace().next()?.parse().ok())
        .collect()
}

/// What `docker unpause` was seen to do.
struct Unpaused {
    /// The latest moment the container was still seen frozen: the thaw came after it, so time
    /// measured from it is never too short. Without a freezer file to watch, the moment before the
    /// command (which counts the CLI's own latency against the app).
    thawed: SystemTime,
    /// When every process in `app` was first seen gone (or a zombie).
    app_dead: Option<SystemTime>,
}

/// `docker unpause`, watching the freezer and the app's processes from just before the command.
fn unpause(container: &str, freezer: Option<&Path>, app: &[i32]) -> Unpaused {
    let called = SystemTime::now();
    let watch_freezer = freezer.map(|file| {
        let file = file.to_owned();
        std::thread::spawn(move || {
            let mut last_frozen = None;
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                let before_read = SystemTime::now();
                let state = fs::read_to_string(&file).unwrap_or_default();
                if matches!(state.trim(), "FROZEN" | "FREEZING" | "1") {
                    last_frozen = Some(before_read);
                } else {
                    break;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            last_frozen
        })
    });
    let app = app.to_vec();
    let watch_app = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if app.iter().all(|&pid| !alive(pid)) {
                return Some(SystemTime::now());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        None
    });
    docker_ok(&["unpause", container]);
    let thawed = watch_freezer
        .and_then(|w| w.join().unwrap())
        .map_or(called, |frozen| frozen.max(called));
    eprintln!(
        "container_engine: docker unpause: the thaw came {:?} after the command was called{}",
        thawed.duration_since(called).unwrap_or_default(),
        if freezer.is_some() {
            ""
        } else {
            " (no freezer file found: the call itself is taken as the thaw)"
        }
    );
    Unpaused {
        thawed,
        app_dead: watch_app.join().unwrap(),
    }
}

/// `docker run -it` on a pseudo-terminal of the test's own, as from an interactive shell.
struct Terminal {
    child: Child,
    master: fs::File,
    output: Arc<Mutex<Vec<u8>>>,
}

impl Terminal {
    fn spawn(args: &[String]) -> Terminal {
        let pty = nix::pty::openpty(None, None).unwrap();
        let mut cmd = Command::new("docker");
        cmd.args(args)
            .stdin(Stdio::from(pty.slave.try_clone().unwrap()))
            .stdout(Stdio::from(pty.slave.try_clone().unwrap()))
            .stderr(Stdio::from(pty.slave));
        // SAFETY: setsid and ioctl are async-signal-safe; nothing else runs between fork and exec.
        // The client gets the pty as its controlling terminal, as in a login session.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid()?;
                if nix::libc::ioctl(0, nix::libc::TIOCSCTTY, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("docker is installed");
        // Our copies of the slave end go with the command, so the master sees EOF once docker exits.
        drop(cmd);
        let master = fs::File::from(pty.master);
        let output = Arc::new(Mutex::new(Vec::new()));
        let mut reader = master.try_clone().unwrap();
        let sink = Arc::clone(&output);
        // Drained all along, so the client never blocks on a full terminal.
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Terminal {
            child,
            master,
            output,
        }
    }

    fn type_bytes(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.master.write_all(bytes).unwrap();
    }

    fn wait(&mut self, limit: Duration) -> ExitStatus {
        let status = exit_within(&mut self.child, limit);
        status.unwrap_or_else(|| {
            panic!(
                "docker run -it did not exit within {limit:?}:\n{}",
                self.output()
            )
        })
    }

    fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Out {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Out {
    fn ok(&self) -> bool {
        self.status.success()
    }
}

/// Runs a command to completion within `limit` (killing it past that), with its output.
fn try_run(cmd: &mut Command, limit: Duration) -> Result<Out, String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let mut status = None;
    let done = wait_until(limit, || {
        status = child.try_wait().ok().flatten();
        status.is_some()
    });
    if !done {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("{what} did not finish within {limit:?}"));
    }
    Ok(Out {
        status: status.unwrap(),
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

fn run(cmd: &mut Command, limit: Duration) -> Out {
    try_run(cmd, limit).unwrap_or_else(|e| panic!("{e}"))
}

/// `docker <args>`, which must succeed; its stdout.
fn docker_ok(args: &[&str]) -> String {
    let out = run(Command::new("docker").args(args), Duration::from_secs(60));
    assert!(out.ok(), "docker {args:?} failed: {}", out.stderr);
    out.stdout
}
