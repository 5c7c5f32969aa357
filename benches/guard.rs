//! Whole-process benchmark of sentinel-guard: start-up overhead, detection and takeover latency,
//! footprint, idle cost and scale, against private MariaDB and Redis servers on loopback, like the
//! tests. Prints a markdown table (median / p90 / max) and writes the same as JSON to
//! `target/bench/guard.json`.
//!
//! `cargo bench --bench guard` runs the full set (a few minutes); `cargo bench --bench guard -- --quick`
//! (or `SENTINEL_BENCH_QUICK=1`) runs few rounds, for CI. `SENTINEL_BENCH_ONLY=startup,takeover` runs
//! only the named sections (`startup`, `detection`, `freeze`, `takeover`, `footprint`, `memory`, `scale`,
//! `crowd`, `scheduled`, `redis_failover`). `nemesis`, the random faults' long run, runs only when named:
//! `SENTINEL_BENCH_ONLY=nemesis SENTINEL_NEMESIS_SECONDS=1800 cargo bench --bench guard`. Every row
//! measures the release binary, or the one `SENTINEL_BENCH_GUARD` names.

#[path = "../tests/common/mod.rs"]
mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::freeze::Freezer;
use common::mariadb::MariaDb;
use common::nemesis::Nemesis;
use common::postgres::Postgres;
use common::redis::Redis;
use common::sentinel::{Sentinels, FAILOVER_LEASE};
use common::*;
use serde_json::{json, Value};

struct Settings {
    quick: bool,
    rounds: usize,
}

/// Wall-clock nanoseconds: the apps below stamp with this clock, and guard, apps and bench share
/// one host.
fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// The first argument that makes this benchmark's own binary the app of `timing_app`.
const TIMING_APP: &str = "__timing_app";

/// An app that writes the time it started to `<dir>/started` and the time it received SIGTERM to
/// `<dir>/stopped` (then exits 0). With `exit_after` (seconds), it writes `<dir>/exiting` and exits
/// that long after starting. It is this benchmark's own binary run again (`timing_app_main`), not a
/// shell: a stamp is taken in the app's own process, at its start and right before its exit, with
/// no `sh`, `date` or `mv` started between the moment measured and the stamp (they added about 2 ms
/// to every hand-over, and to each tool under comparison alike).
fn timing_app(dir: &Path, exit_after: Option<&str>) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    vec![
        exe.display().to_string(),
        TIMING_APP.into(),
        dir.display().to_string(),
        exit_after.unwrap_or("-").into(),
    ]
}

/// The app of `timing_app`, when this binary was run as one; `None` otherwise.
fn timing_app_main() -> Option<i32> {
    use nix::sys::signal::{SigSet, Signal};
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some(TIMING_APP) {
        return None;
    }
    let dir = Path::new(&args[2]);
    // Blocked before the first stamp, so a SIGTERM that comes early waits for `wait` below.
    let mut term = SigSet::empty();
    term.add(Signal::SIGTERM);
    term.thread_block().unwrap();
    let write = |name: &str| {
        let (tmp, path) = (dir.join(format!("{name}.tmp")), dir.join(name));
        fs::write(&tmp, now_ns().to_string()).unwrap();
        fs::rename(tmp, path).unwrap();
    };
    write("started");
    match args[3].parse::<f64>() {
        Ok(seconds) => {
            std::thread::sleep(Duration::from_secs_f64(seconds));
            write("exiting");
        }
        Err(_) => {
            term.wait().unwrap();
            write("stopped");
        }
    }
    Some(0)
}

fn stamp(dir: &Path, name: &str, limit: Duration) -> Option<u64> {
    let path = dir.join(name);
    wait_until(limit, || path.exists())
        .then(|| fs::read_to_string(&path).unwrap().trim().parse().unwrap())
}

#[derive(Default)]
struct Stats(Vec<f64>);

impl Stats {
    fn push_ms(&mut self, ns: u64) {
        self.0.push(ns as f64 / 1e6);
    }

    fn summary(&self) -> Option<(f64, f64, f64)> {
        if self.0.is_empty() {
            return None;
        }
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Some((at(0.5), at(0.9), v[v.len() - 1]))
    }
}

struct Report {
    rows: Vec<(String, String, String, Value)>,
}

impl Report {
    /// A latency row: median / p90 / max in milliseconds, or a note when it could not be measured.
    fn latency(&mut self, scenario: &str, backend: &str, stats: &Stats, target: &str) {
        let (text, value) = match stats.summary() {
            Some((median, p90, max)) => (
                format!("{median:.1} / {p90:.1} / {max:.1} ms"),
                json!({"median_ms": median, "p90_ms": p90, "max_ms": max, "samples": stats.0.len()}),
            ),
            None => ("not measured".to_owned(), Value::Null),
        };
        self.row(scenario, backend, text, target, value);
    }

    fn row(&mut self, scenario: &str, backend: &str, text: String, target: &str, value: Value) {
        eprintln!("{scenario} [{backend}]: {text}");
        self.rows.push((
            format!("{scenario} | {backend}"),
            text,
            target.to_owned(),
            value,
        ));
    }
}

struct Servers {
    mysql: MariaDb,
    postgres: Postgres,
    redis: Redis,
    files: Lab,
    /// Only for the side-by-side rows; `None` where etcd is not installed.
    etcd: Option<Etcd>,
}

impl Servers {
    fn url(&self, backend: &str) -> String {
        match backend {
            "mysql" => self.mysql.url(),
            "postgres" => self.postgres.url(),
            "redis" => self.redis.url(),
            "etcd" => self.etcd.as_ref().expect("etcd is installed").url(),
            _ => self.files.file_url(&format!("bench-{}.lock", now_ns())),
        }
    }
}

const BACKENDS: [&str; 4] = ["mysql", "postgres", "redis", "file"];

impl Servers {
    /// `BACKENDS`, and etcd where it is installed: for the start-up and takeover rows, which
    /// `etcdctl lock` runs beside on the same server.
    fn with_etcd(&self) -> Vec<&'static str> {
        let mut backends = BACKENDS.to_vec();
        if self.etcd.is_some() {
            backends.push("etcd");
        }
        backends
    }
}

/// Timings for the latency scenarios: short enough that Redis events happen within seconds, and
/// valid for every backend.
const SHORT_LEASE: [&str; 8] = [
    "--ttl",
    "3s",
    "--renew-interval",
    "1s",
    "--check-timeout",
    "500ms",
    "--grace-period",
    "1s",
];

/// A guard holding no takeover delay (`SENTINEL_GUARD_TAKEOVER_DELAY=0s`): a fresh lock name has no
/// record, and the default would wait the bound at its first start. The start-up and takeover
/// rows keep every default (`with_defaults`).
fn guard_cmd(url: &str, name: &str, extra: &[&str], app: &[String]) -> Command {
    let mut cmd = Command::new(guard_binary());
    cmd.args(["--url", url, "--name", name])
        .args(extra)
        .arg("--")
        .args(app)
        .env("SENTINEL_GUARD_TAKEOVER_DELAY", "0s");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

/// `cmd` with the default takeover setting (`auto`).
fn with_defaults(mut cmd: Command) -> Command {
    cmd.env_remove("SENTINEL_GUARD_TAKEOVER_DELAY");
    cmd
}

fn time_command(mut cmd: Command) -> u64 {
    let started = now_ns();
    let status = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "{cmd:?}");
    now_ns() - started
}

