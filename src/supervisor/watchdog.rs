//! The app's dead man's switch: a second process that stops the app's process group when the guard
//! can no longer do it itself.
//!
//! - **The guard dies** (even by SIGKILL): the app itself dies by PDEATHSIG, but what it forked would
//!   be orphaned. The guard's end of a pipe closes with it; the watchdog sees EOF and SIGKILLs the
//!   app's whole process group. Once the group is gone it says the lock's farewell: it closes its copy
//!   of a locked file's descriptor (the kernel frees the `flock` only then), or runs the backend's
//!   farewell message (MySQL: end the dead guard's session, so a standby takes over at once).
//! - **The guard freezes** (SIGSTOP, a stalled cgroup, a debugger): its lock still ends on the
//!   backend's schedule. The guard keeps telling the watchdog by when its app must be dead if nothing
//!   more is heard; if that moment nears, the watchdog stops the app's group on its own (the stop
//!   signal at `deadline - grace`, SIGKILL at the deadline) and exits with `EXIT_ACTED`, which is how
//!   the guard learns it lost the lock while frozen.
//! - **The whole tree was frozen** (`docker pause`, a suspended host) past the deadline: whichever of
//!   guard and watchdog runs first after the thaw SIGKILLs the group. The watchdog reads the clock
//!   after every wake-up before it reads anything the guard sent, and a deadline that has passed is
//!   never replaced by a later one.
//! - **The guard tears the app down**: it stays armed with `kill_by = min(now + grace, deadline)`,
//!   so a guard frozen or killed half-way through teardown still leaves no app behind.
//!
//! The watchdog is started before the app, so no moment exists in which the app runs and a killed
//! guard would leave it unwatched. It is the guard's own binary run as `sentinel-guard __watchdog
//! <signal> <grace-ns>`. On fd 3 (a pipe) it reads the hand-over (a flag saying whether fd 4 is a
//! locked descriptor to keep, and a length-prefixed farewell message), then 9-byte messages, the
//! first of them the app's group, written by the app's own process between fork and exec. It ignores
//! every catchable signal: only the pipe ends it. All moments are `CLOCK_BOOTTIME` nanoseconds.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use nix::libc;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, sigprocmask, SigSet, SigmaskHow, Signal};
use nix::sys::stat::{fstat, SFlag};
use nix::unistd::{fork, getpid, getppid, pipe2, ForkResult, Pid};
use tracing::{debug, error, info, info_span, warn};
use tracing_appender::non_blocking::WorkerGuard;

use super::cgroup::AppCgroup;
use crate::deadline::{BootTimer, Deadline};
use crate::handoff::Farewell;
use crate::vocab::{AppStatus, LossReason, ENV_BACKEND, ENV_HOLDER_ID, ENV_NAME};

mod exec;
mod protocol;
use exec::{c_strings, env_entry, exec_watchdog, ignored_signals, pointers, ExecPlan};
pub use protocol::Message;
use protocol::{decode_handover, encode_handover, Action, Switch, MESSAGE_LEN};

/// The fd on which the watchdog reads the guard's messages.
const MESSAGE_FD: RawFd = 3;
/// The fd of a locked file the watchdog keeps open until the app's group is gone.
const KEPT_FD: RawFd = 4;
/// The watchdog's exit code after it stopped the app of an unresponsive guard.
const EXIT_ACTED: u8 = 10;

/// Whether the watchdog, ended with `status`, had stopped the app of an unresponsive guard.
pub fn acted(status: AppStatus) -> bool {
    status == AppStatus::Exited(EXIT_ACTED)
}
/// The watchdog starts stopping the app this long after the guard would have: a healthy guard acts
/// first and starts its own teardown, so the two never signal the app together.
const SLACK: Duration = Duration::from_millis(200);
/// How often the watchdog of a dead guard looks whether the app's group is gone, where it cannot
/// wait for the group's processes to exit (no `pidfd_open`).
const GROUP_GONE_POLL: Duration = Duration::from_millis(2);
/// How long the watchdog of a dead guard waits for the processes it found in the app's group to exit
/// before it looks at the group again.
const GROUP_GONE_RECHECK: Duration = Duration::from_millis(100);
/// After this long with app processes surviving SIGKILL, the watchdog says so (and keeps waiting).
const GROUP_GONE_WARN: Duration = Duration::from_secs(2);

