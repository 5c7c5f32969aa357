//! The app's health check (`--health-cmd`): `/bin/sh -c CMD` as a child of the guard. It runs in a
//! process group of its own, so a check that times out is killed with everything it started, and in
//! the app's cgroup, so a guard killed by SIGKILL leaves none of it behind (the watchdog empties that
//! cgroup); its death signal covers the shell where there is no cgroup. Its output is discarded:
//! the exit code is what counts, and a check must never wait on a pipe the guard does not read.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use nix::libc;
use nix::sys::prctl;
use nix::sys::signal::{kill, Signal};
use nix::unistd::{getpid, getppid, Pid};

use super::cgroup::Entry;
use super::spawn::AppEnv;

/// The shell health checks are run by, as Docker's `CMD-SHELL` runs them.
const SHELL: &str = "/bin/sh";

/// Starts `command`; its pid is also its process group id, and stays the guard's to signal until
/// the reaper has waited for it.
pub fn spawn(command: &str, env: &AppEnv<'_>, cgroup: Option<&Entry>) -> io::Result<Pid> {
    let mut shell = Command::new(SHELL);
    shell
        .arg("-c")
        .arg(command)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    for name in env.remove {
        shell.env_remove(name);
    }
    for (name, value) in &env.set {
        shell.env(name, value);
    }
    let guard = getpid();
    let procs: Option<RawFd> = cgroup.map(|entry| entry.procs.as_raw_fd());
    // SAFETY: the closure makes async-signal-safe system calls only, on values copied before the
    // fork.
    unsafe {
        shell.pre_exec(move || {
            prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The guard may have died between fork and prctl; then no death signal will ever come.
            if getppid() != guard {
                let _ = kill(Pid::from_raw(libc::getpid()), Signal::SIGKILL);
            }
            if let Some(procs) = procs {
                // "0" is the writing process itself.
                if libc::write(procs, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    // std waits for a child whose exec failed; a started one is left to the guard's reaper (a
    // dropped `Child` neither waits nor kills).
    let child = shell
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("{SHELL} -c: {e}")))?;
    Ok(Pid::from_raw(child.id() as i32))
}
