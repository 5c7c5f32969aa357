//! Shared test helpers: private MariaDB servers, the guard command builder, app scripts that leave
//! observable traces, and waiting on conditions with deadlines.
#![allow(dead_code)] // each test binary uses a different subset

pub mod endpoints;
pub mod etcd;
pub mod freeze;
pub mod mariadb;
pub mod nemesis;
pub mod netns;
pub mod pooler;
pub mod postgres;
pub mod procs;
pub mod proxy;
pub mod redis;
pub mod sentinel;
pub mod tls;

use std::fs;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub use tempfile::TempDir;

pub const GUARD: &str = env!("CARGO_BIN_EXE_sentinel-guard");

/// The binary `Lab::command` runs: `GUARD`, unless the benchmark chose the release binary it
/// measures (`measure_guard`).
static MEASURED_GUARD: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

pub fn guard_binary() -> &'static Path {
    MEASURED_GUARD
        .get()
        .map_or(Path::new(GUARD), PathBuf::as_path)
}

/// Makes every command of these helpers run `binary` rather than the one cargo built beside the
/// tests.
pub fn measure_guard(binary: PathBuf) {
    MEASURED_GUARD
        .set(binary)
        .expect("the guard under measure is chosen once");
}

/// Fast timings so fault tests finish in seconds.
pub const FAST: &[&str] = &[
    "--check-interval",
    "200ms",
    "--check-timeout",
    "800ms",
    "--grace-period",
    "2s",
    "--connect-timeout",
    "3s",
];

/// `FAST`, with any flag that `overrides` also sets taken from `overrides`.
pub fn fast_with<'a>(overrides: &[&'a str]) -> Vec<&'a str> {
    let mut v: Vec<&str> = FAST
        .chunks(2)
        .filter(|pair| !overrides.contains(&pair[0]))
        .flatten()
        .copied()
        .collect();
    v.extend_from_slice(overrides);
    v
}

/// `--url url --name name` with `FAST` timings, any of them overridden by `extra`.
/// A guard on `url` holds the lock (a second one exits 1 without starting its app), and gives it
/// back when stopped: the lock is real over whatever `url` reaches the server by.
pub fn assert_lock_works_over(lab: &mut Lab, url: &str) {
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let _ = std::fs::remove_file(&pidfile);
    let mut first = lab.spawn(
        &lock_args(url, "over", &[]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    assert!(
        wait_until(Duration::from_secs(20), || pidfile.exists()),
        "{url}: the app did not start: {}",
        first.log_text()
    );
    let marker = lab.path("second-ran");
    let (code, log) = lab.run(
        &lock_args(url, "over", &[]),
        &["sh", "-c", &format!("touch {}", marker.display())],
        Duration::from_secs(10),
    );
    assert_eq!(code, 1, "{url}: {log}");
    assert!(!marker.exists(), "{url}: the second app must never start");
    first.signal(15);
    assert_eq!(
        first.code(Duration::from_secs(10)),
        0,
        "{url}: {}",
        first.log_text()
    );
}

pub fn lock_args<'a>(url: &'a str, name: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", name];
    v.extend(fast_with(extra));
    v
}

/// Short Redis lease timings that keep the startup rule:
/// ttl 3s - margin 130ms - grace 1s = 1.87s >= renew 500ms + check-timeout 500ms.
pub const REDIS_LEASE: &[&str] = &[
    "--ttl",
    "3s",
    "--renew-interval",
    "500ms",
    "--check-timeout",
    "500ms",
    "--grace-period",
    "1s",
];

/// Short etcd lease timings that keep the startup rule, with room for a member's failover:
/// ttl 4s - margin 140ms - grace 1s = 2.86s >= renew 500ms + check-timeout 1s.
pub const ETCD_LEASE: &[&str] = &[
    "--ttl",
    "4s",
    "--renew-interval",
    "500ms",
    "--check-timeout",
    "1s",
    "--grace-period",
    "1s",
    "--connect-timeout",
    "2s",
];

/// A loopback port that no other test process uses, for a server this test starts.
pub fn free_port() -> u16 {
    use nix::fcntl::{Flock, FlockArg};
    use std::hash::{BuildHasher, RandomState};
    use std::sync::Mutex;
    // Claims live as long as this test process: its kernel releases the locks when it exits, however
    // it exits.
    static CLAIMS: Mutex<Vec<Flock<fs::File>>> = Mutex::new(Vec::new());
    // Test binaries run in parallel (cargo nextest), each starting servers on ports it picked: a
    // port the kernel handed out for `bind(0)` and released is soon handed out again, to another
    // test's server or to an outgoing connection. So ports are picked below the kernel's ephemeral
    // range (32768-60999, where outgoing connections get theirs), and each is claimed by an flock
    // on a file named after it that every test process honours.
    let dir = Path::new("/tmp/sentinel-guard-test-ports");
    fs::create_dir_all(dir).unwrap();
    let random = RandomState::new();
    for attempt in 0u32..10_000 {
        let port = 20_000 + (random.hash_one(attempt) % 10_000) as u16;
        let file = fs::File::create(dir.join(port.to_string())).unwrap();
        let Ok(claim) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            CLAIMS.lock().unwrap_or_else(|e| e.into_inner()).push(claim);
            return port;
        }
    }
    panic!("no free loopback port in 20000-29999");
}