/// Runs a backend's farewell message in the watchdog; returns what it did, for the log.
pub type FarewellRunner = fn(&[u8]) -> Result<String, String>;

/// The guard's end: the watchdog's pid and the pipe that feeds it.
pub struct Watchdog {
    pipe: File,
    pid: Pid,
    /// Ends (EOF) once the watchdog's process has executed the watchdog; carries its errno (twice:
    /// once for the app's process, once for the guard) if it could not. The app's process waits on
    /// it before it runs the command (`AppLink`). Closed once the app runs.
    exec_status: Option<OwnedFd>,
    /// A message could not be written because the pipe is full: the watchdog has stopped reading
    /// (stopped or stuck), so it can no longer be counted on.
    jammed: bool,
}

/// What the app's process, between fork and exec, needs of the watchdog: to wait until the
/// watchdog runs, then to write its group down the watchdog's pipe. Both close-on-exec descriptors
/// of the guard.
#[derive(Debug, Clone, Copy)]
pub struct AppLink {
    pub exec_status: RawFd,
    pub pipe: RawFd,
}

impl Watchdog {
    /// Starts the watchdog, before the app, with no deadline yet. `context` names the lock
    /// (`SENTINEL_GUARD_NAME`, `_BACKEND`, `_HOLDER_ID`) so the watchdog's log lines say whose app
    /// it acts on; `hidden` are variables it must not inherit (credentials); `cgroup` is the app's
    /// cgroup, stopped as a whole with its group.
    ///
    /// Forks and returns at once: the guard does not wait for the exec of its binary (about a third of
    /// a millisecond, on the path to the app's start). The app's process waits for it instead, in
    /// parallel with its own fork (`AppLink`), so the command never runs unwatched.
    pub fn spawn(
        (stop_signal, grace): (Signal, Duration),
        context: &[(&str, String)],
        hidden: &[&str],
        farewell: &Farewell<'_>,
        cgroup: Option<&AppCgroup>,
    ) -> io::Result<Watchdog> {
        // Close-on-exec, so the app never inherits an end: a stray write end would keep the pipe
        // open after the guard died.
        let (read_end, write_end) = pipe2(OFlag::O_CLOEXEC)?;
        let (status_read, status_write) = pipe2(OFlag::O_CLOEXEC)?;
        // Never blocks the guard: a watchdog that stops reading must not stall checks and kills.
        fcntl(&write_end, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
        // Everything the child uses is made before the fork: in the child of a process with threads
        // only async-signal-safe calls may run until exec, and allocating is not one.
        let grace = grace.as_nanos().to_string();
        let argv = c_strings([
            "/proc/self/exe".as_bytes(),
            b"__watchdog",
            stop_signal.as_str().as_bytes(),
            grace.as_bytes(),
        ])?;
        let mut set: Vec<(&str, &str)> = context.iter().map(|(k, v)| (*k, v.as_str())).collect();
        set.push((crate::logging::FORMAT_VAR, crate::logging::format_name()));
        let inherited = std::env::vars_os()
            .filter(|(key, _)| {
                !hidden
                    .iter()
                    .chain(set.iter().map(|(k, _)| k))
                    .any(|h| key == h)
            })
            .map(|(key, value)| env_entry(key.as_bytes(), value.as_bytes()));
        let envp = c_strings(
            inherited.chain(
                set.iter()
                    .map(|(k, v)| env_entry(k.as_bytes(), v.as_bytes())),
            ),
        )?;
        let dev_null = File::options().read(true).write(true).open("/dev/null")?;
        let plan = ExecPlan {
            argv: pointers(&argv),
            envp: pointers(&envp),
            message: read_end.as_raw_fd(),
            kept: farewell.keep.map(|fd| fd.as_raw_fd()),
            dev_null: dev_null.as_raw_fd(),
            status: status_write.as_raw_fd(),
        };
        // SAFETY: the child runs only `exec_watchdog`, which makes async-signal-safe system calls on
        // memory prepared above and never returns.
        let pid = match unsafe { fork() }? {
            ForkResult::Child => exec_watchdog(&plan),
            ForkResult::Parent { child } => child,
        };
        drop((read_end, status_write));
        let mut pipe = File::from(write_end);
        // Written before any message; far below the pipe's capacity, so it never blocks.
        pipe.write_all(&encode_handover(
            nix::unistd::getpid(),
            farewell,
            cgroup.map(AppCgroup::dir),
        ))?;
        Ok(Watchdog {
            pipe,
            pid,
            exec_status: Some(status_read),
            jammed: false,
        })
    }

    /// What the app's process needs of the watchdog before it may run the command.
    pub fn app_link(&self) -> AppLink {
        AppLink {
            exec_status: self.exec_status.as_ref().map_or(-1, |fd| fd.as_raw_fd()),
            pipe: self.pipe.as_raw_fd(),
        }
    }

    /// The app runs: its process saw the watchdog's exec succeed, and nothing more will be read.
    pub fn app_started(&mut self) {
        self.exec_status = None;
    }

    /// Why the watchdog was gone when the app's process looked: its exec's errno, if that failed.
    /// Only asked once the app's process has seen the watchdog end, so the read cannot wait.
    pub fn exec_error(&mut self) -> io::Error {
        let mut errno = [0u8; 4];
        match self
            .exec_status
            .take()
            .map(|fd| File::from(fd).read_exact(&mut errno))
        {
            Some(Ok(())) => io::Error::from_raw_os_error(i32::from_le_bytes(errno)),
            _ => io::Error::other("the watchdog ended before the app could start"),
        }
    }

    pub fn pid(&self) -> Pid {
        self.pid
    }

    pub fn jammed(&self) -> bool {
        self.jammed
    }

    pub fn send(&mut self, message: Message) {
        // Nine bytes, below PIPE_BUF: written whole or not at all. The watchdog reads every message
        // as it comes, so the pipe never fills and the write never blocks.
        match self.pipe.write_all(&message.encode()) {
            Ok(()) => {}
            // The watchdog has exited: the reaper reports that, with how it ended.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                debug!(error = %e, "watchdog gone; message not sent");
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.jammed = true;
                error!(
                    event = "watchdog_unreachable",
                    "the watchdog has stopped reading its messages"
                );
            }
            Err(e) => {
                error!(event = "watchdog_unreachable", error = %e, "cannot reach the watchdog")
            }
        }
    }
}

