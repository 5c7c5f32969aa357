//! Starting the app: no shell, its own process group, killed with the guard, clean signal state.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::sync::OnceLock;

use nix::fcntl::OFlag;
use nix::libc::{self, rlim_t};
use nix::sys::prctl;
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::signal::{kill, pthread_sigmask, sigprocmask, SigSet, SigmaskHow, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::{getpgrp, getpid, getppid, isatty, pipe2, setpgid, tcgetpgrp, tcsetpgrp, Pid};
use thiserror::Error;

use super::cgroup::Entry;
use super::watchdog::{AppLink, Message};
use crate::deadline::Deadline;

#[derive(Debug, Error)]
pub enum SpawnError {
    #[error("command not found: {command}")]
    NotFound { command: String },
    #[error("command cannot be executed: {command}: {source}")]
    NotExecutable { command: String, source: io::Error },
    #[error("command cannot be executed: {command}: its interpreter {interpreter} (from its #! line) is not found")]
    InterpreterNotFound {
        command: String,
        interpreter: String,
    },
}

/// Finds out, before anything is locked or claimed, whether the app's process will be able to
/// execute `command`: the same search as its exec (each entry of the app's `PATH` in turn, past
/// missing and forbidden ones), and for a script, whether its `#!` interpreter exists. A scheduled
/// window is then never used up by a command that cannot start. A command that passes can still fail
/// at exec (the file changed meanwhile, or an interpreter that is itself a script lacks its own):
/// `spawn` reports that as before.
pub fn resolve(command: &[OsString]) -> Result<(), SpawnError> {
    let (program, _) = command.split_first().expect("clap requires a command");
    let describe = || program.to_string_lossy().into_owned();
    let path = std::env::var_os("PATH");
    // What exec would say at the end of its search, as `Exec::run` keeps it: a denied candidate
    // wins over missing ones.
    let mut denied = None;
    let mut missing_interpreter = None;
    for candidate in search(program.as_bytes(), path.as_ref().map(|p| p.as_bytes())) {
        let candidate = std::path::PathBuf::from(OsString::from_vec(candidate));
        let errno = match std::fs::metadata(&candidate) {
            Ok(meta) if meta.is_file() && executable(&candidate) => {
                match interpreter(&candidate) {
                    None => return Ok(()),
                    Some(interpreter) if executable(Path::new(&interpreter)) => return Ok(()),
                    // Exec fails as for the interpreter: not found goes on searching, as does
                    // not permitted.
                    Some(interpreter) => match std::fs::metadata(&interpreter) {
                        Ok(_) => libc::EACCES,
                        Err(_) => {
                            missing_interpreter.get_or_insert(interpreter);
                            libc::ENOENT
                        }
                    },
                }
            }
            // A directory, a device, a file without execute permission.
            Ok(_) => libc::EACCES,
            Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
        };
        match errno {
            libc::EACCES => denied = Some(io::Error::from_raw_os_error(libc::EACCES)),
            errno if search_goes_on(errno) => {}
            // Where exec stops its search (a loop of links, a name too long, an I/O error).
            other => {
                return Err(SpawnError::NotExecutable {
                    command: describe(),
                    source: io::Error::from_raw_os_error(other),
                })
            }
        }
    }
    Err(match (denied, missing_interpreter) {
        (Some(source), _) => SpawnError::NotExecutable {
            command: describe(),
            source,
        },
        (None, Some(interpreter)) => SpawnError::InterpreterNotFound {
            command: describe(),
            interpreter: interpreter.to_string_lossy().into_owned(),
        },
        (None, None) => SpawnError::NotFound {
            command: describe(),
        },
    })
}

/// Whether this process may execute `path`, as exec would check it.
fn executable(path: &Path) -> bool {
    nix::unistd::access(path, nix::unistd::AccessFlags::X_OK).is_ok()
}

/// The interpreter a `#!` line names, if the file starts with one and can be read. Opened without
/// waiting (a FIFO swapped in since the stat must not hold the guard) and read only if it is still
/// a regular file.
fn interpreter(script: &Path) -> Option<OsString> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(script)
        .ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut head = [0u8; 256];
    let read = file.read(&mut head).ok()?;
    let line = head[..read].strip_prefix(b"#!")?;
    let line = &line[..line.iter().position(|b| *b == b'\n').unwrap_or(line.len())];
    let name = line
        .split(|b| *b == b' ' || *b == b'\t')
        .find(|word| !word.is_empty())?;
    Some(OsString::from_vec(name.to_vec()))
}