fn startup(report: &mut Report, servers: &Servers, settings: &Settings) {
    let rounds = settings.rounds * 4;
    let mut plain = Stats::default();
    let mut flock = Stats::default();
    let lock = servers.files.path("flock-bench.lock");
    for _ in 0..rounds {
        plain.push_ms(time_command(Command::new("true")));
        let mut f = Command::new("flock");
        f.arg(&lock).arg("true");
        flock.push_ms(time_command(f));
    }
    report.latency("start-up: `true` alone", "-", &plain, "");
    report.latency("start-up: `flock <file> true`", "-", &flock, "");
    for backend in servers.with_etcd() {
        // A start after a clean exit, as every restart of a job is: the lock record says
        // `released`, so the default `--takeover-delay auto` does not wait. The very first start of
        // a name has no record and would wait its bound (17s with the defaults, 13s for a lock
        // file): it runs first, untimed and without the delay, and leaves the record.
        let url = servers.url(backend);
        let name = format!("startup-{}", now_ns());
        time_command(guard_cmd(&url, &name, &[], &["true".into()]));
        let start = || with_defaults(guard_cmd(&url, &name, &[], &["true".into()]));
        let mut guarded = Stats::default();
        for _ in 0..rounds {
            guarded.push_ms(time_command(start()));
        }
        let target = match backend {
            "file" => "<= 2x `flock <file> true`",
            _ => "<= 0.25x `etcdctl lock <name> true`",
        };
        report.latency(
            "start-up: `sentinel-guard ... -- true`",
            backend,
            &guarded,
            target,
        );
    }
    let scenario = "start-up: `etcdctl lock <name> true`";
    match &servers.etcd {
        Some(etcd) => {
            let mut locked = Stats::default();
            for i in 0..rounds {
                let mut cmd = etcd.ctl();
                cmd.args(["lock", &format!("startup-{i}"), "true"]);
                locked.push_ms(time_command(cmd));
            }
            report.latency(scenario, "etcd", &locked, "");
        }
        None => report.row(scenario, "-", NO_ETCD.into(), "", Value::Null),
    }
}

const NO_ETCD: &str = "not installed here (no etcd/etcdctl)";

/// From a fault to the leader app receiving its stop signal.
fn detection(report: &mut Report, servers: &mut Servers, settings: &Settings) {
    let cases: [(&str, &str, &str); 7] = [
        (
            "detection: `KILL <conn>`",
            "mysql",
            "<= 20 ms, independent of --check-interval",
        ),
        ("detection: server SIGKILL", "mysql", "<= 20 ms"),
        (
            "detection: `pg_terminate_backend`",
            "postgres",
            "<= 100 ms, independent of --check-interval",
        ),
        ("detection: server SIGKILL", "postgres", "<= 100 ms"),
        (
            "detection: key `DEL`",
            "redis",
            "<= renew-interval (1s here)",
        ),
        (
            "detection: server restart (empty)",
            "redis",
            "<= renew-interval (1s here)",
        ),
        (
            "detection: lock file deleted",
            "file",
            "<= check-interval (1s)",
        ),
    ];
    for (scenario, backend, target) in cases {
        let mut stats = Stats::default();
        for round in 0..settings.rounds {
            let lab = Lab::new();
            let name = format!("detect-{round}");
            let url = servers.url(backend);
            // A 30s check interval shows detection does not wait for the next check.
            let interval = if ["mysql", "postgres"].contains(&backend) {
                "30s"
            } else {
                "1s"
            };
            let mut args = vec!["--check-interval", interval];
            args.extend_from_slice(&SHORT_LEASE);
            let mut guard = guard_cmd(&url, &name, &args, &timing_app(lab.dir.path(), None))
                .spawn()
                .unwrap();
            stamp(lab.dir.path(), "started", Duration::from_secs(10)).expect("app started");
            std::thread::sleep(Duration::from_millis(200));
            let fault_at = now_ns();
            // By the scenario's own words: "server SIGKILL" also contains "KILL".
            match scenario {
                s if s.contains("`KILL <conn>`") => {
                    let id = servers.mysql.holder_of(&name).unwrap();
                    servers.mysql.sql(&format!("KILL {id}"));
                }
                s if s.contains("pg_terminate_backend") => {
                    let pid = servers.postgres.holder_of(&name).unwrap();
                    servers
                        .postgres
                        .sql(&format!("SELECT pg_terminate_backend({pid})"));
                }
                s if s.contains("server SIGKILL") && backend == "postgres" => {
                    servers.postgres.kill9()
                }
                s if s.contains("server SIGKILL") => servers.mysql.kill9(),
                s if s.contains("DEL") => {
                    servers
                        .redis
                        .cli(&["DEL", &format!("sentinel-guard:{{{name}}}")]);
                }
                s if s.contains("restart") => servers.redis.restart(),
                _ => fs::remove_file(url.trim_start_matches("file://")).unwrap(),
            }
            if let Some(stopped) = stamp(lab.dir.path(), "stopped", Duration::from_secs(10)) {
                stats.push_ms(stopped.saturating_sub(fault_at));
            }
            let _ = guard.wait();
            if scenario.contains("server SIGKILL") {
                match backend {
                    "postgres" => servers.postgres.restart(),
                    _ => servers.mysql.restart(),
                }
            }
        }
        report.latency(scenario, backend, &stats, target);
    }
}

/// The guard, its app and its watchdog frozen together (the cgroup freezer, as `docker pause`) until
/// the backend has freed the lock, then thawed: how long the old app lives on after the thaw. It
/// ignores SIGTERM, so only the SIGKILL a passed deadline calls for ends it.
fn tree_freeze(report: &mut Report, servers: &Servers, settings: &Settings) {
    let scenario = "whole tree frozen past the deadline: thaw -> old app dead";
    for backend in ["mysql", "redis"] {
        let mut stats = Stats::default();
        for round in 0..settings.rounds {
            let lab = Lab::new();
            let name = format!("freeze-{round}");
            let pidfile = lab.path("app");
            let app = vec![
                "sh".to_owned(),
                "-c".to_owned(),
                format!(
                    "trap '' TERM; echo $$ > {p}.tmp && mv {p}.tmp {p}; while :; do sleep 0.01; done",
                    p = pidfile.display()
                ),
            ];
            let mut args = vec!["--check-interval", "200ms"];
            args.extend_from_slice(&SHORT_LEASE);
            let cgroup = Freezer::create();
            let mut guard = cgroup
                .command(&guard_cmd(&servers.url(backend), &name, &args, &app))
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let app_pid = read_pid(&pidfile, Duration::from_secs(10));
            cgroup.freeze();
            let freed = wait_until(Duration::from_secs(30), || match backend {
                "mysql" => servers.mysql.holder_of(&name).is_none(),
                _ => {
                    servers
                        .redis
                        .cli(&["EXISTS", &format!("sentinel-guard:{{{name}}}")])
                        == "0"
                }
            });
            assert!(
                freed,
                "{backend}: the backend never freed a frozen guard's lock"
            );
            let thawed = Instant::now();
            cgroup.thaw();
            // Polled every 0.2ms: the shared `wait_until` looks only every 10ms.
            let limit = thawed + Duration::from_secs(10);
            while alive(app_pid) && Instant::now() < limit {
                std::thread::sleep(Duration::from_micros(200));
            }
            if !alive(app_pid) {
                stats.push_ms(thawed.elapsed().as_nanos() as u64);
            }
            let _ = guard.wait();
        }
        report.latency(
            scenario,
            backend,
            &stats,
            "a few ms (SIGKILL at once, no grace period)",
        );
    }
}