/// The watchdog's exit code when the command line after the program's name is its own
/// (`__watchdog <stop-signal> <grace-ns>`, as `Watchdog::spawn` runs it); `None` for any other.
pub fn main_if_asked(args: &[String], farewell: FarewellRunner) -> Option<u8> {
    match args {
        [command, args @ ..] if command == "__watchdog" => Some(main(args, farewell)),
        _ => None,
    }
}

/// `sentinel-guard __watchdog <stop-signal> <grace-ns>`; the process's exit code.
fn main(args: &[String], farewell: FarewellRunner) -> u8 {
    let parsed = (|| {
        let signal: Signal = args.first()?.parse().ok()?;
        let grace: u64 = args.get(1)?.parse().ok()?;
        (args.len() == 2).then_some((signal, Duration::from_nanos(grace)))
    })();
    // Run by hand, fd 3 is whatever the shell left there: never adopt a descriptor that is not the
    // guard's pipe.
    let is_pipe = fstat(unsafe { BorrowedFd::borrow_raw(MESSAGE_FD) })
        .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFIFO);
    let (Some((stop_signal, grace)), true) = (parsed, is_pipe) else {
        eprintln!("sentinel-guard: __watchdog is internal to the guard and cannot be run by hand");
        return crate::vocab::EXIT_USAGE;
    };
    for number in ignored_signals() {
        // Already ignored since before exec (see `Watchdog::spawn`); again here for certainty.
        // SAFETY: SIG_IGN installs no handler code. Real-time signals have no nix name, hence libc.
        unsafe { libc::signal(number, libc::SIG_IGN) };
    }
    // The farewell message it is about to read may carry the lock's credential: no process of the
    // same user may read the watchdog's memory (exec made it dumpable again).
    let _ = nix::sys::prctl::set_dumpable(false);
    // SAFETY: fd 3 was handed over by the guard and is owned by this process alone.
    let mut pipe = File::from(unsafe { OwnedFd::from_raw_fd(MESSAGE_FD) });
    let mut log = Log {
        group: None,
        started: None,
    };
    let Ok(handover) = decode_handover(&mut pipe) else {
        // The guard died before it finished the hand-over, so before it started the app.
        return 0;
    };
    // SAFETY: fd 4 was handed over with the flag that says so.
    let kept = handover
        .keeps_fd
        .then(|| unsafe { OwnedFd::from_raw_fd(KEPT_FD) });
    let message = handover.message;
    // The guard made the app a cgroup: a watchdog that cannot use it could not stop a helper that
    // left the app's group once the guard is killed. It ends, and a guard whose watchdog ended
    // stops its app.
    let cgroup = match handover
        .cgroup
        .map(|dir| AppCgroup::open(dir.clone()).map_err(|e| (dir, e)))
    {
        None => None,
        Some(Ok(cgroup)) => Some(cgroup),
        Some(Err((dir, e))) => {
            log.on();
            error!(event = "watchdog_cgroup_unusable", cgroup = %dir.display(), error = %e, "the watchdog cannot use the app's cgroup; it ends, and the guard stops the app");
            return crate::vocab::EXIT_INTERNAL;
        }
    };
    let reach = Reach {
        cgroup,
        guard: handover.guard,
    };
    let timer = match BootTimer::new() {
        Ok(timer) => timer,
        Err(e) => {
            // Without a timer the switch cannot act on a frozen guard; the guard sees it end.
            log.on();
            error!(event = "watchdog_failed", error = %e, "watchdog cannot create its timer");
            return crate::vocab::EXIT_INTERNAL;
        }
    };
    let mut switch = Switch::new(grace);
    match watch(&mut pipe, timer, stop_signal, &mut switch, &mut log, &reach) {
        Ended::Acted => EXIT_ACTED,
        Ended::StoodDown => 0,
        Ended::GuardGone => {
            let message = if switch.farewell { &message[..] } else { &[] };
            let kept = if switch.farewell { kept } else { None };
            guard_gone(kept, message, farewell, &mut log, &reach);
            0
        }
    }
}