/// The paths execvp tries for `program`, in order: the name itself if it has a `/`, else each entry
/// of `path` (glibc's default when unset) joined with it; an empty entry is the working directory.
fn search(program: &[u8], path: Option<&[u8]>) -> Vec<Vec<u8>> {
    if program.is_empty() {
        // execvp's answer to an empty name: not found.
        Vec::new()
    } else if program.contains(&b'/') {
        vec![program.to_vec()]
    } else {
        path.unwrap_or(DEFAULT_PATH.as_bytes())
            .split(|b| *b == b':')
            .map(|dir| match dir {
                b"" => program.to_vec(),
                dir => [dir, b"/", program].concat(),
            })
            .collect()
    }
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

/// Why the command was not run, and the app's process if one was forked. That process is left
/// unreaped: the watchdog may have been told its group, and while the process is a zombie no other
/// can take its pid, nor so its group's number.
pub struct NotRun {
    pub why: NotStarted,
    pub process: Option<Pid>,
}

impl From<NotStarted> for NotRun {
    fn from(why: NotStarted) -> NotRun {
        NotRun { why, process: None }
    }
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
/// command, the app's process is in `cgroup` (if there is one), waits until the watchdog runs,
/// writes its group down the watchdog's pipe, and reads the boot clock itself: past `app_deadline` it does
/// not run the command at all. A process that refused comes back unreaped (`NotRun`): the caller
/// reaps it once the watchdog has exited.
///
/// Must run on the thread that lives as long as the guard: `PR_SET_PDEATHSIG` fires when the
/// spawning *thread* exits, not the process.
pub fn spawn(
    command: &[OsString],
    env: &AppEnv<'_>,
    watchdog: AppLink,
    app_deadline: Deadline,
    cgroup: Option<&Entry>,
) -> Result<Pid, NotRun> {
    let (program, _) = command.split_first().expect("clap requires a command");
    let describe = || program.to_string_lossy().into_owned();
    let not_executable = |source| {
        NotStarted::Command(SpawnError::NotExecutable {
            command: describe(),
            source,
        })
    };
    let mut exec = Exec::prepare(command, env).map_err(not_executable)?;
    let setup = ChildSetup {
        group: Group::of_this_guard(cgroup),
        take_foreground: owns_terminal_foreground(),
        watchdog,
        app_deadline,
    };
    let (errors, error_pipe) =
        pipe2(OFlag::O_CLOEXEC).map_err(|e| not_executable(io::Error::from(e)))?;
    let born_into = cgroup.and_then(|entry| entry.dir.as_ref());
    // SAFETY: the child only makes async-signal-safe system calls on memory prepared before the
    // fork (`ChildSetup`, `Exec`), and never returns: it executes the command or exits.
    let child = unsafe { fork_into(born_into) };
    match child {
        Ok((None, joined)) => unsafe {
            run_child(&setup, joined, &mut exec, error_pipe.as_raw_fd())
        },
        Ok((Some(pid), _)) => {
            drop(error_pipe);
            match exec_errno(errors) {
                None => Ok(pid),
                Some(errno) => {
                    // It exits at once after saying why. A failed exec comes after it took the
                    // terminal's foreground.
                    reclaim_terminal(pid);
                    let why = match errno {
                        LINK_FAILED => NotStarted::WatchdogGone,
                        DEADLINE_PASSED => NotStarted::DeadlinePassed,
                        CGROUP_JOIN_FAILED => NotStarted::CgroupJoin,
                        libc::ENOENT => NotStarted::Command(SpawnError::NotFound {
                            command: describe(),
                        }),
                        errno => not_executable(io::Error::from_raw_os_error(errno)),
                    };
                    Err(NotRun {
                        why,
                        process: Some(pid),
                    })
                }
            }
        }
        Err(e) => Err(not_executable(io::Error::from(e)).into()),
    }
}

/// Starts a helper of the app (the health check): `argv`, with the app's environment `env` and
/// standard streams on `/dev/null` (a helper must never wait on a pipe the guard does not read), in
/// a process group of its own (so what it starts is killed with it) and in `cgroup`, killed with
/// the guard. Returns once it has executed `argv[0]`, or why it could not; its pid is the guard's
/// to reap.
pub fn spawn_helper(
    argv: &[OsString],
    env: &AppEnv<'_>,
    cgroup: Option<&Entry>,
) -> io::Result<Pid> {
    let mut exec = Exec::prepare(argv, env)?;
    let null = File::options().read(true).write(true).open("/dev/null")?;
    let group = Group::of_this_guard(cgroup);
    let (errors, error_pipe) = pipe2(OFlag::O_CLOEXEC)?;
    let born_into = cgroup.and_then(|entry| entry.dir.as_ref());
    // SAFETY: as for the app: the child only makes async-signal-safe calls on memory prepared
    // before the fork, and never returns.
    match unsafe { fork_into(born_into) }? {
        (None, joined) => {
            let setup = || -> io::Result<()> {
                group.enter()?;
                if let Some(procs) = group.procs.filter(|_| !joined) {
                    join_cgroup(procs)?;
                }
                for fd in 0..3 {
                    // SAFETY: dup2(2) of a descriptor opened before the fork.
                    if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
                Ok(())
            };
            // SAFETY: in the child of `fork_into`.
            unsafe { exec_or_report(setup(), &mut exec, error_pipe.as_raw_fd()) }
        }
        (Some(pid), _) => {
            drop(error_pipe);
            match exec_errno(errors) {
                None => Ok(pid),
                Some(errno) => {
                    // Reaped here: nothing else tracks it yet.
                    let _ = waitpid(pid, None);
                    Err(io::Error::from_raw_os_error(errno))
                }
            }
        }
    }
}

/// Forks; in the child `None` and whether it was born into `cgroup`. `clone3(CLONE_INTO_CGROUP)`
/// first, then a plain fork where the kernel or the cgroup refuses it (the child then joins by the
/// procs file, which reports any failure the usual way).
///
/// # Safety
/// As `fork`: in a threaded process the child may only make async-signal-safe calls before exec.
unsafe fn fork_into(cgroup: Option<&File>) -> nix::Result<(Option<Pid>, bool)> {
    if let Some(dir) = cgroup {
        let mut args = CloneArgs {
            flags: CLONE_INTO_CGROUP,
            exit_signal: libc::SIGCHLD as u64,
            cgroup: dir.as_raw_fd() as u64,
            ..CloneArgs::default()
        };
        // SAFETY: without CLONE_VM the child gets a copy of this stack, as with fork(2).
        let pid = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                &mut args as *mut CloneArgs,
                std::mem::size_of::<CloneArgs>(),
            )
        };
        match pid {
            0 => return Ok((None, true)),
            pid if pid > 0 => return Ok((Some(Pid::from_raw(pid as i32)), true)),
            // Refused (a kernel before 5.7, a seccomp filter such as Docker's default one that
            // answers ENOSYS, a cgroup that takes no process): the slower way in, said once.
            _ => {
                static SAID: std::sync::Once = std::sync::Once::new();
                let error = io::Error::last_os_error();
                SAID.call_once(|| {
                    tracing::debug!(error = %error, "clone3 into the app's cgroup refused; the app joins it by its procs file");
                });
            }
        }
    }
    // SAFETY: as above.
    match unsafe { libc::fork() } {
        0 => Ok((None, false)),
        pid if pid > 0 => Ok((Some(Pid::from_raw(pid)), false)),
        _ => Err(nix::errno::Errno::last()),
    }
}

/// From `linux/sched.h`: libc's constant is a 32-bit int that this value overflows.
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// `struct clone_args` of `linux/sched.h` up to `cgroup` (Linux 5.7), declared here: libc has it
/// for 64-bit targets only.
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// What the child needs, read before the fork.
struct ChildSetup {
    group: Group,
    take_foreground: bool,
    watchdog: AppLink,
    app_deadline: Deadline,
}

/// What a child of the guard (the app, a helper) needs to enter its own process group, tied to the
/// guard's life, in the app's cgroup.
struct Group {
    guard_pid: Pid,
    nofile: Option<(rlim_t, rlim_t)>,
    procs: Option<RawFd>,
}

impl Group {
    fn of_this_guard(cgroup: Option<&Entry>) -> Group {
        Group {
            guard_pid: getpid(),
            nofile: STARTING_NOFILE.get().copied(),
            procs: cgroup.map(|entry| entry.procs.as_raw_fd()),
        }
    }

    /// In the child: the guard's starting descriptor limit, a process group of its own (so one
    /// signal reaches it and everything it forks), SIGKILL at the guard's death. Async-signal-safe.
    fn enter(&self) -> io::Result<()> {
        if let Some((soft, hard)) = self.nofile {
            setrlimit(Resource::RLIMIT_NOFILE, soft, hard)?;
        }
        setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
        prctl::set_pdeathsig(Signal::SIGKILL)?;
        // The guard may have died between fork and prctl; then no death signal will ever come.
        if getppid() != self.guard_pid {
            let _ = kill(own_pid(), Signal::SIGKILL);
        }
        Ok(())
    }
}

/// The app's process after the fork: set up, then the command, or its errno down `error_pipe` and
/// exit. Async-signal-safe throughout.
///
/// # Safety
/// Only in the child of `fork_into`.
unsafe fn run_child(setup: &ChildSetup, joined: bool, exec: &mut Exec, error_pipe: RawFd) -> ! {
    // SAFETY: in the child of `fork_into`, as this function is.
    unsafe { exec_or_report(prepare_child(setup, joined), exec, error_pipe) }
}

/// In a child set up as `prepared` says: the command, or its errno down `error_pipe` and exit.
///
/// # Safety
/// Only in the child of `fork_into`.
unsafe fn exec_or_report(prepared: io::Result<()>, exec: &mut Exec, error_pipe: RawFd) -> ! {
    let errno = match prepared {
        Ok(()) => exec.run(),
        Err(e) => e.raw_os_error().unwrap_or(libc::EINVAL),
    };
    let bytes = errno.to_ne_bytes();
    // SAFETY: write(2) of a stack buffer, then _exit(2): no destructor, no atexit handler of the
    // guard runs in this copy of it.
    unsafe {
        libc::write(error_pipe, bytes.as_ptr().cast(), bytes.len());
        libc::_exit(127)
    }
}

/// The errno the child sent, or none once the pipe closed empty: the command runs.
fn exec_errno(errors: OwnedFd) -> Option<i32> {
    let mut bytes = [0u8; 4];
    match File::from(errors).read_exact(&mut bytes) {
        Ok(()) => Some(i32::from_ne_bytes(bytes)),
        // Closed by exec (close-on-exec) with nothing written.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => None,
        Err(e) => Some(e.raw_os_error().unwrap_or(libc::EIO)),
    }
}

/// The command's argument vector, environment and candidate paths, built before the fork, so the
/// child only points at them. The search is `execvp`'s: each `PATH` entry (the app's `PATH`) in
/// turn, past ones that are missing or not permitted, and a file without `#!` run by `/bin/sh`.
struct Exec {
    candidates: Vec<CString>,
    _argv: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    _envp: Vec<CString>,
    envp: Vec<*const libc::c_char>,
    /// `/bin/sh`, the candidate (filled in by the child), the arguments.
    script: Vec<*const libc::c_char>,
}

/// glibc's search path when `PATH` is unset.
const DEFAULT_PATH: &str = "/bin:/usr/bin";

impl Exec {
    fn prepare(command: &[OsString], env: &AppEnv<'_>) -> io::Result<Exec> {
        let cstring = |bytes: &[u8]| {
            CString::new(bytes).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a NUL byte in the command or its environment",
                )
            })
        };
        let mut vars: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
        for key in env.remove {
            vars.remove(OsStr::new(key));
        }
        for (key, value) in &env.set {
            vars.insert(key.into(), value.into());
        }
        let envp_owned = vars
            .iter()
            .map(|(key, value)| cstring(&[key.as_bytes(), b"=", value.as_bytes()].concat()))
            .collect::<io::Result<Vec<_>>>()?;
        let argv_owned = command
            .iter()
            .map(|arg| cstring(arg.as_bytes()))
            .collect::<io::Result<Vec<_>>>()?;
        let path = vars.get(OsStr::new("PATH")).map(|path| path.as_bytes());
        let candidates = search(command[0].as_bytes(), path)
            .iter()
            .map(|candidate| cstring(candidate))
            .collect::<io::Result<Vec<_>>>()?;
        let pointers = |strings: &[CString]| {
            strings
                .iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        let argv = pointers(&argv_owned);
        let envp = pointers(&envp_owned);
        let mut script = vec![SH.as_ptr(), std::ptr::null()];
        script.extend_from_slice(&argv[1..]);
        Ok(Exec {
            candidates,
            _argv: argv_owned,
            argv,
            _envp: envp_owned,
            envp,
            script,
        })
    }

    /// Executes the first candidate that can be; returns the errno `execvp` would. In the child.
    fn run(&mut self) -> i32 {
        let mut denied = false;
        let mut last = libc::ENOENT;
        for candidate in &self.candidates {
            // SAFETY: NUL-terminated strings and null-terminated vectors built before the fork.
            unsafe { libc::execve(candidate.as_ptr(), self.argv.as_ptr(), self.envp.as_ptr()) };
            last = io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL);
            match last {
                libc::ENOEXEC => {
                    self.script[1] = candidate.as_ptr();
                    // SAFETY: as above.
                    unsafe { libc::execve(SH.as_ptr(), self.script.as_ptr(), self.envp.as_ptr()) };
                    return io::Error::last_os_error()
                        .raw_os_error()
                        .unwrap_or(libc::EINVAL);
                }
                libc::EACCES => denied = true,
                errno if search_goes_on(errno) => {}
                other => return other,
            }
        }
        if denied {
            libc::EACCES
        } else {
            last
        }
    }
}

