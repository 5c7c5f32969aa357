//! Signalling processes known only by a number read from a list (a cgroup's procs file, a walk of
//! `/proc`): between the read and the signal the process may exit and its pid go to a stranger. A
//! pidfd pins the process its pid named when it was opened, so one opened first and found still
//! listed afterwards is a listed process; a process that ended meanwhile only fails the signal.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::libc;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// At most this many pidfds are open at once, so a crowded cgroup cannot use up the descriptors the
/// list's own re-read needs.
const BATCH: usize = 64;

/// Sends `signal` to each of `pids` that `list_again`, read after each was pinned, still lists;
/// returns those signalled. Without pidfds (Linux before 5.3, or a seccomp filter that refuses
/// them) it signals by pid, as the lists alone allow.
pub fn signal_listed(
    pids: &[Pid],
    mut list_again: impl FnMut() -> io::Result<Vec<Pid>>,
    signal: Signal,
) -> Vec<Pid> {
    let mut signalled = Vec::new();
    for batch in pids.chunks(BATCH) {
        let mut pinned = Vec::with_capacity(batch.len());
        let mut refused = false;
        for &pid in batch {
            match open(pid) {
                Ok(fd) => pinned.push((pid, fd)),
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOSYS | libc::EPERM | libc::EACCES)
                    ) =>
                {
                    refused = true;
                    break;
                }
                // Ended already (ESRCH), or no descriptor to spare: not signalled now; the
                // caller's next round reads the list again.
                Err(_) => {}
            }
        }
        if refused {
            signalled.extend(by_pid(batch, signal));
            continue;
        }
        if pinned.is_empty() {
            continue;
        }
        let Ok(listed) = list_again() else {
            continue;
        };
        signalled.extend(
            pinned
                .into_iter()
                .filter(|(pid, _)| listed.contains(pid))
                .filter(|(_, fd)| send(fd, signal).is_ok())
                .map(|(pid, _)| pid),
        );
    }
    signalled
}

fn by_pid(pids: &[Pid], signal: Signal) -> Vec<Pid> {
    pids.iter()
        .copied()
        .filter(|pid| kill(*pid, signal).is_ok())
        .collect()
}

fn open(pid: Pid) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by the kernel, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn send(fd: &OwnedFd, signal: Signal) -> io::Result<()> {
    // SAFETY: pidfd_send_signal(2) with a valid pidfd, a signal number, no siginfo, no flags.
    let sent = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal as i32,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child killed when the test ends, whatever happens.
    struct Sleeper(std::process::Child);

    impl Sleeper {
        fn start() -> Sleeper {
            Sleeper(
                std::process::Command::new("sleep")
                    .arg("30")
                    .spawn()
                    .unwrap(),
            )
        }

        fn pid(&self) -> Pid {
            Pid::from_raw(self.0.id() as i32)
        }

        fn signalled(&mut self) -> bool {
            self.0.try_wait().unwrap().is_some() || {
                std::thread::sleep(std::time::Duration::from_millis(200));
                self.0.try_wait().unwrap().is_some()
            }
        }
    }

    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn only_processes_still_listed_are_signalled() {
        if open(Pid::this()).is_err() {
            eprintln!("no pidfds here: only the by-pid fallback can run");
            return;
        }
        let (mut listed, mut unlisted) = (Sleeper::start(), Sleeper::start());
        let (a, b) = (listed.pid(), unlisted.pid());
        assert_eq!(
            signal_listed(&[a, b], || Ok(vec![a]), Signal::SIGKILL),
            vec![a]
        );
        assert!(listed.signalled(), "a listed process is signalled");
        assert!(!unlisted.signalled(), "an unlisted one is not");
        // A list that cannot be read again names no one.
        let unreadable = || Err(io::Error::from_raw_os_error(libc::EIO));
        assert!(signal_listed(&[b], unreadable, Signal::SIGKILL).is_empty());
        assert!(!unlisted.signalled());
    }
}
