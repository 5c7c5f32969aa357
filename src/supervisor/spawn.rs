//! Starting the app: no shell, its own process group, killed with the guard, clean signal state.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::OnceLock;

use nix::libc::{self, rlim_t};
use nix::sys::prctl;
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::signal::{raise, sigprocmask, SigSet, SigmaskHow, Signal};
use nix::unistd::{getpgrp, getpid, getppid, isatty, setpgid, tcgetpgrp, tcsetpgrp, Pid};
use thiserror::Error;

use super::watchdog::{AppLink, Message};
use crate::deadline::Deadline;

#[derive(Debug, Error)]
pub enum SpawnError {
    #[error("command not found: {command}")]
    NotFound { command: String },
    #[error("command cannot be executed: {command}: {source}")]
    NotExecutable { command: String, source: io::Error },
}

/// Why the app's process did not run the command.
pub enum NotStarted {
    Command(SpawnError),
    /// The watchdog could not be executed, or ended before the app's process could tell it its
    /// group.
    WatchdogGone,
    /// The lock's deadline had passed when the app's process was about to run the command (the guard
    /// was frozen between its last proof and the fork): the lock may be someone else's by now.
    DeadlinePassed,
    /// The app's process could not move itself into the app's cgroup: started outside it, what it
    /// forks could escape a guard's death.
    CgroupJoin,
}

/// The errno the app's process reports a failed link to the watchdog with. The command's own exec
/// never fails with it (no pipe is written there), so it tells the two apart.
const LINK_FAILED: i32 = libc::EPIPE;
/// The errno the app's process refuses the command with once the lock's deadline has passed; the
/// command's own exec never fails with it either.
const DEADLINE_PASSED: i32 = libc::ETIME;
/// The errno the app's process reports a failed move into its cgroup with; exec never fails with it.
const CGROUP_JOIN_FAILED: i32 = libc::ENOMEDIUM;

/// The descriptor limits the guard started with, before `raise_descriptor_limit`: the app gets them
/// back, so an app built for the usual 1024 (`select`, say) sees what it would without the guard.
static STARTING_NOFILE: OnceLock<(rlim_t, rlim_t)> = OnceLock::new();

/// Raises the guard's soft limit on open descriptors to the hard limit, as most servers do: a flood
/// of connections to the metrics port, or many files held by the process, must never leave the
/// lock's own sockets and the watchdog's pipe without a descriptor.
pub fn raise_descriptor_limit() {
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let _ = STARTING_NOFILE.set((soft, hard));
    if soft < hard {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// The environment the app gets: the guard's own, minus what must not leak, plus what it adds.
pub struct AppEnv<'a> {
    pub remove: &'a [&'a str],
    pub set: Vec<(&'static str, String)>,
}

/// Spawns the app and returns its pid, which is also its process group id. Before it executes the
/// command, the app's process moves itself into `cgroup` (the app's cgroup's procs file, if there is
/// one), waits until the watchdog runs, writes its group down the watchdog's pipe, and reads the
/// boot clock itself: past `dead_by` it does not run the command at all.
///
/// Must run on the thread that lives as long as the guard: `PR_SET_PDEATHSIG` fires when the
/// spawning *thread* exits, not the process.
pub fn spawn(
    command: &[OsString],
    env: &AppEnv<'_>,
    watchdog: AppLink,
    dead_by: Deadline,
    cgroup: Option<&File>,
) -> Result<Pid, NotStarted> {
    let (program, args) = command.split_first().expect("clap requires a command");
    let mut cmd = Command::new(program);
    cmd.args(args);
    for key in env.remove {
        cmd.env_remove(key);
    }
    for (key, value) in &env.set {
        cmd.env(key, value);
    }
    let guard_pid = getpid();
    let take_foreground = owns_terminal_foreground();
    let nofile = STARTING_NOFILE.get().copied();
    let cgroup = cgroup.map(File::as_raw_fd);
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe system calls;
    // it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if let Some((soft, hard)) = nofile {
                setrlimit(Resource::RLIMIT_NOFILE, soft, hard)?;
            }
            prepare_child(guard_pid, take_foreground, watchdog, dead_by, cgroup)
        });
    }
    let describe = || program.to_string_lossy().into_owned();
    match cmd.spawn() {
        Ok(child) => Ok(Pid::from_raw(child.id() as i32)),
        Err(e) if e.raw_os_error() == Some(LINK_FAILED) => Err(NotStarted::WatchdogGone),
        Err(e) if e.raw_os_error() == Some(DEADLINE_PASSED) => Err(NotStarted::DeadlinePassed),
        Err(e) if e.raw_os_error() == Some(CGROUP_JOIN_FAILED) => Err(NotStarted::CgroupJoin),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(NotStarted::Command(SpawnError::NotFound {
                command: describe(),
            }))
        }
        Err(e) => Err(NotStarted::Command(SpawnError::NotExecutable {
            command: describe(),
            source: e,
        })),
    }
}