/// The errors after which execvp tries the next candidate of its search (and `EACCES`, which it
/// also remembers): the look-up before the lock and the exec itself judge a candidate alike.
fn search_goes_on(errno: i32) -> bool {
    matches!(
        errno,
        libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT
    )
}

const SH: &std::ffi::CStr = c"/bin/sh";

/// Gives the terminal's foreground back to the guard's own group if the app's group `app` still has
/// it: once the app's tree is gone, Ctrl-C must reach the guard (a scheduler waiting for its next
/// window, a `--rejoin` standby), not a group with nobody in it. Called while the app's pid is still
/// unreaped, so `app` cannot name another group yet.
pub fn reclaim_terminal(app: Pid) {
    // SAFETY: fd 0 stays open for the duration of this call.
    let stdin = unsafe { BorrowedFd::borrow_raw(0) };
    if !isatty(stdin).unwrap_or(false) || tcgetpgrp(stdin).ok() != Some(app) {
        return;
    }
    // From a background group, tcsetpgrp raises SIGTTOU unless it is blocked: blocked in this
    // thread for the call only.
    let ttou = SigSet::from(Signal::SIGTTOU);
    let mut before = SigSet::empty();
    if pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&ttou), Some(&mut before)).is_ok() {
        let _ = tcsetpgrp(stdin, getpgrp());
        let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&before), None);
    }
}

