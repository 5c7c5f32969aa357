//! A cgroup v1 freezer, to stop a guard, its app and its watchdog all at the same instant: unlike
//! SIGSTOP to the guard alone, nothing of the tree can act while frozen, and all of it resumes
//! together at thaw, which is when a stale lock must be noticed.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::{launched_by, wait_until, GuardProcess};

const FREEZER_ROOT: &str = "/sys/fs/cgroup/freezer";

/// A private freezer cgroup; dropping it thaws it, kills whatever is left in it and removes it.
pub struct Freezer {
    dir: PathBuf,
}

impl Freezer {
    /// Creates `/sys/fs/cgroup/freezer/sg-test-<pid>-<n>`; needs root and a v1 freezer hierarchy.
    /// The first one of a process first empties and removes those a killed test process left
    /// (its pid no longer runs, or now runs this process): their trees would stay frozen for ever.
    pub fn create() -> Freezer {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        if n == 0 {
            remove_stale();
        }
        let dir = Path::new(FREEZER_ROOT).join(format!("sg-test-{}-{n}", std::process::id()));
        fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "cannot create {} (needs root and the cgroup v1 freezer): {e}",
                dir.display()
            )
        });
        Freezer { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `cmd`, started through a shell that first moves itself into this cgroup and then execs the
    /// program, so the program and everything it ever forks live in the cgroup from their first
    /// instruction. Arguments and environment changes are carried over; stdin and stdout are null.
    pub fn command(&self, cmd: &Command) -> Command {
        let script = format!(
            "echo $$ > '{}/cgroup.procs' && exec \"$0\" \"$@\"",
            self.dir.display()
        );
        launched_by(cmd, "sh", &["-c", &script])
    }

    /// Every process in the cgroup.
    pub fn procs(&self) -> Vec<i32> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    pub fn state(&self) -> String {
        fs::read_to_string(self.dir.join("freezer.state"))
            .unwrap_or_default()
            .trim()
            .to_owned()
    }

    /// Freezes every process in the cgroup; returns once the kernel reports all of them frozen
    /// (the state passes through FREEZING while tasks are still being stopped).
    ///
    /// A v1 freezer can stay in FREEZING when it catches a task at a moment it cannot stop (seen
    /// right after the guard forked); thawing and freezing again gets past it.
    pub fn freeze(&self) {
        for _ in 0..5 {
            fs::write(self.dir.join("freezer.state"), "FROZEN").unwrap();
            if wait_until(Duration::from_secs(2), || self.state() == "FROZEN") {
                return;
            }
            fs::write(self.dir.join("freezer.state"), "THAWED").unwrap();
        }
        panic!("cgroup stuck in state {}", self.state());
    }

    /// Thaws the cgroup; returns the wall-clock time taken just before the write, so anything the
    /// thawed processes record afterwards can be compared with it.
    pub fn thaw(&self) -> SystemTime {
        let at = SystemTime::now();
        fs::write(self.dir.join("freezer.state"), "THAWED").unwrap();
        at
    }
}

impl Drop for Freezer {
    /// Never panics (it may run while a test unwinds): failures are reported on stderr.
    fn drop(&mut self) {
        // A frozen task cannot die, even of SIGKILL, until it is thawed.
        let _ = fs::write(self.dir.join("freezer.state"), "THAWED");
        // rmdir only succeeds on an empty cgroup; re-read the list, since a dying parent's children
        // may still fork or be reparented while we kill.
        let emptied = wait_until(Duration::from_secs(10), || {
            let procs = self.procs();
            for pid in &procs {
                let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
            }
            procs.is_empty()
        });
        // The kernel may report the cgroup busy for a moment after its last task left.
        let removed = wait_until(Duration::from_secs(5), || {
            fs::remove_dir(&self.dir).is_ok() || !self.dir.exists()
        });
        if !emptied || !removed {
            eprintln!(
                "could not clean up {} (left: {:?})",
                self.dir.display(),
                self.procs()
            );
        }
    }
}

fn remove_stale() {
    for dir in super::left_by_dead_tests(Path::new(FREEZER_ROOT), "sg-test-") {
        // Dropping it thaws it, kills what is in it and removes it.
        drop(Freezer { dir });
    }
}

/// A guard started inside a freezer cgroup. Dropping it thaws the cgroup *before* the guard is
/// killed and waited for: waiting on a frozen process would hang the test forever.
pub struct FrozenGuard {
    // Field order is drop order: the guard is killed and reaped, then the cgroup is emptied and
    // removed.
    pub guard: GuardProcess,
    pub cgroup: Freezer,
}

impl Drop for FrozenGuard {
    fn drop(&mut self) {
        let _ = fs::write(self.cgroup.dir().join("freezer.state"), "THAWED");
    }
}