/// Whether stdin is a terminal whose foreground is the guard's own group. Only then does the app take
/// the foreground: a guard started in the background of an interactive shell must not steal it.
fn owns_terminal_foreground() -> bool {
    // SAFETY: fd 0 stays open for the duration of this call.
    let stdin = unsafe { BorrowedFd::borrow_raw(0) };
    isatty(stdin).unwrap_or(false) && tcgetpgrp(stdin).ok() == Some(getpgrp())
}

fn prepare_child(
    guard_pid: Pid,
    take_foreground: bool,
    watchdog: AppLink,
    dead_by: Deadline,
    cgroup: Option<RawFd>,
) -> io::Result<()> {
    // Its own group, so one signal reaches the app and everything it forks.
    setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
    prctl::set_pdeathsig(Signal::SIGKILL)?;
    // The guard may have died between fork and prctl; then no death signal will ever come.
    if getppid() != guard_pid {
        let _ = raise(Signal::SIGKILL);
    }
    // Into the app's cgroup before anything of the app can fork, so nothing it ever forks is
    // outside. "0" is the writing process itself.
    if let Some(procs) = cgroup {
        loop {
            // SAFETY: write(2) of a static buffer to a descriptor the guard opened for it.
            match unsafe { libc::write(procs, b"0".as_ptr().cast(), 1) } {
                1 => break,
                _ if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
                _ => return Err(io::Error::from_raw_os_error(CGROUP_JOIN_FAILED)),
            }
        }
    }
    await_watchdog_exec(watchdog.exec_status)
        .map_err(|_| io::Error::from_raw_os_error(LINK_FAILED))?;
    // Passed already: the watchdog is not told a group whose process will not run the command
    // (std reaps it, and the number is free for another process).
    if dead_by.has_passed() {
        return Err(io::Error::from_raw_os_error(DEADLINE_PASSED));
    }
    tell_watchdog(watchdog.pipe).map_err(|_| io::Error::from_raw_os_error(LINK_FAILED))?;
    // Read after the watchdog knows the group: a watchdog that finds the same deadline passed either
    // read the group in time and kills this process, or exited before it, and then the clock read
    // here, later still, has passed the deadline too. (The watchdog's deadline is never earlier
    // than this one: it only moves later as proofs come.)
    if dead_by.has_passed() {
        return Err(io::Error::from_raw_os_error(DEADLINE_PASSED));
    }
    if take_foreground {
        // Take the terminal's foreground so Ctrl-C reaches the app. From a background group that
        // raises SIGTTOU unless blocked; ENOTTY/ENXIO (no controlling terminal) are fine to ignore.
        let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::all()), None);
        // SAFETY: fd 0 stays open for the duration of this call.
        let _ = tcsetpgrp(unsafe { BorrowedFd::borrow_raw(0) }, getpid());
    }
    // Handlers reset at exec, but a blocked mask would be inherited: the app starts with none.
    sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
    Ok(())
}

/// Waits until the watchdog's process has executed the watchdog (the status pipe's end: EOF), so the
/// command never runs before its dead man's switch does. An errno instead means it could not.
/// Async-signal-safe.
fn await_watchdog_exec(status: RawFd) -> io::Result<()> {
    let mut errno = [0u8; 4];
    loop {
        // SAFETY: read(2) into a stack buffer of the length given.
        match unsafe { libc::read(status, errno.as_mut_ptr().cast(), errno.len()) } {
            0 => return Ok(()),
            n if n > 0 => return Err(io::Error::from_raw_os_error(LINK_FAILED)),
            _ if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
            _ => return Err(io::Error::last_os_error()),
        }
    }
}

/// Sends the app's group to the watchdog, from the app's own process before exec: from the moment
/// anything of the app can run, a guard that dies leaves the watchdog knowing what to kill.
/// Async-signal-safe: a stack buffer and raw system calls.
fn tell_watchdog(watchdog: RawFd) -> io::Result<()> {
    let message = Message::AppGroup(getpid()).encode();
    // A closed pipe must fail the write, not kill this process: the guard then learns why the app
    // did not start. The disposition is put back, as an ignored signal would stay ignored in the app.
    // SAFETY: signal(2) and write(2) with a stack buffer have no memory-safety preconditions.
    let written = unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        let written = libc::write(watchdog, message.as_ptr().cast(), message.len());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        written
    };
    // Nine bytes, below PIPE_BUF: written whole or not at all.
    if written < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