enum Ended {
    Acted,
    StoodDown,
    GuardGone,
}

/// The watchdog's logging, set up only once it has something to say (always after the action it
/// reports: kill first, log after). A watchdog that is stood down, its usual end, never starts the
/// log writer thread: it starts and exits sooner, which a hand-over waits for, and costs fewer pages.
/// It also holds the app's group, once the app's process has sent it: nothing is signalled before.
struct Log {
    group: Option<Pid>,
    started: Option<(tracing::span::EnteredSpan, WorkerGuard)>,
}

impl Log {
    fn on(&mut self) {
        if self.started.is_some() {
            return;
        }
        let flush = crate::logging::init(crate::logging::inherited_format());
        let context = |key| std::env::var(key).unwrap_or_default();
        let span = info_span!(
            "watchdog",
            name = context(ENV_NAME),
            backend = context(ENV_BACKEND),
            holder_id = context(ENV_HOLDER_ID),
            app_pid = self.group.map(Pid::as_raw),
        )
        .entered();
        self.started = Some((span, flush));
    }
}

fn watch(
    pipe: &mut File,
    mut timer: BootTimer,
    stop_signal: Signal,
    switch: &mut Switch,
    log: &mut Log,
    reach: &Reach,
) -> Ended {
    loop {
        // The clock first: after a freeze, the deadline that passed is acted on before any later
        // deadline the guard may have written meanwhile is read.
        match switch.due(Deadline::now()) {
            Action::Kill if switch.teardown => {
                // A backstop to the guard's own kill, which is due at the same moment: worth a
                // warning only when something of the app was still alive for it. A clean exit with
                // `--grace-period 0s` reaches this deadline with nothing left; that is no alarm.
                let alive_before = reach.cgroup_populated();
                reach.signal(log.group, Signal::SIGKILL);
                switch.killed_in_teardown();
                let alive = alive_before
                    .unwrap_or_else(|| log.group.is_some_and(|group| reach.group_alive(group)));
                if alive {
                    log.on();
                    warn!(
                        event = "watchdog_killed_app",
                        "the guard's teardown reached its deadline; watchdog sent SIGKILL to the app's process group"
                    );
                }
            }
            Action::Kill => {
                learn_group(pipe, log);
                reach.signal(log.group, Signal::SIGKILL);
                log.on();
                error!(
                    event = "watchdog_killed_app",
                    reason = LossReason::GuardFrozen.as_str(),
                    "lock deadline passed with the guard unresponsive; watchdog sent SIGKILL to the app's process group"
                );
                return Ended::Acted;
            }
            // Before the app's process has said which group is its own there is nothing to stop:
            // the message that says it is read first, and the stop signal sent then.
            Action::Stop if log.group.is_some() => {
                reach.signal(log.group, stop_signal);
                switch.stop_sent();
                log.on();
                error!(
                    event = "watchdog_stopping_app",
                    reason = LossReason::GuardFrozen.as_str(),
                    signal = stop_signal.as_str(),
                    "guard unresponsive while its lock runs out; watchdog sent the stop signal to the app"
                );
                continue;
            }
            Action::Stop | Action::Nothing => {}
        }
        let stop_waits_for_group = switch.due(Deadline::now()) == Action::Stop;
        let wake = if stop_waits_for_group {
            switch.app_deadline
        } else {
            switch.next_wake()
        };
        if timer.arm(wake).is_err() {
            // Re-checked at least every 10ms instead.
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut fds = [
            PollFd::new(pipe.as_fd(), PollFlags::POLLIN),
            PollFd::new(timer.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
        let message_waiting = fds[0].any().unwrap_or(false);
        let due = switch.due(Deadline::now());
        if !message_waiting
            || !(due == Action::Nothing || stop_waits_for_group && due == Action::Stop)
        {
            continue;
        }
        let mut bytes = [0u8; MESSAGE_LEN];
        if pipe.read_exact(&mut bytes).is_err() {
            return Ended::GuardGone;
        }
        match Message::decode(bytes) {
            Some(Message::StandDown) => return Ended::StoodDown,
            Some(Message::AppGroup(group)) => log.group = Some(group),
            Some(message) => switch.apply(message, Deadline::now()),
            None => {
                log.on();
                warn!(
                    event = "watchdog_bad_message",
                    "watchdog ignored a message it does not know"
                );
            }
        }
    }
}

/// Reads, without waiting, what is already in the pipe until the app's group is known: a deadline
/// that passed before the group was read still reaches an app's process that has said which it is.
/// One that has not yet said it finds the pipe closed once the watchdog exits, or the deadline passed
/// on its own clock, and does not run the command.
fn learn_group(pipe: &mut File, log: &mut Log) {
    while log.group.is_none() {
        let mut fds = [PollFd::new(pipe.as_fd(), PollFlags::POLLIN)];
        if !matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0) {
            return;
        }
        let mut bytes = [0u8; MESSAGE_LEN];
        if pipe.read_exact(&mut bytes).is_err() {
            return;
        }
        if let Some(Message::AppGroup(group)) = Message::decode(bytes) {
            log.group = Some(group);
        }
    }
}

/// What the watchdog can reach of the app beyond its process group.
struct Reach {
    /// The app's cgroup, which holds every process the app forked, `setsid` or not.
    cgroup: Option<AppCgroup>,
    /// The guard, whose descendants are the app's tree where there is no cgroup.
    guard: Pid,
}

impl Reach {
    /// Signals the app's group, once its process has said which it is, then what left the group:
    /// the app's cgroup, and, while the guard lives, every descendant of the guard but the watchdog
    /// (a frozen guard's children lists do not change, and orphans of the app are handed to the
    /// guard). Before the group is known there is no app to signal (deadlines only follow the group
    /// down the pipe), and no other process may be hit. For SIGKILL, a cgroup that cannot be
    /// killed whole at once is killed again, for up to `GROUP_GONE_RECHECK`, until it is empty.
    fn signal(&self, group: Option<Pid>, signal: Signal) {
        let Some(group) = group else { return };
        let _ = killpg(group, signal);
        if let Some(cgroup) = &self.cgroup {
            if signal != Signal::SIGKILL {
                cgroup.signal_outside(group, signal);
            } else {
                let until = Deadline::after(GROUP_GONE_RECHECK);
                while cgroup.kill().is_err() || !cgroup.is_empty().unwrap_or(false) {
                    if until.has_passed() {
                        cgroup.signal_outside(group, signal);
                        break;
                    }
                    std::thread::sleep(GROUP_GONE_POLL);
                }
            }
        }
        // Its parent is still the guard (the watchdog was forked by it): the guard lives, and its
        // subtree is the app's. After its death the parent is someone else, whose subtree is not.
        if getppid() == self.guard {
            let outside: Vec<Pid> = super::tree::descendants(self.guard, getpid())
                .into_iter()
                .filter(|pid| nix::unistd::getpgid(Some(*pid)).is_ok_and(|g| g != group))
                .collect();
            // The walk again, trusted only if the guard was still the parent after it: a guard
            // that died meanwhile may have left its pid, and so its subtree, to a stranger.
            let again = || {
                let walked = super::tree::descendants(self.guard, getpid());
                if getppid() == self.guard {
                    Ok(walked)
                } else {
                    Err(io::Error::other("the guard died during the walk"))
                }
            };
            super::pidfd::signal_listed(&outside, again, signal);
        }
    }

    /// Whether the app's cgroup holds a live process (a process counts out of it when it exits,
    /// reaped or not), from one read that never waits: cheap enough to come before a kill. `None`
    /// without a cgroup. Unreadable counts as populated.
    fn cgroup_populated(&self) -> Option<bool> {
        self.cgroup
            .as_ref()
            .map(|cgroup| !cgroup.is_empty().unwrap_or(false))
    }

    /// Whether the app's group still has a live member: a walk of /proc, so only after the kill.
    /// Unreadable counts as alive.
    fn group_alive(&self, group: Pid) -> bool {
        super::tree::live_group_members(group).map_or(true, |left| !left.is_empty())
    }

    /// Whether anything of the app is left: its group, or its cgroup.
    fn app_left(&self, group: Pid) -> io::Result<Vec<Pid>> {
        let mut left = super::tree::live_group_members(group)?;
        if let Some(cgroup) = &self.cgroup {
            if !cgroup.is_empty()? {
                left.extend(cgroup.members()?);
                // Exited but not yet counted out, or not visible in this PID namespace: looked at
                // again after a short wait.
                if left.is_empty() {
                    std::thread::sleep(GROUP_GONE_POLL);
                    left.push(group);
                }
            }
        }
        Ok(left)
    }
}

/// The guard has exited; if it died without tearing the app down, nothing else will. Once nothing
/// of the app's group is left, the lock may go: the kept descriptor is closed and the farewell said.
/// With no group ever sent, no app ever ran: the guard died before the app's process could exec,
/// and that process dies by its parent-death signal (or its own check of its parent) without
/// running anything.
fn guard_gone(
    kept: Option<OwnedFd>,
    message: &[u8],
    farewell: FarewellRunner,
    log: &mut Log,
    reach: &Reach,
) {
    let group = log.group;
    let hit = group.is_some_and(|group| killpg(group, Signal::SIGKILL).is_ok());
    // The cgroup too, whatever its state reads: a process that left the group (setsid, a double
    // fork) is no longer below the guard, which is gone, but it is still in the cgroup.
    let escaped = match (group, &reach.cgroup) {
        (Some(_), Some(cgroup)) => {
            let populated = !cgroup.is_empty().unwrap_or(true);
            let _ = cgroup.kill();
            populated
        }
        _ => false,
    };
    if hit || escaped {
        log.on();
        warn!(
            event = "watchdog_killed_orphans",
            "guard gone; watchdog killed what was left of the app's process group and cgroup"
        );
    }
    if kept.is_none() && message.is_empty() && reach.cgroup.is_none() {
        return;
    }
    // Until the group is empty the lock must stay taken, however long a process takes to die.
    let waiting_since = Deadline::now();
    let mut warned = false;
    let mut unreadable = false;
    while let Some(group) = group {
        let members = match reach.app_left(group) {
            Ok(members) if members.is_empty() => break,
            Ok(members) => members,
            // Unknown is never "gone": the lock stays taken, and /proc is read again shortly.
            Err(e) => {
                if !unreadable {
                    unreadable = true;
                    log.on();
                    warn!(event = "watchdog_proc_unreadable", error = %e, "cannot read /proc to see whether the app's processes are gone; the lock stays held");
                }
                std::thread::sleep(GROUP_GONE_RECHECK);
                continue;
            }
        };
        if !warned && waiting_since.elapsed() >= GROUP_GONE_WARN {
            warned = true;
            log.on();
            warn!(
                event = "watchdog_waiting",
                "app processes outlive SIGKILL; the lock stays held until they are gone"
            );
        }
        // Again: a kill that needed a freeze may have missed a process being forked.
        if let Some(cgroup) = &reach.cgroup {
            let _ = cgroup.kill();
        }
        await_exits(&members);
    }
    if let Some(cgroup) = &reach.cgroup {
        cgroup.remove();
    }
    drop(kept);
    if message.is_empty() {
        return;
    }
    let said = farewell(message);
    log.on();
    match said {
        Ok(done) => info!(
            event = "watchdog_farewell",
            done = %done,
            "guard died holding the lock; watchdog freed it once the app was gone"
        ),
        Err(e) => warn!(
            event = "watchdog_farewell_failed",
            error = %e,
            "cannot free the dead guard's lock; the backend frees it when it notices"
        ),
    }
}

/// Waits until every one of `members` has exited, woken by the kernel through a pidfd of each, or
/// for at most `GROUP_GONE_RECHECK`; a short sleep where pidfds are not available. The caller looks
/// at the group again either way, so a pid reused meanwhile only costs a recheck.
fn await_exits(members: &[Pid]) {
    let mut pidfds = Vec::with_capacity(members.len());
    for pid in members {
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
        match fd {
            // SAFETY: a descriptor pidfd_open just returned, owned here alone.
            fd if fd >= 0 => pidfds.push(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }),
            // Already reaped: gone.
            _ if Errno::last() == Errno::ESRCH => {}
            _ => {
                std::thread::sleep(GROUP_GONE_POLL);
                return;
            }
        }
    }
    let until = Deadline::after(GROUP_GONE_RECHECK);
    // A pidfd turns readable once its process has exited.
    while !pidfds.is_empty() && !until.has_passed() {
        let left = u16::try_from(until.remaining().as_millis().max(1)).unwrap_or(u16::MAX);
        let mut fds: Vec<PollFd<'_>> = pidfds
            .iter()
            .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        if poll(&mut fds, PollTimeout::from(left)).is_err() {
            std::thread::sleep(GROUP_GONE_POLL);
        }
        let exited: Vec<bool> = fds.iter().map(|fd| fd.any().unwrap_or(false)).collect();
        let mut exited = exited.into_iter();
        pidfds.retain(|_| !exited.next().unwrap_or(false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Deadline {
        Deadline::from_nanos(1_000_000_000_000 + ms * 1_000_000)
    }

    #[test]
    fn messages_round_trip_and_unknown_tags_are_refused() {
        for message in [
            Message::AppGroup(Pid::from_raw(4_194_304)),
            Message::AppDeadline(at(5)),
            Message::KillBy(Deadline::NEVER),
            Message::LockLost,
            Message::StandDown,
        ] {
            assert_eq!(Message::decode(message.encode()), Some(message));
        }
        let mut bad = Message::LockLost.encode();
        bad[0] = 9;
        assert_eq!(Message::decode(bad), None);
        // Never a group that would make killpg hit the watchdog's own group, or every process.
        for group in [0, 1, -5] {
            let mut bad = Message::AppGroup(Pid::from_raw(2)).encode();
            bad[1..].copy_from_slice(&(group as i64 as u64).to_le_bytes());
            assert_eq!(Message::decode(bad), None, "group {group}");
        }
    }

    #[test]
    fn handover_round_trips() {
        let farewell = Farewell {
            message: b"mysql://secret".to_vec(),
            keep: None,
        };
        for cgroup in [None, Some(Path::new("/sys/fs/cgroup/sentinel-guard-7"))] {
            let bytes = encode_handover(Pid::from_raw(4242), &farewell, cgroup);
            let read = decode_handover(&mut &bytes[..]).unwrap();
            assert_eq!(read.guard, Pid::from_raw(4242));
            assert!(!read.keeps_fd);
            assert_eq!(read.message, b"mysql://secret");
            assert_eq!(read.cgroup.as_deref(), cgroup);
            assert!(decode_handover(&mut &bytes[..bytes.len() - 1]).is_err());
        }
    }

    #[test]
    fn a_silent_guard_gets_the_stop_signal_then_sigkill() {
        let mut switch = Switch::new(Duration::from_secs(5));
        assert_eq!(switch.due(at(0)), Action::Nothing, "no deadline yet");
        switch.apply(Message::AppDeadline(at(10_000)), at(0));
        assert_eq!(switch.due(at(5_000)), Action::Nothing);
        assert_eq!(switch.next_wake(), at(5_200));
        assert_eq!(switch.due(at(5_200)), Action::Stop);
        switch.stop_sent();
        assert_eq!(switch.due(at(6_000)), Action::Nothing, "stop is sent once");
        // A guard that wakes up late cannot call the stop off.
        switch.apply(Message::AppDeadline(at(20_000)), at(6_000));
        assert_eq!(switch.next_wake(), at(10_000));
        assert_eq!(switch.due(at(10_000)), Action::Kill);
    }

    #[test]
    fn a_passed_deadline_is_never_replaced() {
        let mut switch = Switch::new(Duration::from_secs(5));
        switch.apply(Message::AppDeadline(at(10_000)), at(0));
        // Frozen past the deadline: the later deadline the guard wrote is read only after the thaw.
        switch.apply(Message::AppDeadline(at(40_000)), at(30_000));
        assert_eq!(switch.due(at(30_000)), Action::Kill);
        switch.apply(Message::KillBy(at(35_000)), at(30_000));
        assert_eq!(switch.due(at(30_000)), Action::Kill);
    }

    #[test]
    fn teardown_keeps_the_switch_armed_without_a_second_stop_signal() {
        let mut switch = Switch::new(Duration::from_secs(5));
        switch.apply(Message::AppDeadline(at(10_000)), at(0));
        switch.apply(Message::KillBy(at(3_000)), at(1_000));
        assert_eq!(switch.due(at(2_999)), Action::Nothing);
        assert_eq!(switch.next_wake(), at(3_000));
        assert_eq!(switch.due(at(3_000)), Action::Kill);
        // Deadlines proven during teardown do not move the kill later.
        switch.apply(Message::AppDeadline(at(50_000)), at(2_000));
        assert_eq!(switch.due(at(3_000)), Action::Kill);
        // A kill during teardown backs the guard up: it is not a frozen guard's, and nothing
        // more is due until the stand-down.
        assert!(switch.teardown);
        switch.killed_in_teardown();
        assert_eq!(switch.due(at(60_000)), Action::Nothing);
        assert_eq!(switch.next_wake(), Deadline::NEVER);
        // A kill-by never moves the deadline later either.
        let mut switch = Switch::new(Duration::from_secs(5));
        switch.apply(Message::AppDeadline(at(2_000)), at(0));
        switch.apply(Message::KillBy(at(6_000)), at(1_000));
        assert_eq!(switch.due(at(2_000)), Action::Kill);
    }

    #[test]
    fn without_a_lock_deadline_teardown_still_arms_the_kill() {
        let mut switch = Switch::new(Duration::from_secs(5));
        switch.apply(Message::KillBy(at(1_000)), at(0));
        assert_eq!(switch.due(at(1_000)), Action::Kill);
    }

    #[test]
    fn a_lost_lock_gets_no_farewell() {
        let mut switch = Switch::new(Duration::from_secs(5));
        assert!(switch.farewell);
        switch.apply(Message::LockLost, at(0));
        assert!(!switch.farewell);
    }
}
