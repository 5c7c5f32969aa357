//! A cgroup of the guard's own for the app: the one boundary a process of the app cannot leave. A
//! helper that daemonizes (`setsid`, a double fork) leaves the app's process group, and after a
//! guard's death leaves the guard's subtree too; it never leaves its cgroup. So the guard and the
//! watchdog stop the cgroup as a whole, and "the app's tree is gone" includes "its cgroup is empty".
//!
//! A process may still be moved out by someone allowed to write the guard's own cgroup (the app's
//! user, where the guard made the cgroup as that user): the cgroup is a boundary against `setsid`
//! and double forks, not against a hostile app, and while the guard lives its descendants are
//! reached too.
//!
//! Made below the guard's own cgroup, on the unified (v2) hierarchy where the guard may write there
//! (root, or a delegated subtree such as systemd's `Delegate=yes`), else on a v1 freezer hierarchy.
//! Where neither is possible (a container with a read-only cgroup mount), there is none, and the
//! process group and the guard's children lists are all there is to go by.

use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{openat, OFlag, AT_FDCWD};
use nix::sys::signal::{kill, Signal};
use nix::sys::stat::Mode;
use nix::unistd::{faccessat, getpgid, getpid, AccessFlags, Pid};

use crate::deadline::Deadline;

/// How long a freeze may take to settle before the members are read anyway: a frozen cgroup's list
/// cannot grow, one still freezing may (a fork in progress).
const FREEZE_SETTLE: Duration = Duration::from_millis(50);

/// How the cgroup's processes are stopped at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `cgroup.kill` (Linux 5.14): one write SIGKILLs every process in it, new forks included.
    V2Kill,
    /// `cgroup.freeze` (Linux 5.2): frozen, its list cannot grow while each member is SIGKILLed.
    V2Freeze,
    /// The v1 freezer's `freezer.state`, the same way.
    V1Freezer,
}

/// How the app's process enters the app's cgroup. Born into it by `clone3(CLONE_INTO_CGROUP)` where
/// the kernel (5.7) and the hierarchy (v2) allow, else by writing itself to the procs file before it
/// runs the command. Being born into it is also fast: a write to `cgroup.procs` waits for an RCU
/// grace period (about 11 ms here, `strace -f -tt`), which every start and hand-over paid.
pub struct Entry {
    pub dir: Option<fs::File>,
    pub procs: fs::File,
}

/// The app's cgroup, by its directory.
#[derive(Debug)]
pub struct AppCgroup {
    dir: PathBuf,
    kind: Kind,
}

impl AppCgroup {
    /// Makes the app's cgroup below the guard's own; the reason, in words, where none can be made.
    pub fn create() -> Result<AppCgroup, String> {
        let own = own_cgroups(
            &fs::read_to_string("/proc/self/cgroup")
                .map_err(|e| format!("/proc/self/cgroup: {e}"))?,
            &fs::read_to_string("/proc/self/mountinfo")
                .map_err(|e| format!("/proc/self/mountinfo: {e}"))?,
        );
        if own.is_empty() {
            return Err("no cgroup v2 or v1 freezer hierarchy is mounted".to_owned());
        }
        let mut reasons = Vec::new();
        for parent in own {
            match make_below(&parent) {
                Ok(cgroup) => return Ok(cgroup),
                Err(e) => reasons.push(format!("{}: {e}", parent.display())),
            }
        }
        Err(reasons.join("; "))
    }