/// From the leader's app exiting (clean release) or the leader guard's SIGKILL, to a `--wait`
/// standby's app starting.
/// Pids of the processes whose `/proc/<pid>/<file>` satisfies `matches`.
fn pids_where(file: &str, matches: impl Fn(&str) -> bool) -> Vec<i32> {
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let pid = entry.file_name().to_str()?.parse().ok()?;
            let text = fs::read(entry.path().join(file)).ok()?;
            matches(&String::from_utf8_lossy(&text)).then_some(pid)
        })
        .collect()
}

/// The processes of an app of `timing_app(dir, ..)`: their command lines name `dir`.
fn apps_in(dir: &Path) -> Vec<i32> {
    let dir = dir.to_string_lossy().into_owned();
    pids_where("cmdline", |cmdline| cmdline.contains(&dir))
}

/// SIGKILLs what the tools under comparison leave behind: `etcdctl lock` ignores SIGTERM and leaves
/// its command running when it is killed itself. SIGKILL to each app and first to its children
/// (which would otherwise outlive the benchmark); one that has already exited (a guard that lost its
/// watchdog stops its app itself) is fine.
fn kill_all(pids: Vec<i32>) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    for pid in pids {
        for child in children_of(pid as u32).into_iter().chain([pid]) {
            let _ = kill(Pid::from_raw(child), Signal::SIGKILL);
        }
    }
}

/// A server's CPU ticks: its own, and its children's (PostgreSQL runs a process per connection).
fn server_ticks(pid: u32) -> u64 {
    let children = children_of(pid).into_iter();
    proc_stat_ticks(pid)
        + children
            .map(|child| proc_stat_ticks(child as u32))
            .sum::<u64>()
}

/// The direct children of `parent`, from the ppid in `/proc/<pid>/stat`.
fn children_of(parent: u32) -> Vec<i32> {
    pids_where("stat", |stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            == Some(&parent.to_string())
    })
}

fn orphan_row(report: &mut Report, backend: &str, orphaned: usize, rounds: usize) {
    report.row(
        "takeover: leader's app still running when the standby's app started",
        backend,
        format!("{orphaned} of {rounds} rounds"),
        "0",
        json!({"orphaned": orphaned, "rounds": rounds}),
    );
}

fn takeover(report: &mut Report, servers: &Servers, settings: &Settings) {
    for backend in servers.with_etcd() {
        for sigkill in [false, true] {
            let mut stats = Stats::default();
            let mut orphaned = 0;
            for round in 0..settings.rounds {
                let (lead, standby) = (Lab::new(), Lab::new());
                let name = format!("takeover-{sigkill}-{round}");
                let url = servers.url(backend);
                let fast = SHORT_LEASE;
                let lead_app = timing_app(lead.dir.path(), (!sigkill).then_some("1.5"));
                // Its own first start is not measured; the standby keeps the defaults.
                let mut leader = guard_cmd(&url, &name, &fast, &lead_app).spawn().unwrap();
                stamp(lead.dir.path(), "started", Duration::from_secs(10)).expect("leader started");
                let mut waiting = fast.to_vec();
                waiting.push("--wait");
                let standby_app = timing_app(standby.dir.path(), None);
                let mut standby_guard =
                    with_defaults(guard_cmd(&url, &name, &waiting, &standby_app))
                        .spawn()
                        .unwrap();
                let from = if sigkill {
                    std::thread::sleep(Duration::from_millis(500));
                    let at = now_ns();
                    send(leader.id() as i32, 9);
                    Some(at)
                } else {
                    stamp(lead.dir.path(), "exiting", Duration::from_secs(10))
                };
                let started = stamp(standby.dir.path(), "started", Duration::from_secs(10));
                if let (Some(from), Some(started)) = (from, started) {
                    stats.push_ms(started.saturating_sub(from));
                }
                orphaned += usize::from(!apps_in(lead.dir.path()).is_empty());
                let _ = leader.wait();
                send(standby_guard.id() as i32, 15);
                let _ = standby_guard.wait();
            }
            let (scenario, target) = match (sigkill, backend) {
                (false, _) => (
                    "takeover: leader's app exits -> standby's app started",
                    "<= 5 ms",
                ),
                (true, "redis") => (
                    "takeover: leader guard SIGKILLed -> standby's app started",
                    "<= ttl + 100 ms (ttl 3s here)",
                ),
                (true, _) => (
                    "takeover: leader guard SIGKILLed -> standby's app started",
                    "<= 20 ms",
                ),
            };
            report.latency(scenario, backend, &stats, target);
            if sigkill {
                orphan_row(report, backend, orphaned, settings.rounds);
            }
        }
    }
    flock_takeover(report, servers, settings);
    etcd_takeover(report, servers, settings);
}

/// The clean hand-over with `flock <file>` as leader and standby, the same apps: the floor a
/// guard's hand-over is compared with (a lock freed by the leader's exit, an app forked and
/// executed by the standby).
fn flock_takeover(report: &mut Report, servers: &Servers, settings: &Settings) {
    let mut stats = Stats::default();
    for round in 0..settings.rounds {
        let (lead, standby) = (Lab::new(), Lab::new());
        let lock = servers.files.path(&format!("flock-takeover-{round}.lock"));
        let flock = |app: Vec<String>| {
            Command::new("flock")
                .arg(&lock)
                .args(app)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        };
        let mut leader = flock(timing_app(lead.dir.path(), Some("1.5")));
        stamp(lead.dir.path(), "started", Duration::from_secs(10)).expect("leader started");
        let mut waiting = flock(timing_app(standby.dir.path(), None));
        let exiting = stamp(lead.dir.path(), "exiting", Duration::from_secs(10));
        let started = stamp(standby.dir.path(), "started", Duration::from_secs(10));
        if let (Some(from), Some(started)) = (exiting, started) {
            stats.push_ms(started.saturating_sub(from));
        }
        let _ = leader.wait();
        kill_all(apps_in(standby.dir.path()));
        let _ = waiting.wait();
    }
    report.latency(
        "takeover: leader's app exits -> standby's app started",
        "- (`flock <file>`)",
        &stats,
        "",
    );
}

/// The same SIGKILL takeover with `etcdctl lock --ttl 3` (the ttl of the Redis rows) as leader and
/// standby, for comparison.
fn etcd_takeover(report: &mut Report, servers: &Servers, settings: &Settings) {
    let scenario = "takeover: leader SIGKILLed -> standby's app started";
    let Some(etcd) = &servers.etcd else {
        report.row(scenario, "-", NO_ETCD.into(), "", Value::Null);
        return;
    };
    let mut stats = Stats::default();
    let mut orphaned = 0;
    for round in 0..settings.rounds {
        let (lead, standby) = (Lab::new(), Lab::new());
        let name = format!("takeover-etcd-{round}");
        let lock = |dir: &Path| {
            let mut cmd = etcd.ctl();
            // `--` keeps etcdctl from parsing the app's `-c` as its own flag.
            cmd.args(["lock", "--ttl", "3", &name, "--"])
                .args(timing_app(dir, None))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            cmd.spawn().unwrap()
        };
        let mut leader = lock(lead.dir.path());
        stamp(lead.dir.path(), "started", Duration::from_secs(10)).expect("leader started");
        let mut waiting = lock(standby.dir.path());
        std::thread::sleep(Duration::from_millis(500));
        let at = now_ns();
        send(leader.id() as i32, 9);
        let _ = leader.wait();
        if let Some(started) = stamp(standby.dir.path(), "started", Duration::from_secs(15)) {
            stats.push_ms(started.saturating_sub(at));
        }
        orphaned += usize::from(!apps_in(lead.dir.path()).is_empty());
        kill_all(apps_in(lead.dir.path()));
        // The standby's etcdctl exits once its command is gone.
        kill_all(apps_in(standby.dir.path()));
        let _ = waiting.wait();
    }
    report.latency(scenario, "etcd (`etcdctl lock --ttl 3`)", &stats, "");
    orphan_row(report, "etcd (`etcdctl lock`)", orphaned, settings.rounds);
}

