//! Starting the watchdog: the binary re-executed as `__watchdog` with only the descriptors and the
//! environment it needs, every catchable signal ignored, from a child that may not allocate.

use super::*;

/// `key=value`, as exec takes an environment variable.
pub(super) fn env_entry(key: &[u8], value: &[u8]) -> Vec<u8> {
    [key, b"=", value].concat()
}

/// NUL-terminated copies of `items`; an item with a NUL inside cannot be passed to exec.
pub(super) fn c_strings<T: Into<Vec<u8>>>(
    items: impl IntoIterator<Item = T>,
) -> io::Result<Vec<CString>> {
    items
        .into_iter()
        .map(|item| CString::new(item).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e)))
        .collect()
}

/// The NULL-terminated pointer array exec takes, borrowing `strings`.
pub(super) fn pointers(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// What the watchdog's process does between fork and exec, all of it prepared before the fork.
pub(super) struct ExecPlan {
    pub(super) argv: Vec<*const libc::c_char>,
    pub(super) envp: Vec<*const libc::c_char>,
    pub(super) message: RawFd,
    pub(super) kept: Option<RawFd>,
    pub(super) dev_null: RawFd,
    /// The write end of the exec-status pipe: an errno goes there if exec fails.
    pub(super) status: RawFd,
}

/// The forked watchdog's way to exec. Async-signal-safe: no allocation, no lock, raw system calls.
pub(super) fn exec_watchdog(plan: &ExecPlan) -> ! {
    let mut status = plan.status;
    let errno = match prepare_and_exec(plan, &mut status) {
        Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
        Ok(never) => match never {},
    };
    let [a, b, c, d] = errno.to_le_bytes();
    let twice = [a, b, c, d, a, b, c, d];
    // SAFETY: write(2) of a stack buffer, then _exit(2): no unwinding, no atexit handlers.
    unsafe {
        libc::write(status, twice.as_ptr().cast(), twice.len());
        libc::_exit(127)
    }
}

/// Sets the watchdog's process up and executes it; returns only with the reason it could not.
/// `status` follows the status pipe's end as it is moved.
fn prepare_and_exec(plan: &ExecPlan, status: &mut RawFd) -> io::Result<std::convert::Infallible> {
    // Ignored before exec, and ignored dispositions survive exec: a signal sent to the guard's
    // group while the watchdog starts up cannot kill it either.
    for number in ignored_signals() {
        // SAFETY: signal(2) installing SIG_IGN runs no handler code.
        unsafe { libc::signal(number, libc::SIG_IGN) };
    }
    // The guard's blocked signals would be inherited through exec: the watchdog starts with none.
    sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
    // Moved out of the way first, so placing one cannot overwrite another (the status pipe's end
    // included: were it overwritten, the app's process would take that for an exec).
    *status = park(plan.status)?;
    let source = park(plan.message)?;
    let kept = plan.kept.map(park).transpose()?;
    hand_down(plan.dev_null, 0)?;
    hand_down(plan.dev_null, 1)?;
    hand_down(source, MESSAGE_FD)?;
    if let Some(kept) = kept {
        hand_down(kept, KEPT_FD)?;
    }
    // SAFETY: both arrays are NULL-terminated and point into CStrings the parent made.
    unsafe { libc::execve(plan.argv[0], plan.argv.as_ptr(), plan.envp.as_ptr()) };
    Err(io::Error::last_os_error())
}

/// A close-on-exec copy of `fd` numbered 10 or above, clear of the fds being placed. Async-signal-safe.
fn park(fd: RawFd) -> io::Result<RawFd> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd open in the child has no memory-safety preconditions.
    match unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) } {
        -1 => Err(io::Error::last_os_error()),
        parked => Ok(parked),
    }
}

/// Makes `source` the child's `target` fd, without close-on-exec. Async-signal-safe.
fn hand_down(source: RawFd, target: RawFd) -> io::Result<()> {
    if source == target {
        // SAFETY: `source` is open in the child for the duration of this call.
        fcntl(
            unsafe { BorrowedFd::borrow_raw(source) },
            FcntlArg::F_SETFD(FdFlag::empty()),
        )?;
    } else if unsafe { libc::dup2(source, target) } < 0 {
        // dup2 clears close-on-exec on the copy.
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Every signal the watchdog ignores: all that can be caught, but the synchronous faults (which
/// describe a bug of its own) and SIGCHLD (ignoring it would change how children are reaped).
/// SIGPIPE is among them: a write to a closed pipe must fail, not kill.
pub(super) fn ignored_signals() -> impl Iterator<Item = i32> {
    let faults = [
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGILL,
        libc::SIGFPE,
        libc::SIGABRT,
        libc::SIGTRAP,
        libc::SIGSYS,
        libc::SIGKILL,
        libc::SIGSTOP,
        libc::SIGCHLD,
    ];
    (1..=libc::SIGRTMAX()).filter(move |s| !faults.contains(s))
}