    /// The watchdog's view of the cgroup the guard made.
    pub fn open(dir: PathBuf) -> io::Result<AppCgroup> {
        let kind = kind_of(&dir)?;
        Ok(AppCgroup { dir, kind })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The ways in for the app's process: the procs file, opened through the directory so the two
    /// name one cgroup, and on v2 the directory itself for `clone3(CLONE_INTO_CGROUP)`.
    pub fn entry(&self) -> io::Result<Entry> {
        let dir = fs::File::options()
            .read(true)
            .custom_flags(nix::libc::O_DIRECTORY)
            .open(&self.dir)?;
        let procs = openat(
            &dir,
            "cgroup.procs",
            OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Entry {
            dir: matches!(self.kind, Kind::V2Kill | Kind::V2Freeze).then_some(dir),
            procs: fs::File::from(procs),
        })
    }

    /// The processes in it and in any cgroup the app made below it. A list that cannot be read is an
    /// error, never an empty cgroup. A process outside this PID namespace is listed as 0, which
    /// would name the reader's own group to kill(2): such entries are left out.
    pub fn members(&self) -> io::Result<Vec<Pid>> {
        let mut found = Vec::new();
        let mut dirs = vec![self.dir.clone()];
        while let Some(dir) = dirs.pop() {
            found.extend(
                fs::read_to_string(dir.join("cgroup.procs"))?
                    .split_whitespace()
                    .filter_map(|pid| pid.parse().ok())
                    .filter(|pid| *pid > 0)
                    .map(Pid::from_raw),
            );
            for entry in fs::read_dir(&dir)? {
                let entry = entry?;
                if entry.file_type()?.is_dir() {
                    dirs.push(entry.path());
                }
            }
        }
        Ok(found)
    }

    /// Whether no process of it (or below it) is alive any more (v2: `populated 0`, which counts
    /// exited but unreaped processes as gone; v1: empty lists).
    pub fn is_empty(&self) -> io::Result<bool> {
        match self.kind {
            Kind::V2Kill | Kind::V2Freeze => {
                Ok(fs::read_to_string(self.dir.join("cgroup.events"))?
                    .lines()
                    .any(|line| line == "populated 0"))
            }
            Kind::V1Freezer => Ok(self.members()?.is_empty()),
        }
    }

    /// Sends `signal` to each of its processes outside the process group `group` (which is signalled
    /// as a whole: no process gets it twice); returns those signalled. Ones forked meanwhile are
    /// found by the next call; SIGKILL should go through `kill`, which cannot miss them.
    pub fn signal_outside(&self, group: Pid, signal: Signal) -> Vec<Pid> {
        let mut outside = self.members().unwrap_or_default();
        outside.retain(|pid| getpgid(Some(*pid)).is_ok_and(|g| g != group));
        super::pidfd::signal_listed(&outside, || self.members(), signal)
    }

    /// SIGKILLs every process in it, including any being forked (`cgroup.kill`). Where that takes a
    /// freeze, a fork that was under way may still slip through: callers that must see the cgroup
    /// empty call again until it is.
    pub fn kill(&self) -> io::Result<()> {
        let (freeze, frozen, thawed) = match self.kind {
            Kind::V2Kill => return fs::write(self.dir.join("cgroup.kill"), "1"),
            Kind::V2Freeze => ("cgroup.freeze", "1", "0"),
            Kind::V1Freezer => ("freezer.state", "FROZEN", "THAWED"),
        };
        let state = self.dir.join(freeze);
        fs::write(&state, frozen)?;
        let settled = Deadline::after(FREEZE_SETTLE);
        while !self.frozen() && !settled.has_passed() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let killed = self.members().map(|members| {
            for pid in members {
                let _ = kill(pid, Signal::SIGKILL);
            }
        });
        // Thawed even when the list could not be read, and tried again if the first write fails: a
        // frozen app would hold the lock for ever. A SIGKILLed process dies as it thaws.
        let thawed = fs::write(&state, thawed).or_else(|_| fs::write(&state, thawed));
        killed.and(thawed)
    }

    fn frozen(&self) -> bool {
        match self.kind {
            Kind::V2Kill => true,
            Kind::V2Freeze => fs::read_to_string(self.dir.join("cgroup.events"))
                .is_ok_and(|events| events.lines().any(|line| line == "frozen 1")),
            Kind::V1Freezer => fs::read_to_string(self.dir.join("freezer.state"))
                .is_ok_and(|state| state.trim() == "FROZEN"),
        }
    }

    /// A cgroup below this one, made if it is not there yet: stopped with this one (its members
    /// are this one's too), and on its own.
    pub fn child(&self, name: &str) -> io::Result<AppCgroup> {
        let dir = self.dir.join(name);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        Ok(AppCgroup {
            dir,
            kind: self.kind,
        })
    }

    /// Removes the cgroup once it is empty; a busy one (a process not yet gone) is left in place.
    /// Whether it is gone.
    pub fn remove(&self) -> bool {
        fs::remove_dir(&self.dir).is_ok()
    }
}

/// The guard's own cgroup directories, best first: the unified hierarchy's, then the v1 freezer's.
fn own_cgroups(cgroup: &str, mountinfo: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let membership = |wanted: &dyn Fn(&str) -> bool| {
        cgroup.lines().find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            wanted(controllers).then_some(path)
        })
    };
    let v2 = membership(&|controllers| controllers.is_empty());
    let v1 = membership(&|controllers| controllers.split(',').any(|c| c == "freezer"));
    for (path, fstype, option) in [(v2, "cgroup2", None), (v1, "cgroup", Some("freezer"))] {
        let Some(path) = path else { continue };
        if let Some(dir) = mount_of(mountinfo, fstype, option, Path::new(path)) {
            found.push(dir);
        }
    }
    found
}