fn proc_stat_ticks(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the comm.
    fields
        .get(11)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0)
        + fields
            .get(12)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
}

/// A `key:   123 kB` line of a /proc file, in kB.
fn proc_kb(file: &str, key: &str) -> u64 {
    fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn vm_hwm_kb(pid: u32) -> u64 {
    proc_kb(&format!("/proc/{pid}/status"), "VmHWM")
}

/// Memory only this process has written: what each further guard on a host costs. The rest of its
/// resident set is clean pages of the binary and the libraries, shared by every guard on the host.
fn private_dirty_kb(pid: u32) -> u64 {
    proc_kb(&format!("/proc/{pid}/smaps_rollup"), "Private_Dirty")
}

/// "5.2 MB (private dirty 0.7 MB)", and the same as JSON.
fn footprint(pid: u32) -> (String, Value) {
    let (hwm, dirty) = (vm_hwm_kb(pid), private_dirty_kb(pid));
    (
        format!(
            "{:.1} MB (private dirty {:.1} MB)",
            hwm as f64 / 1024.0,
            dirty as f64 / 1024.0
        ),
        json!({"vm_hwm_kb": hwm, "private_dirty_kb": dirty}),
    )
}

fn mysql_questions(db: &MariaDb) -> u64 {
    db.sql("SHOW GLOBAL STATUS LIKE 'Questions'")
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

fn redis_commands(redis: &Redis) -> u64 {
    redis
        .cli(&["INFO", "stats"])
        .lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Transactions (each statement outside a transaction is one), as the server's statistics have
/// them: they lag by up to a second, which a window of seconds absorbs.
fn postgres_transactions(db: &Postgres) -> u64 {
    db.sql("SELECT sum(xact_commit + xact_rollback) FROM pg_stat_database")
        .parse()
        .unwrap()
}

fn backend_ops(servers: &Servers, backend: &str) -> Option<u64> {
    match backend {
        "mysql" => Some(mysql_questions(&servers.mysql)),
        "postgres" => Some(postgres_transactions(&servers.postgres)),
        "redis" => Some(redis_commands(&servers.redis)),
        _ => None,
    }
}

/// Peak RSS, CPU and backend traffic of one guard holding a lock and supervising `sleep`.
fn footprint_and_idle(report: &mut Report, servers: &Servers, settings: &Settings) {
    let window = if settings.quick {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(30)
    };
    let ticks_per_sec = 100.0;
    for backend in BACKENDS {
        let url = servers.url(backend);
        let mut guard = guard_cmd(&url, "idle", &[], &["sleep".into(), "1000".into()])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs(1));
        let (cpu0, ops0, t0) = (
            proc_stat_ticks(guard.id()),
            backend_ops(servers, backend),
            Instant::now(),
        );
        std::thread::sleep(window);
        let (cpu1, ops1, elapsed) = (
            proc_stat_ticks(guard.id()),
            backend_ops(servers, backend),
            t0.elapsed(),
        );
        let (held, held_json) = footprint(guard.id());
        send(guard.id() as i32, 15);
        let _ = guard.wait();
        let cpu_ms = (cpu1 - cpu0) as f64 / ticks_per_sec * 1000.0;
        let rate = ops0
            .zip(ops1)
            .map(|(a, b)| (b - a) as f64 / elapsed.as_secs_f64());
        report.row(
            "footprint: peak RSS (VmHWM) holding a lock",
            backend,
            held,
            "<= 4 MB",
            held_json,
        );
        report.row(
            &format!("idle: CPU over {}s, defaults", window.as_secs()),
            backend,
            format!(
                "{cpu_ms:.0} ms CPU ({:.2}% of a core); {}",
                cpu_ms / elapsed.as_secs_f64() / 10.0,
                rate.map_or("no backend traffic".to_owned(), |r| format!(
                    "{r:.1} queries or commands/s"
                ))
            ),
            "",
            json!({"cpu_ms": cpu_ms, "window_s": elapsed.as_secs_f64(), "backend_ops_per_s": rate}),
        );
    }
    let with_metrics = guard_cmd(
        &servers.url("mysql"),
        "idle-metrics",
        &["--metrics-addr", &format!("127.0.0.1:{}", free_port())],
        &["sleep".into(), "1000".into()],
    );
    peak_rss_row(
        report,
        "footprint: peak RSS holding a lock, `--metrics-addr` on and scraped",
        "mysql",
        with_metrics,
        "",
    );
    for (tool, args) in [
        ("tini", &["-s", "--", "sleep", "1000"][..]),
        ("dumb-init", &["sleep", "1000"][..]),
    ] {
        let scenario = format!("footprint: peak RSS of `{tool}` supervising `sleep`");
        if Command::new(tool).arg("--version").output().is_ok() {
            let mut cmd = Command::new(tool);
            cmd.args(args);
            peak_rss_row(report, &scenario, "-", cmd, "");
        } else {
            report.row(&scenario, "-", "not installed here".into(), "", Value::Null);
        }
    }
    let scenario = "footprint: peak RSS of `etcdctl lock` holding a lock";
    match &servers.etcd {
        Some(etcd) => {
            let mut cmd = etcd.ctl();
            cmd.args(["lock", "idle", "sleep", "1000"]);
            peak_rss_row(report, scenario, "etcd", cmd, "");
        }
        None => report.row(scenario, "-", NO_ETCD.into(), "", Value::Null),
    }
}

/// PSS of `pid` (its private pages, and each shared page divided among the processes that map it).
/// The guard and its watchdog are not dumpable: only root reads theirs.
fn pss_kb(pid: i32) -> u64 {
    let kb = proc_kb(&format!("/proc/{pid}/smaps_rollup"), "Pss");
    assert!(
        kb > 0,
        "cannot read the PSS of process {pid}: run the benchmark as root"
    );
    kb
}

/// Guards on one host, each holding its own lock and supervising `sleep`: what each guarded app
/// costs the host in guard and watchdog (PSS, so the binary's shared pages are counted once across
/// all of them), beside tini and flock doing the same for as many apps.
fn memory(report: &mut Report, servers: &Servers, settings: &Settings) {
    // Quick mode says only that the rows still measure something.
    let guards_per_host: usize = if settings.quick { 5 } else { 30 };
    let sleep = || vec!["sleep".to_owned(), "1000".to_owned()];
    for backend in BACKENDS {
        let mut guards: Vec<_> = (0..guards_per_host)
            .map(|i| {
                guard_cmd(&servers.url(backend), &format!("memory-{i}"), &[], &sleep())
                    .spawn()
                    .unwrap()
            })
            .collect();
        // Each guard's app and watchdog running: the watchdog is the child whose command line
        // says so, the app the other one.
        let watchdogs = |guards: &[std::process::Child]| -> Vec<Option<i32>> {
            guards
                .iter()
                .map(|g| {
                    let kids = procs::children(g.id() as i32);
                    let watchdog = kids
                        .iter()
                        .copied()
                        .find(|k| procs::argv(*k).iter().any(|a| a == "__watchdog"));
                    watchdog.filter(|_| kids.len() >= 2)
                })
                .collect()
        };
        let settled = wait_until(Duration::from_secs(30), || {
            watchdogs(&guards).iter().all(Option::is_some)
        });
        assert!(settled, "{backend}: not every guard started its app");
        let (guard_kb, watchdog_kb) =
            guards
                .iter()
                .zip(watchdogs(&guards))
                .fold((0, 0), |(g, w), (guard, watchdog)| {
                    (g + pss_kb(guard.id() as i32), w + pss_kb(watchdog.unwrap()))
                });
        for guard in &mut guards {
            send(guard.id() as i32, 15);
        }
        for guard in &mut guards {
            let _ = guard.wait();
        }
        let per_app = |kb: u64| kb as f64 / guards_per_host as f64 / 1024.0;
        report.row(
            &format!("memory: guard + watchdog PSS per guarded app, {guards_per_host} guards on one host"),
            backend,
            format!(
                "{:.2} MB (guard {:.2}, watchdog {:.2})",
                per_app(guard_kb + watchdog_kb),
                per_app(guard_kb),
                per_app(watchdog_kb)
            ),
            "<= 1 MB",
            json!({"guards": guards_per_host, "guard_pss_kb": guard_kb, "watchdog_pss_kb": watchdog_kb}),
        );
    }
    let lock = servers.files.path("memory-flock.lock");
    for (tool, args) in [
        ("tini", vec!["-s".to_owned(), "--".to_owned()]),
        ("flock", vec![lock.display().to_string()]),
    ] {
        let scenario =
            format!("memory: `{tool}` PSS per supervised app, {guards_per_host} on one host");
        if Command::new(tool).arg("--version").output().is_err() {
            report.row(&scenario, "-", "not installed here".into(), "", Value::Null);
            continue;
        }
        // flock's instances queue for the one lock: only the first runs `sleep`, the rest wait,
        // which is what a flock standby costs (the table in docs/benchmarks.md says so).
        let mut supervisors: Vec<_> = (0..guards_per_host)
            .map(|_| {
                Command::new(tool)
                    .args(&args)
                    .args(sleep())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        let kb: u64 = supervisors.iter().map(|s| pss_kb(s.id() as i32)).sum();
        for supervisor in &mut supervisors {
            let _ = supervisor.kill();
            let _ = supervisor.wait();
        }
        report.row(
            &scenario,
            "-",
            format!("{:.2} MB", kb as f64 / guards_per_host as f64 / 1024.0),
            "",
            json!({"supervisors": guards_per_host, "pss_kb": kb}),
        );
    }
}

/// VmHWM of the process `cmd` starts, once it has run for a second (with `--metrics-addr`, after a
/// scrape, so serving counts too).
fn peak_rss_row(
    report: &mut Report,
    scenario: &str,
    backend: &str,
    mut cmd: Command,
    target: &str,
) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let args: Vec<String> = cmd
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if let Some(at) = args.iter().position(|a| a == "--metrics-addr") {
        let port: u16 = args[at + 1].rsplit(':').next().unwrap().parse().unwrap();
        common::endpoints::Metrics::scrape(port).expect("metrics answer");
    }
    let (text, value) = footprint(child.id());
    kill_all(children_of(child.id()));
    send(child.id() as i32, 15);
    let _ = child.wait();
    report.row(scenario, backend, text, target, value);
}

/// N guards holding distinct locks against one server: server CPU and command rate.
/// The server's CPU (% of a core) and operations per second while `guards` run, measured over
/// `window` after `settle`; the guards are stopped afterwards.
fn server_load(
    servers: &Servers,
    backend: &str,
    server_pid: u32,
    guards: &mut [std::process::Child],
    settle: Duration,
    window: Duration,
) -> (f64, f64) {
    std::thread::sleep(settle);
    let (cpu0, ops0, t0) = (
        proc_stat_ticks(server_pid),
        backend_ops(servers, backend).unwrap(),
        Instant::now(),
    );
    std::thread::sleep(window);
    let (cpu1, ops1, elapsed) = (
        proc_stat_ticks(server_pid),
        backend_ops(servers, backend).unwrap(),
        t0.elapsed(),
    );
    for guard in guards.iter() {
        send(guard.id() as i32, 15);
    }
    for guard in guards.iter_mut() {
        let _ = guard.wait();
    }
    let cpu_pct = (cpu1 - cpu0) as f64 / 100.0 / elapsed.as_secs_f64() * 100.0;
    (cpu_pct, (ops1 - ops0) as f64 / elapsed.as_secs_f64())
}

fn scale(report: &mut Report, servers: &Servers, settings: &Settings) {
    let sizes: &[usize] = if settings.quick { &[20] } else { &[100, 500] };
    let window = Duration::from_secs(if settings.quick { 2 } else { 10 });
    for backend in ["mysql", "redis"] {
        let server_pid = match backend {
            "mysql" => servers.mysql.pid() as u32,
            _ => servers.redis.pid() as u32,
        };
        for &n in sizes {
            for interval in ["1s", "5s"] {
                let extra = if backend == "mysql" {
                    vec!["--check-interval", interval]
                } else {
                    vec!["--renew-interval", interval, "--ttl", "30s"]
                };
                let mut guards: Vec<_> = (0..n)
                    .map(|i| {
                        guard_cmd(
                            &servers.url(backend),
                            &format!("scale-{n}-{interval}-{i}"),
                            &extra,
                            &["sleep".into(), "1000".into()],
                        )
                        .spawn()
                        .unwrap()
                    })
                    .collect();
                let settle = Duration::from_secs(if settings.quick { 1 } else { 3 });
                let (cpu_pct, rate) =
                    server_load(servers, backend, server_pid, &mut guards, settle, window);
                let knob = if backend == "mysql" {
                    "check-interval"
                } else {
                    "renew-interval"
                };
                report.row(
                    &format!("scale: {n} guards, {knob} {interval}"),
                    backend,
                    format!("server CPU {cpu_pct:.1}% of a core; {rate:.0} queries or commands/s"),
                    "",
                    json!({"guards": n, "interval": interval, "server_cpu_pct": cpu_pct, "ops_per_s": rate}),
                );
            }
        }
    }
}

/// Issue 33's crowds: with many guards holding on one server, a fault to one guard's lock is still
/// detected within a lone guard's bound (the detection rows), and the server's CPU per guard; then
/// 1,000 guards renewing Redis leases, none late. Guards log to one file; the events counted are
/// those logged once every guard runs and before they are stopped (their start and stop load the
/// machine, not the server).
fn crowd(report: &mut Report, servers: &Servers, settings: &Settings) {
    let holding = if settings.quick { 20 } else { 200 };
    let window = Duration::from_secs(if settings.quick { 2 } else { 10 });
    let lone = "<= 50 ms (a lone guard: the detection row)";
    let faults = [
        ("`KILL <conn>` of one guard's session", "mysql", lone),
        (
            "`pg_terminate_backend` of one guard's session",
            "postgres",
            lone,
        ),
        (
            "key `DEL` of one guard's lease",
            "redis",
            "<= renew-interval (1s here)",
        ),
    ];
    for (fault, backend, target) in faults {
        let crowd = Crowd::start(servers, backend, holding, &SHORT_LEASE);
        let started = crowd.log_len();
        let cpu = crowd.server_cpu(servers, backend, window);
        let mut stats = Stats::default();
        let step = holding / settings.rounds.min(holding);
        for victim in (0..holding).step_by(step).take(settings.rounds) {
            let (name, dir) = (crowd.name(victim), crowd.dir(victim));
            let fault_at = now_ns();
            match backend {
                "mysql" => {
                    let id = servers.mysql.holder_of(&name).unwrap();
                    servers.mysql.sql(&format!("KILL {id}"));
                }
                "postgres" => {
                    let pid = servers.postgres.holder_of(&name).unwrap();
                    let terminate = format!("SELECT pg_terminate_backend({pid})");
                    servers.postgres.sql(&terminate);
                }
                _ => {
                    let key = format!("sentinel-guard:{{{name}}}");
                    servers.redis.cli(&["DEL", &key]);
                }
            }
            if let Some(stopped) = stamp(&dir, "stopped", Duration::from_secs(10)) {
                stats.push_ms(stopped.saturating_sub(fault_at));
            }
        }
        let log = crowd.events_since(started);
        crowd.stop();
        let scenario = format!("crowd: {holding} guards holding, {fault} -> its app stopped");
        report.latency(&scenario, backend, &stats, target);
        let others = log.losses.saturating_sub(stats.0.len());
        report.row(
            &format!("crowd: {holding} guards holding, server CPU"),
            backend,
            format!(
                "{cpu:.1}% of a core, {:.3}% per guard; other guards' losses: {others}",
                cpu / holding as f64
            ),
            "reported",
            json!({"guards": holding, "server_cpu_pct": cpu, "per_guard_pct": cpu / holding as f64, "losses": log.losses}),
        );
    }
    let renewing: &[(usize, &[&str], &str, u64)] = if settings.quick {
        &[(50, &SHORT_LEASE, "every 1s, --check-timeout 500ms", 3)]
    } else {
        &[
            (
                1000,
                &[],
                "every 10s (defaults: --ttl 30s, --check-timeout 2s)",
                30,
            ),
            (1000, &SHORT_LEASE, "every 1s, --check-timeout 500ms", 10),
        ]
    };
    for &(n, flags, how, seconds) in renewing {
        let crowd = Crowd::start(servers, "redis", n, flags);
        let started = crowd.log_len();
        let cpu = crowd.server_cpu(servers, "redis", Duration::from_secs(seconds));
        let log = crowd.events_since(started);
        crowd.stop();
        report.row(
            &format!("crowd: {n} guards renewing {how}, over {seconds}s"),
            "redis",
            format!(
                "late or failed renewals {}, locks lost {}; server CPU {cpu:.1}% of a core, {:.4}% per guard",
                log.late_renewals,
                log.losses,
                cpu / n as f64
            ),
            "every renewal on time; server CPU reported",
            json!({"guards": n, "seconds": seconds, "late_renewals": log.late_renewals, "losses": log.losses, "server_cpu_pct": cpu}),
        );
    }
}

/// Guards, each holding its own lock with a `timing_app`, sharing one log file.
struct Crowd {
    guards: Vec<std::process::Child>,
    dir: tempfile::TempDir,
    prefix: String,
}

/// What the crowd's log says happened.
struct CrowdLog {
    late_renewals: usize,
    losses: usize,
}

impl Crowd {
    /// `n` guards on `backend`, once every app has started.
    fn start(servers: &Servers, backend: &str, n: usize, flags: &[&str]) -> Crowd {
        let dir = tempfile::tempdir().unwrap();
        let log = fs::File::create(dir.path().join("guards.log")).unwrap();
        let prefix = format!("crowd-{}", now_ns());
        let url = servers.url(backend);
        let guards = (0..n)
            .map(|i| {
                let app_dir = dir.path().join(i.to_string());
                fs::create_dir(&app_dir).unwrap();
                let app = timing_app(&app_dir, None);
                let mut cmd = guard_cmd(&url, &format!("{prefix}-{i}"), flags, &app);
                cmd.stderr(log.try_clone().unwrap());
                cmd.spawn().unwrap()
            })
            .collect();
        let crowd = Crowd {
            guards,
            dir,
            prefix,
        };
        for i in 0..n {
            stamp(&crowd.dir(i), "started", Duration::from_secs(120))
                .unwrap_or_else(|| panic!("app {i} of {n} on {backend} did not start"));
        }
        crowd
    }

    fn name(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    fn dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(i.to_string())
    }

    /// The server's CPU over `window`, in percent of one core.
    fn server_cpu(&self, servers: &Servers, backend: &str, window: Duration) -> f64 {
        let pid = match backend {
            "mysql" => servers.mysql.pid() as u32,
            "postgres" => servers.postgres.pid() as u32,
            _ => servers.redis.pid() as u32,
        };
        let (cpu0, t0) = (server_ticks(pid), Instant::now());
        std::thread::sleep(window);
        // Saturating: a PostgreSQL backend that ended took its ticks with it.
        server_ticks(pid).saturating_sub(cpu0) as f64 / t0.elapsed().as_secs_f64()
    }

    fn log(&self) -> Vec<u8> {
        fs::read(self.dir.path().join("guards.log")).unwrap()
    }

    /// How long the crowd's log is now, in bytes.
    fn log_len(&self) -> usize {
        self.log().len()
    }

    /// What the log says happened since it was `from` bytes long.
    fn events_since(&self, from: usize) -> CrowdLog {
        let log = self.log();
        let log = String::from_utf8_lossy(&log[from..]);
        let count = |event: &str| {
            let quoted = format!("event=\"{event}\"");
            log.lines().filter(|l| l.contains(&quoted)).count()
        };
        CrowdLog {
            late_renewals: count("renewal_failed"),
            losses: count("lock_lost"),
        }
    }

    /// Stops every guard: SIGTERM, then waits.
    fn stop(mut self) {
        for guard in &self.guards {
            let pid = nix::unistd::Pid::from_raw(guard.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::SIGTERM);
        }
        for guard in &mut self.guards {
            let _ = guard.wait();
        }
    }
}

/// Scheduled jobs: how long after its window starts a run begins (the backend's clock is read, the
/// lock taken, the window claimed, the app spawned), with three replicas per backend; then the
/// server's load when many resident schedulers share it, each claiming every second.
fn scheduled(report: &mut Report, servers: &Servers, settings: &Settings) {
    let windows = if settings.quick { 3 } else { 15 };
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let runs = dir.path().join("runs");
        let app = vec![
            "sh".into(),
            "-c".into(),
            format!(
                "echo $(date +%s%N) $SENTINEL_GUARD_WINDOW >> {}",
                runs.display()
            ),
        ];
        let url = servers.url(backend);
        let name = format!("sched-{}", now_ns());
        let mut replicas: Vec<_> = (0..3)
            .map(|_| {
                guard_cmd(&url, &name, &["--every", "1s"], &app)
                    .spawn()
                    .unwrap()
            })
            .collect();
        // The first window is claimed mid-window, when the replicas start: it is not a window start.
        wait_until(Duration::from_secs(windows as u64 + 10), || {
            trace_lines(&runs).len() > windows
        });
        for replica in &replicas {
            send(replica.id() as i32, 15);
        }
        for replica in &mut replicas {
            let _ = replica.wait();
        }
        let mut late = Stats::default();
        for line in trace_lines(&runs).iter().skip(1) {
            let mut words = line.split_whitespace();
            let (Some(started), Some(window)) = (words.next(), words.next()) else {
                continue;
            };
            let (started, window): (u64, u64) = (started.parse().unwrap(), window.parse().unwrap());
            late.push_ms(started.saturating_sub(window * 1_000_000_000));
        }
        report.latency(
            "scheduled: window start -> app started (3 replicas, --every 1s)",
            backend,
            &late,
            "",
        );
    }
    let n = if settings.quick { 20 } else { 500 };
    let measured = Duration::from_secs(if settings.quick { 3 } else { 10 });
    for backend in ["mysql", "redis"] {
        let server_pid = match backend {
            "mysql" => servers.mysql.pid() as u32,
            _ => servers.redis.pid() as u32,
        };
        let mut guards: Vec<_> = (0..n)
            .map(|i| {
                guard_cmd(
                    &servers.url(backend),
                    &format!("sched-scale-{i}"),
                    &["--every", "1s"],
                    &["true".into()],
                )
                .spawn()
                .unwrap()
            })
            .collect();
        let (cpu_pct, rate) = server_load(
            servers,
            backend,
            server_pid,
            &mut guards,
            Duration::from_secs(3),
            measured,
        );
        report.row(
            &format!("scheduled: {n} resident schedulers, --every 1s"),
            backend,
            format!("server CPU {cpu_pct:.1}% of a core; {rate:.0} queries or commands/s"),
            "",
            json!({"schedulers": n, "server_cpu_pct": cpu_pct, "ops_per_s": rate}),
        );
    }
}

/// One sample of a guard's `/metrics` whose line starts with `name` and contains `label`.
fn metric(port: u16, name: &str, label: &str) -> Option<f64> {
    let text = ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .ok()?
        .body_mut()
        .read_to_string()
        .ok()?;
    text.lines()
        .find(|line| line.starts_with(name) && line.contains(label))?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()
}

/// Redis behind Sentinel (a primary, two replicas, three sentinels with `down-after-milliseconds
/// 1000`): what `--redis-min-replicas` adds to each renewal, how long a leader's lease rides through
/// a primary SIGKILL, and how long a standby takes over when the leader's guard and the primary die
/// together.
fn redis_failover(report: &mut Report, settings: &Settings) {
    let group = Sentinels::start();
    let url = group.url();
    for replicas in ["0", "1", "2"] {
        let lab = Lab::new();
        let port = free_port();
        let address = format!("127.0.0.1:{port}");
        let args = [
            "--ttl",
            "3s",
            "--renew-interval",
            "100ms",
            "--check-timeout",
            "500ms",
            "--grace-period",
            "1s",
            "--redis-min-replicas",
            replicas,
            "--metrics-addr",
            &address,
        ];
        let name = format!("wait-cost-{replicas}");
        let mut guard = guard_cmd(&url, &name, &args, &timing_app(lab.dir.path(), None))
            .spawn()
            .unwrap();
        stamp(lab.dir.path(), "started", Duration::from_secs(10)).expect("guard started");
        std::thread::sleep(Duration::from_secs(if settings.quick { 2 } else { 10 }));
        let sum = metric(port, "sentinel_guard_check_duration_seconds_sum", "");
        let count = metric(port, "sentinel_guard_check_duration_seconds_count", "");
        send(guard.id() as i32, 15);
        let _ = guard.wait();
        let (text, value) = match (sum, count) {
            (Some(sum), Some(count)) if count > 0.0 => {
                let mean_ms = sum / count * 1000.0;
                (
                    format!("{mean_ms:.2} ms mean over {count} renewals"),
                    json!({"mean_ms": mean_ms, "renewals": count}),
                )
            }
            _ => ("not measured".to_owned(), Value::Null),
        };
        report.row(
            &format!("Redis renewal behind Sentinel, --redis-min-replicas {replicas} (WAIT)"),
            "redis+sentinel",
            text,
            "",
            value,
        );
    }
    drop(group);

    let rounds = if settings.quick { 1 } else { 5 };
    let (mut ride, mut takeover) = (Stats::default(), Stats::default());
    for round in 0..rounds {
        // The leader keeps its lease through a primary SIGKILL: from the kill to its first renewal
        // confirmed (and acknowledged by a replica) on the new primary.
        let mut group = Sentinels::start();
        let url = group.url();
        let lab = Lab::new();
        let port = free_port();
        let address = format!("127.0.0.1:{port}");
        let mut args = FAILOVER_LEASE.to_vec();
        args.extend_from_slice(&["--redis-min-replicas", "1"]);
        let mut leader_args = args.clone();
        leader_args.extend_from_slice(&["--metrics-addr", &address]);
        let name = format!("ride-{round}");
        let mut leader = guard_cmd(&url, &name, &leader_args, &timing_app(lab.dir.path(), None))
            .spawn()
            .unwrap();
        stamp(lab.dir.path(), "started", Duration::from_secs(10)).expect("leader started");
        let ok =
            |port| metric(port, "sentinel_guard_checks_total", "outcome=\"ok\"").unwrap_or(0.0);
        let before = ok(port);
        let killed = now_ns();
        group.primary().kill9();
        if wait_until(Duration::from_secs(20), || ok(port) > before) {
            ride.push_ms(now_ns() - killed);
        }
        send(leader.id() as i32, 15);
        let _ = leader.wait();
        drop(group);

        // The leader's guard and the primary die together (a lost host): from the kills to the
        // standby's app, with a 3s ttl.
        let mut group = Sentinels::start();
        let url = group.url();
        let (lead, standby) = (Lab::new(), Lab::new());
        args.splice(0..8, SHORT_LEASE);
        let name = format!("lost-host-{round}");
        let mut leader = guard_cmd(&url, &name, &args, &timing_app(lead.dir.path(), None))
            .spawn()
            .unwrap();
        stamp(lead.dir.path(), "started", Duration::from_secs(10)).expect("leader started");
        let mut waiting = args.clone();
        waiting.push("--wait");
        let mut standby_guard =
            guard_cmd(&url, &name, &waiting, &timing_app(standby.dir.path(), None))
                .spawn()
                .unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let killed = now_ns();
        send(leader.id() as i32, 9);
        group.primary().kill9();
        if let Some(started) = stamp(standby.dir.path(), "started", Duration::from_secs(30)) {
            takeover.push_ms(started.saturating_sub(killed));
        }
        let _ = leader.wait();
        send(standby_guard.id() as i32, 15);
        let _ = standby_guard.wait();
    }
    report.latency(
        "Sentinel: primary SIGKILLed -> leader's lease renewed on the new primary (--redis-min-replicas 1)",
        "redis+sentinel",
        &ride,
        "< ttl - margin - grace (8.8s here)",
    );
    report.latency(
        "Sentinel: primary and leader guard SIGKILLed -> standby's app started",
        "redis+sentinel",
        &takeover,
        "<= failover + ttl (ttl 3s here)",
    );
}

/// The nemesis (`tests/common/nemesis.rs`) on every backend at once, each on servers of its own, for
/// `SENTINEL_NEMESIS_SECONDS` each: one row per backend, with the faults survived by kind.
fn nemesis(report: &mut Report) {
    type Start = fn() -> Backend;
    let runs: [(&str, Start); 6] = [
        ("mysql", || Backend::Mysql(MariaDb::start())),
        ("postgres", || Backend::Postgres(Postgres::start())),
        ("redis", || Backend::Redis(Redis::start())),
        ("redis+sentinel", || Backend::Sentinel(Sentinels::start())),
        ("etcd", || Backend::Etcd(Etcd::cluster(3))),
        ("file", || Backend::File(Lab::new())),
    ];
    let results: Vec<_> = std::thread::scope(|scope| {
        let running: Vec<_> = runs
            .into_iter()
            .map(|(name, backend)| (name, scope.spawn(move || Nemesis::new(backend()).run())))
            .collect();
        running
            .into_iter()
            .map(|(name, run)| (name, run.join()))
            .collect()
    });
    for (name, result) in results {
        match result {
            Ok(summary) => {
                let faults: Vec<String> =
                    summary.faults.iter().map(|(k, n)| format!("{k} {n}")).collect();
                report.row(
                    &format!("random faults (nemesis), {}s", summary.seconds),
                    name,
                    format!(
                        "{} overlaps; {} rounds, {} apps, worst takeover {}ms; faults: {}; seed {}",
                        summary.overlaps,
                        summary.rounds,
                        summary.apps,
                        summary.worst_takeover.as_millis(),
                        faults.join(", "),
                        summary.seed
                    ),
                    "0 overlaps",
                    json!({"rounds": summary.rounds, "apps": summary.apps, "overlaps": summary.overlaps, "worst_takeover_ms": summary.worst_takeover.as_millis() as u64, "faults": summary.faults, "seed": summary.seed}),
                );
            }
            Err(_) => report.row(
                "random faults (nemesis)",
                name,
                "FAILED: a violation or a stuck run; its seed and history window are in the log above".into(),
                "0 overlaps",
                json!({"failed": true}),
            ),
        }
    }
}

/// Runs one section of the benchmark and says on stderr how long it took, so that a slow run can
/// be broken down.
fn timed(section: &str, run: impl FnOnce()) {
    let started = Instant::now();
    run();
    eprintln!(
        "bench: section {section} took {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

/// The binary users run: the release build (LTO, `panic = "abort"`, stripped), built here if need
/// be. Under the bench profile it is the very binary cargo built beside the benchmark; under
/// another (e.g. `--profile dev`, which shares the tests' compile), it is not, and every row must
/// still measure the release binary.
/// The path is the one cargo names in its build report, in the benchmark's own target directory.
fn release_guard() -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory");
    let mut build = Command::new(cargo);
    // Without what cargo set for this run: build scripts that watch such a variable (ring's
    // watches CARGO_MANIFEST_DIR) would see it changed and rebuild everything, here and again at
    // the next `cargo build --release` from a shell.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_BIN_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&&*key)
        {
            build.env_remove(&*key);
        }
    }
    let built = build
        .args(["build", "--release", "--locked", "--bin", "sentinel-guard"])
        .args([
            "--message-format",
            "json-render-diagnostics",
            "--target-dir",
        ])
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .expect("cargo runs");
    assert!(built.status.success(), "cargo build --release failed");
    String::from_utf8_lossy(&built.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|message| message["target"]["name"] == "sentinel-guard")
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .expect("cargo names the release binary it built")
}

fn main() {
    if let Some(code) = timing_app_main() {
        std::process::exit(code);
    }
    // `SENTINEL_BENCH_GUARD=<binary>` measures that binary instead (CI's quick run measures the
    // static build it already has, so that it need not wait for the release build).
    let measured = match std::env::var_os("SENTINEL_BENCH_GUARD") {
        // Named as given to a shell: a relative path is not left to cargo's working directory, nor
        // a bare name to PATH.
        Some(binary) => std::fs::canonicalize(&binary)
            .ok()
            .filter(|path| {
                use std::os::unix::fs::PermissionsExt;
                path.metadata()
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
            .unwrap_or_else(|| {
                panic!(
                    "SENTINEL_BENCH_GUARD={}: no such executable file",
                    PathBuf::from(&binary).display()
                )
            }),
        None => release_guard(),
    };
    eprintln!("bench: measuring {}", measured.display());
    common::measure_guard(measured);
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var_os("SENTINEL_BENCH_QUICK").is_some();
    // `cargo bench` passes `--bench`; anything else that libtest would accept is ignored.
    let settings = Settings {
        quick,
        rounds: if quick { 1 } else { 15 },
    };
    let mut servers = Servers {
        mysql: MariaDb::start(),
        postgres: Postgres::start(),
        redis: Redis::start(),
        files: Lab::new(),
        etcd: Etcd::start(),
    };
    // Scheduled jobs keep their claims in a table; PostgreSQL 15 lets only the owner create in `public`.
    servers.postgres.sql(&format!(
        "GRANT CREATE ON SCHEMA public TO {}",
        common::postgres::USER
    ));
    let mut report = Report { rows: Vec::new() };
    let only = std::env::var("SENTINEL_BENCH_ONLY").ok();
    let wanted = |section: &str| {
        only.as_deref()
            .is_none_or(|only| only.split(',').any(|s| s.trim() == section))
    };
    if wanted("startup") {
        timed("startup", || startup(&mut report, &servers, &settings));
    }
    if wanted("detection") {
        timed("detection", || {
            detection(&mut report, &mut servers, &settings)
        });
    }
    if wanted("freeze") {
        timed("freeze", || tree_freeze(&mut report, &servers, &settings));
    }
    if wanted("takeover") {
        timed("takeover", || takeover(&mut report, &servers, &settings));
    }
    if wanted("footprint") {
        timed("footprint", || {
            footprint_and_idle(&mut report, &servers, &settings)
        });
    }
    if wanted("memory") {
        timed("memory", || memory(&mut report, &servers, &settings));
    }
    if wanted("scale") {
        timed("scale", || scale(&mut report, &servers, &settings));
    }
    if wanted("crowd") {
        timed("crowd", || crowd(&mut report, &servers, &settings));
    }
    if wanted("scheduled") {
        timed("scheduled", || scheduled(&mut report, &servers, &settings));
    }
    if wanted("redis_failover") {
        timed("redis_failover", || redis_failover(&mut report, &settings));
    }
    // Half an hour or more: only when named.
    if only
        .as_deref()
        .is_some_and(|only| only.split(',').any(|s| s.trim() == "nemesis"))
    {
        nemesis(&mut report);
    }

    let mut table = String::from(
        "| scenario | backend | median / p90 / max, or value | target |\n|---|---|---|---|\n",
    );
    for (what, text, target, _) in &report.rows {
        table.push_str(&format!("| {what} | {text} | {target} |\n"));
    }
    println!("{table}");
    let json = json!({
        "quick": settings.quick,
        "rounds": settings.rounds,
        "rows": report.rows.iter().map(|(what, text, target, value)| json!({"scenario": what, "result": text, "target": target, "data": value})).collect::<Vec<_>>(),
    });
    let out: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("bench");
    fs::create_dir_all(&out).unwrap();
    fs::write(
        out.join("guard.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    eprintln!("wrote {}", out.join("guard.json").display());
}