/// A fresh directory for a server's data or a lab's files, in memory (`/dev/shm`) where the
/// machine has it. The servers fsync (etcd at every vote and write, InnoDB at every commit), and
/// on a disk that the builds running beside the tests keep busy one fsync, or one file created or
/// removed, could wait seconds behind their writes: longer than a lease a test holds. A container's `/dev/shm` (64 MiB by default) is too small for a database server: then the disk.
pub fn scratch_dir() -> tempfile::TempDir {
    const ROOM: u64 = 2 << 30;
    let shm = Path::new("/dev/shm");
    let writable = nix::unistd::access(shm, nix::unistd::AccessFlags::W_OK).is_ok();
    let roomy = nix::sys::statvfs::statvfs(shm)
        .is_ok_and(|fs| fs.blocks_available() * fs.fragment_size() >= ROOM);
    if shm.is_dir() && writable && roomy {
        if let Ok(dir) = tempfile::tempdir_in(shm) {
            return dir;
        }
    }
    tempfile::tempdir().unwrap()
}

/// A directory made once per build under the tests' temp dir by `init` (given a fresh staging
/// path), then kept for every later server: initialising a server takes seconds, a copy of the
/// result a fraction of that. `done` tells a finished directory.
pub fn made_once(name: &str, done: impl Fn(&Path) -> bool, init: impl FnOnce(&Path)) -> PathBuf {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let ready = root.join(name);
    if done(&ready) {
        return ready;
    }
    // Test processes run in parallel: one makes the directory while the others wait for it (two
    // server bootstraps at once also collide on their temporary files).
    let _one_maker = nix::fcntl::Flock::lock(
        fs::File::create(root.join(format!("{name}.lock"))).unwrap(),
        nix::fcntl::FlockArg::LockExclusive,
    )
    .unwrap_or_else(|(_, e)| panic!("lock {name}: {e}"));
    if done(&ready) {
        return ready;
    }
    let staging = root.join(format!("{name}.{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    init(&staging);
    // What is there is not done: a maker that was killed half-way left it.
    let _ = fs::remove_dir_all(&ready);
    fs::rename(&staging, &ready).unwrap();
    ready
}

/// Runs `cmd` to completion and panics, with its stderr, unless it succeeds; `what` names the
/// program and how to install it.
pub fn must_run(mut cmd: Command, what: &str) {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} could not run: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs `cmd` (a database client); its trimmed stdout if it succeeded.
pub fn stdout_of(mut cmd: Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A guard given a wrong password (`wrong`, in `url`) exits 69 with the server's own words
/// (`server_says`), and neither `wrong` nor the right password (`right`) is in its log.
pub fn assert_wrong_password_exits_69_unprinted(
    url: &str,
    wrong: &str,
    right: &str,
    server_says: &str,
) {
    let mut lab = Lab::new();
    let mut args = vec!["--url", url, "--name", "auth"];
    args.extend(FAST);
    let (code, log) = lab.run(&args, &["true"], Duration::from_secs(10));
    assert_eq!(code, 69, "{log}");
    assert!(log.contains(server_says), "{log}");
    assert!(
        !log.contains(wrong) && !log.contains(right),
        "password leaked: {log}"
    );
    assert!(log.contains("guard:***@"), "{log}");
}

/// Polls `condition` until it holds or `limit` passes; returns whether it held.
pub fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A guard process under test, with its stderr captured to a file.
pub struct GuardProcess {
    pub child: Child,
    pub log: PathBuf,
}

impl GuardProcess {
    /// The guard's pid as this test sees it; under `unshare` it is the child of the unshare process.
    pub fn pid(&self) -> i32 {
        let spawned = self.child.id() as i32;
        let children = |pid: i32| {
            fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default()
        };
        let is_unshare = fs::read_to_string(format!("/proc/{spawned}/comm"))
            .is_ok_and(|c| c.trim() == "unshare");
        if !is_unshare {
            return spawned;
        }
        let mut pid = None;
        let found = wait_until(Duration::from_secs(5), || {
            pid = children(spawned)
                .split_whitespace()
                .next()
                .and_then(|p| p.parse().ok());
            pid.is_some()
        });
        assert!(found, "unshare started no guard");
        pid.unwrap()
    }

    /// Waits for the guard to exit; panics with its log if it does not within `limit`.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let status = exit_within(&mut self.child, limit);
        status.unwrap_or_else(|| {
            panic!(
                "guard did not exit within {limit:?}; log:\n{}",
                self.log_text()
            )
        })
    }

    pub fn code(&mut self, limit: Duration) -> i32 {
        let status = self.wait(limit);
        status.code().unwrap_or_else(|| {
            panic!(
                "guard died of a signal: {status:?}; log:\n{}",
                self.log_text()
            )
        })
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, signal: i32) {
        send(self.pid(), signal);
    }

    /// SIGTERM, then an exit 0 within 5s: the app stopped and the lock given back. Panics with the
    /// guard's log otherwise.
    pub fn exits_0_on_sigterm(&mut self) {
        self.signal(15);
        assert_eq!(self.code(Duration::from_secs(5)), 0, "{}", self.log_text());
    }
}

impl Drop for GuardProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn send(pid: i32, signal: i32) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid} failed");
}