/// Where the cgroup `path` is seen: below the last-listed (so topmost) mount of `fstype`, with
/// `option` among its super options, whose root contains `path`. Mount points with escaped
/// characters (a space, say) are passed over.
fn mount_of(mountinfo: &str, fstype: &str, option: Option<&str>, path: &Path) -> Option<PathBuf> {
    mountinfo.lines().rev().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        let mut mount = mount.split(' ');
        let (root, point) = (mount.nth(3)?, mount.next()?);
        let mut fs = fs.split(' ');
        let (kind, _, options) = (fs.next()?, fs.next()?, fs.next()?);
        let wanted = kind == fstype
            && option.is_none_or(|o| options.split(',').any(|x| x == o))
            && !point.contains('\\')
            && !root.contains('\\');
        let below = path.strip_prefix(root).ok()?;
        // `/../x`: a cgroup outside this namespace's root, which no path below the mount names.
        let inside = !below
            .components()
            .any(|part| part == std::path::Component::ParentDir);
        (wanted && inside).then(|| Path::new(point).join(below))
    })
}

/// Makes `sentinel-guard-<pid>-<boot clock ns>` below `parent`: a name no other guard uses (pids
/// repeat across PID namespaces, and every guard that is PID 1 has the same one), so an existing
/// directory is never adopted. Moving the app's process there needs write access to the procs file
/// of `parent` too (the common ancestor of where it is and where it goes), and a domain cgroup (a
/// threaded one takes no processes of a new child), so both are checked first.
fn make_below(parent: &Path) -> io::Result<AppCgroup> {
    faccessat(
        AT_FDCWD,
        &parent.join("cgroup.procs"),
        AccessFlags::W_OK,
        nix::fcntl::AtFlags::AT_EACCESS,
    )?;
    if let Ok(kind) = fs::read_to_string(parent.join("cgroup.type")) {
        if !kind.trim().starts_with("domain") || kind.contains("invalid") {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("a {} cgroup takes no new child's processes", kind.trim()),
            ));
        }
    }
    let dir = parent.join(format!(
        "sentinel-guard-{}-{}",
        getpid(),
        Deadline::now().as_nanos()
    ));
    fs::create_dir(&dir)?;
    match kind_of(&dir) {
        Ok(kind) => Ok(AppCgroup { dir, kind }),
        Err(e) => {
            let _ = fs::remove_dir(&dir);
            Err(e)
        }
    }
}

fn kind_of(dir: &Path) -> io::Result<Kind> {
    let has = |file: &str| dir.join(file).exists();
    if has("cgroup.kill") {
        Ok(Kind::V2Kill)
    } else if has("cgroup.freeze") {
        Ok(Kind::V2Freeze)
    } else if has("freezer.state") {
        Ok(Kind::V1Freezer)
    } else {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "no cgroup.kill, cgroup.freeze or freezer.state",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 /kubepods/pod1 /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn the_guards_own_cgroups_are_found_below_their_mounts() {
        let cgroup = "6:freezer:/jobs\n1:name=systemd:/x\n0::/kubepods/pod1/app\n";
        assert_eq!(
            own_cgroups(cgroup, MOUNTINFO),
            [
                PathBuf::from("/sys/fs/cgroup/unified/app"),
                PathBuf::from("/sys/fs/cgroup/freezer/jobs"),
            ]
        );
        // A cgroup outside the mounted subtree cannot be reached.
        assert_eq!(
            own_cgroups("0::/elsewhere\n", MOUNTINFO),
            Vec::<PathBuf>::new()
        );
        assert!(own_cgroups("", "").is_empty());
    }

    #[test]
    fn the_topmost_mount_that_contains_the_cgroup_wins_and_escaped_ones_are_passed_over() {
        let mountinfo = "\
41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
42 31 0:38 /other /mnt/other rw - cgroup2 cgroup2 rw
43 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw
44 31 0:38 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw
";
        assert_eq!(
            mount_of(mountinfo, "cgroup2", None, Path::new("/app")),
            Some(PathBuf::from("/sys/fs/cgroup/app"))
        );
        let escaped = "41 31 0:38 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n";
        assert!(mount_of(escaped, "cgroup2", None, Path::new("/")).is_none());
    }
}