/// Whether stdin is a terminal whose foreground is the guard's own group. Only then does the app take
/// the foreground: a guard started in the background of an interactive shell must not steal it.
fn owns_terminal_foreground() -> bool {
    // SAFETY: fd 0 stays open for the duration of this call.
    let stdin = unsafe { BorrowedFd::borrow_raw(0) };
    isatty(stdin).unwrap_or(false) && tcgetpgrp(stdin).ok() == Some(getpgrp())
}

fn prepare_child(setup: &ChildSetup, joined: bool) -> io::Result<()> {
    setup.group.enter()?;
    // Into the app's cgroup before anything of the app can fork, so nothing it ever forks is
    // outside. "0" is the writing process itself.
    if let Some(procs) = setup.group.procs.filter(|_| !joined) {
        join_cgroup(procs).map_err(|_| io::Error::from_raw_os_error(CGROUP_JOIN_FAILED))?;
    }
    await_watchdog_exec(setup.watchdog.exec_status)
        .map_err(|_| io::Error::from_raw_os_error(LINK_FAILED))?;
    // Passed already: the watchdog is not told a group whose process will not run the command.
    if setup.app_deadline.has_passed() {
        return Err(io::Error::from_raw_os_error(DEADLINE_PASSED));
    }
    tell_watchdog(setup.watchdog.pipe).map_err(|_| io::Error::from_raw_os_error(LINK_FAILED))?;
    // Read after the watchdog knows the group: a watchdog that finds the same deadline passed either
    // read the group in time and kills this process, or exited before it, and then the clock read
    // here, later still, has passed the deadline too. (The watchdog's deadline is never earlier
    // than this one: it only moves later as proofs come.)
    if setup.app_deadline.has_passed() {
        return Err(io::Error::from_raw_os_error(DEADLINE_PASSED));
    }
    if setup.take_foreground {
        // Take the terminal's foreground so Ctrl-C reaches the app. From a background group that
        // raises SIGTTOU unless blocked; ENOTTY/ENXIO (no controlling terminal) are fine to ignore.
        let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::all()), None);
        // SAFETY: fd 0 stays open for the duration of this call.
        let _ = tcsetpgrp(unsafe { BorrowedFd::borrow_raw(0) }, own_pid());
    }
    // Handlers reset at exec, but a blocked mask would be inherited: the app starts with none.
    sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
    Ok(())
}

/// Moves the calling process into the cgroup whose procs file `procs` is ("0" is the writer itself).
/// Async-signal-safe.
fn join_cgroup(procs: RawFd) -> io::Result<()> {
    loop {
        // SAFETY: write(2) of a static buffer to a descriptor the guard opened for it.
        match unsafe { libc::write(procs, b"0".as_ptr().cast(), 1) } {
            1 => return Ok(()),
            _ if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
            _ => return Err(io::Error::last_os_error()),
        }
    }
}

/// The calling process's pid from the kernel. In the child, not getpid(3) or raise(3): after a raw
/// clone3, glibc's cached ids (the thread's always, the pid's before glibc 2.25) are the guard's.
fn own_pid() -> Pid {
    // SAFETY: getpid(2) has no preconditions.
    Pid::from_raw(unsafe { libc::syscall(libc::SYS_getpid) } as i32)
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
    let message = Message::AppGroup(own_pid()).encode();
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