/// Builds guard invocations that share a scratch directory for logs and app traces.
pub struct Lab {
    pub dir: TempDir,
    started: usize,
    /// Whether guards keep the default takeover setting (`auto`); see `Lab::new`.
    default_takeover: bool,
}

impl Lab {
    /// Guards started here hold no takeover delay unless their flags ask for one
    /// (`SENTINEL_GUARD_TAKEOVER_DELAY=0s`): a fresh lock has no record, and the default would wait
    /// the bound at every first start. For tests of other things than the takeover; the takeover
    /// with defaults is tested in a `Lab::with_default_takeover`.
    pub fn new() -> Lab {
        Lab {
            dir: scratch_dir(),
            started: 0,
            default_takeover: false,
        }
    }

    /// Guards started here keep every default, the takeover setting included.
    pub fn with_default_takeover() -> Lab {
        Lab {
            default_takeover: true,
            ..Lab::new()
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn file_url(&self, name: &str) -> String {
        format!("file://{}", self.path(name).display())
    }

    /// A command line: `sentinel-guard <args> -- <app...>` (no `--` without an app), environment
    /// cleaned of the guard's own vars.
    pub fn command(&self, args: &[&str], app: &[&str]) -> Command {
        let mut cmd = Command::new(guard_binary());
        cmd.args(args);
        if !app.is_empty() {
            cmd.arg("--").args(app);
        }
        for (key, _) in std::env::vars() {
            if key.starts_with("SENTINEL_GUARD_")
                || key == "SINGLE_INSTANCE_GUARD"
                || key == "SENTINEL_TEST_PAUSE_AT"
            {
                cmd.env_remove(key);
            }
        }
        if !self.default_takeover {
            cmd.env("SENTINEL_GUARD_TAKEOVER_DELAY", "0s");
        }
        // The guard's socket for its app, made and removed in the lab (see `scratch_dir`).
        cmd.env("TMPDIR", self.dir.path());
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        cmd
    }

    /// The same command line, with the guard as PID 1 of a new PID namespace, as in a container.
    pub fn command_as_pid1(&self, args: &[&str], app: &[&str]) -> Command {
        launched_by(
            &self.command(args, app),
            "unshare",
            &["--pid", "--fork", "--mount-proc", "--kill-child"],
        )
    }

    pub fn start(&mut self, mut cmd: Command) -> GuardProcess {
        self.started += 1;
        let log = self.path(&format!("guard-{}.log", self.started));
        cmd.stderr(fs::File::create(&log).unwrap());
        GuardProcess {
            child: cmd.spawn().unwrap(),
            log,
        }
    }

    pub fn spawn(&mut self, args: &[&str], app: &[&str]) -> GuardProcess {
        let cmd = self.command(args, app);
        self.start(cmd)
    }

    /// Runs to completion and returns (exit code, stderr).
    pub fn run(&mut self, args: &[&str], app: &[&str], limit: Duration) -> (i32, String) {
        let mut guard = self.spawn(args, app);
        let code = guard.code(limit);
        (code, guard.log_text())
    }
}

/// A preloaded library that moves the wall clock (`CLOCK_REALTIME` and what reads it:
/// `gettimeofday`, `time`) by `SENTINEL_TEST_CLOCK_SKEW_NS` and leaves every other clock alone, as
/// a host whose clock is wrong has it. Debian's libfaketime also moves `CLOCK_BOOTTIME`, and with it
/// the absolute deadlines the guard arms its boot-clock timers with, which no wrong wall clock does
/// (a guard skewed further back than the machine's uptime could not arm its timer at all).
const WALL_CLOCK_SKEW_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long skew_ns(void) {
    const char *s = getenv("SENTINEL_TEST_CLOCK_SKEW_NS");
    return s ? atoll(s) : 0;
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + skew_ns();
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) shift(ts);
    return r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
"#;

/// Skews the wall clock of `cmd`, and of everything it starts, by `skew` (`+90s`, `-10m`): see
/// `WALL_CLOCK_SKEW_C`. The library is built once per build with gcc.
pub fn skew_wall_clock(cmd: &mut Command, skew: &str) {
    let (sign, magnitude) = match skew.strip_prefix('-') {
        Some(rest) => (-1i128, rest),
        None => (1, skew.trim_start_matches('+')),
    };
    let ns = sign * humantime::parse_duration(magnitude).unwrap().as_nanos() as i128;
    let dir = made_once(
        "wall-clock-skew",
        |d| d.join("skew.so").exists(),
        |staging| {
            fs::create_dir_all(staging).unwrap();
            fs::write(staging.join("skew.c"), WALL_CLOCK_SKEW_C).unwrap();
            let mut gcc = Command::new("gcc");
            gcc.args(["-shared", "-fPIC", "-O2", "-o"])
                .arg(staging.join("skew.so"))
                .arg(staging.join("skew.c"))
                .arg("-ldl");
            must_run(gcc, "gcc (apt-get install gcc)");
        },
    );
    cmd.env("LD_PRELOAD", dir.join("skew.so"))
        .env("SENTINEL_TEST_CLOCK_SKEW_NS", ns.to_string());
}

/// `cmd` started by `launcher launcher_args... program args...`, with `cmd`'s environment changes
/// carried over; stdin and stdout are null.
pub fn launched_by(cmd: &Command, launcher: &str, launcher_args: &[&str]) -> Command {
    let mut wrapped = Command::new(launcher);
    wrapped
        .args(launcher_args)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    wrapped.stdin(Stdio::null()).stdout(Stdio::null());
    wrapped
}

/// A leader running `recording_app` and a `--wait` standby behind it on the same lock, both
/// recording into one trace: the setup of every no-overlap test.
pub struct LeaderAndStandby {
    pub leader: GuardProcess,
    pub lead_app: i32,
    pub standby: GuardProcess,
    pub standby_pid: PathBuf,
    pub trace: PathBuf,
}

impl LeaderAndStandby {
    /// Lock `name` on `backend` with its fast timings; returns once the leader's app runs and the
    /// standby waits.
    pub fn start(lab: &mut Lab, backend: &Backend, name: &str) -> LeaderAndStandby {
        let url = backend.url();
        let mut args = vec!["--url", url.as_str(), "--name", name];
        args.extend(backend.fast_args());
        let trace = lab.path("trace");
        let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
        let leader = lab.spawn(&args, &as_strs(&recording_app(&trace, &lead_pid)));
        let lead_app = read_pid(&lead_pid, Duration::from_secs(10));
        let standby = waiting_standby(lab, &args, &as_strs(&recording_app(&trace, &standby_pid)));
        LeaderAndStandby {
            leader,
            lead_app,
            standby,
            standby_pid,
            trace,
        }
    }
}

/// Waits for `guard` to exit 75 (lock lost) with `reason=<reason>` in its log.
pub fn assert_lost_with(guard: &mut GuardProcess, reason: &str) {
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        75,
        "{}",
        guard.log_text()
    );
    let log = guard.log_text();
    assert!(log.contains(&format!("reason={reason}")), "{log}");
}

/// Polls `child` until it exits or `limit` passes.
pub fn exit_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let mut status = None;
    wait_until(limit, || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    status
}

/// A guard started with `args` plus `--wait`, running `app`, once it says it is waiting.
pub fn waiting_standby(lab: &mut Lab, args: &[&str], app: &[&str]) -> GuardProcess {
    let mut standby_args = args.to_vec();
    standby_args.push("--wait");
    let standby = lab.spawn(&standby_args, app);
    assert!(
        wait_until(Duration::from_secs(10), || standby
            .log_text()
            .contains("waiting")),
        "standby never waited: {}",
        standby.log_text()
    );
    standby
}

/// An app that records `start <pid>` in `trace`, then writes its pid to `pidfile` (so a pid implies a
/// recorded start), and on SIGTERM records `stop <pid>` and exits 0.
pub fn recording_app(trace: &Path, pidfile: &Path) -> Vec<String> {
    let script = format!(
        "trap 'echo stop $$ >> {trace}; exit 0' TERM; echo start $$ >> {trace}; \
         echo $$ > {pid}.tmp && mv {pid}.tmp {pid}; while :; do sleep 0.05; done",
        pid = pidfile.display(),
        trace = trace.display()
    );
    vec!["sh".into(), "-c".into(), script]
}

/// The fencing token the app sees when a guard started with `args` takes the lock (round `round`).
pub fn token_seen_by_app(lab: &mut Lab, args: &[&str], round: usize) -> u64 {
    let out = lab.path(&format!("token-{round}"));
    let script = format!("echo $SENTINEL_GUARD_FENCING_TOKEN > {}", out.display());
    let (code, log) = lab.run(args, &["sh", "-c", &script], Duration::from_secs(10));
    assert_eq!(code, 0, "{log}");
    fs::read_to_string(&out)
        .unwrap()
        .trim()
        .parse::<u64>()
        .unwrap()
}

pub fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

pub fn read_pid(pidfile: &Path, limit: Duration) -> i32 {
    let mut pid = None;
    let found = wait_until(limit, || {
        pid = fs::read_to_string(pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok());
        pid.is_some()
    });
    assert!(found, "no pid in {} within {limit:?}", pidfile.display());
    pid.unwrap()
}

/// A single-process app that appends the name of each listed signal it receives to `trace` and exits
/// 0 on the last one. The signals are blocked and taken with sigwait, so job-control signals are
/// recorded instead of stopping it (a shell would be stopped through its `sleep` child).
pub fn signal_recorder(trace: &Path, ready: &Path, signals: &[&str]) -> Vec<String> {
    let script = r#"
import signal, sys
trace, ready, names = sys.argv[1], sys.argv[2], sys.argv[3:]
wanted = [getattr(signal, "SIG" + n) for n in names]
signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
open(ready, "w").close()
while True:
    got = signal.sigwait(wanted)
    with open(trace, "a") as f:
        f.write(signal.Signals(got).name[3:] + "\n")
    if got == wanted[-1]:
        sys.exit(0)
"#;
    let mut argv = vec!["python3".to_owned(), "-c".to_owned(), script.to_owned()];
    argv.push(trace.display().to_string());
    argv.push(ready.display().to_string());
    argv.extend(signals.iter().map(|s| s.to_string()));
    argv
}

/// Translates a pid a process wrote from inside the guard's PID namespace into the pid this test
/// sees, by finding the descendant of `guard` whose last NSpid entry is `inner`.
pub fn outer_pid(guard: i32, inner: i32) -> i32 {
    let Ok(dir) = fs::read_dir("/proc") else {
        return inner;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let status = fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let nspid: Vec<i32> = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .map(|l| {
                l.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        if nspid.len() > 1 && nspid.last() == Some(&inner) && descends_from(pid, guard) {
            return pid;
        }
    }
    inner
}

fn descends_from(mut pid: i32, ancestor: i32) -> bool {
    while pid > 1 {
        if pid == ancestor {
            return true;
        }
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
        else {
            return false;
        };
        pid = ppid;
    }
    false
}

/// Children of `parent` that have exited but were not reaped.
pub fn zombie_children(parent: i32) -> usize {
    let Ok(dir) = fs::read_dir("/proc") else {
        return 0;
    };
    dir.flatten()
        .filter_map(|e| fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let mut fields = rest.split_whitespace();
            fields.next() == Some("Z") && fields.next() == Some(parent.to_string().as_str())
        })
        .count()
}

/// Processes whose command line mentions `dir`: every app of a round or a run does, through the
/// trace or history path it writes to.
pub fn survivors(dir: &Path) -> Vec<i32> {
    let needle = dir.to_string_lossy().into_owned();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != std::process::id() as i32 && alive(*pid))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                .unwrap_or(false)
        })
        .collect()
}

/// The entries of `dir` named `<prefix><pid>-...` whose pid no longer runs, or now runs this
/// process: what a test process that was killed left behind.
pub fn left_by_dead_tests(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(listed) = fs::read_dir(dir) else {
        return Vec::new();
    };
    listed
        .flatten()
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .strip_prefix(prefix)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<i32>().ok())
                .is_some_and(|pid| !alive(pid) || pid == std::process::id() as i32)
        })
        .map(|entry| entry.path())
        .collect()
}

/// Alive and not a zombie.
pub fn alive(pid: i32) -> bool {
    let mut stat = String::new();
    match fs::File::open(format!("/proc/{pid}/stat")) {
        Ok(mut f) => {
            let _ = f.read_to_string(&mut stat);
        }
        Err(_) => return false,
    }
    let state = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some(Some('Z')) | Some(Some('X')) | None)
}

pub fn trace_lines(trace: &Path) -> Vec<String> {
    fs::read_to_string(trace)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Asserts that no two app lifetimes in a trace of `start <id>` / `stop <id>` lines overlap, and
/// returns how many apps ran.
pub fn assert_no_overlap(trace: &Path) -> usize {
    let lines = trace_lines(trace);
    let mut running: Option<String> = None;
    let mut started = 0;
    for line in &lines {
        match line.split_once(' ') {
            Some(("start", id)) => {
                assert!(
                    running.is_none(),
                    "app {id} started while {running:?} ran: {lines:?}"
                );
                running = Some(id.to_owned());
                started += 1;
            }
            Some(("stop", id)) => {
                assert_eq!(running.as_deref(), Some(id), "unexpected stop: {lines:?}");
                running = None;
            }
            _ => panic!("bad trace line {line:?}"),
        }
    }
    started
}

/// A lock backend under test: a private server, or a file.
pub enum Backend {
    Mysql(mariadb::MariaDb),
    Postgres(postgres::Postgres),
    Redis(redis::Redis),
    /// Not in `all()`: the fault matrix and `tests/etcd_backend.rs` use it.
    Etcd(etcd::Etcd),
    /// A primary, two replicas and three sentinels; not in `all()`: the nemesis uses it.
    Sentinel(sentinel::Sentinels),
    File(Lab),
}

impl Backend {
    pub fn all() -> Vec<Backend> {
        vec![
            Backend::Mysql(mariadb::MariaDb::start()),
            Backend::Postgres(postgres::Postgres::start()),
            Backend::Redis(redis::Redis::start()),
            Backend::File(Lab::new()),
        ]
    }

    pub fn url(&self) -> String {
        match self {
            Backend::Mysql(db) => db.url(),
            Backend::Postgres(db) => db.url(),
            Backend::Redis(redis) => redis.url(),
            Backend::Etcd(etcd) => etcd.url(),
            Backend::Sentinel(group) => group.url(),
            Backend::File(lab) => lab.file_url("backend.lock"),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Mysql(_) => "mysql",
            Backend::Postgres(_) => "postgres",
            Backend::Redis(_) => "redis",
            Backend::Etcd(_) => "etcd",
            Backend::Sentinel(_) => "redis+sentinel",
            Backend::File(_) => "file",
        }
    }

    /// Guard flags with short timings that are valid for this backend.
    pub fn fast_args(&self) -> Vec<&'static str> {
        match self {
            Backend::Redis(_) => fast_with(REDIS_LEASE),
            Backend::Etcd(_) => fast_with(ETCD_LEASE),
            // A lease that outlives a failover, confirmed on a replica: without one, a failover
            // may lose an acquisition the old primary had granted (README, "Redis Sentinel").
            Backend::Sentinel(_) => {
                let mut args = fast_with(sentinel::FAILOVER_LEASE);
                args.extend(["--redis-min-replicas", "1"]);
                args
            }
            _ => FAST.to_vec(),
        }
    }
}
