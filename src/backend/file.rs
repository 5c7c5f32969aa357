//! `flock` on a local file: the zero-dependency backend for one host and the quickstart.
//!
//! The kernel frees a `flock` when the last descriptor of the open file closes, i.e. when the guard
//! dies, so there is no expiry to reason about. The descriptor is close-on-exec so the app never
//! inherits it. What the kernel cannot see is the path being deleted or replaced while held: a new
//! guard would lock a new file. The guard watches for that and treats it as a lost lock.

use async_trait::async_trait;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow};
use tokio::sync::oneshot;
use tracing::info;

use super::{
    Acquisition, ClaimAnswer, ClaimRequest, Contention, Held, HeldLock, HolderInfo, LockError,
    LockLoss, LockRequest, LossReason, Observer, WindowStore,
};
use crate::handoff::Farewell;
use crate::holder::Holder;
use crate::record::{set_back_error, Fence, Previous, RecordFacts, RecordState};
use crate::vocab::CheckOutcome;
use crate::window::{self, Claim, RunEnd, RunExit};

mod record;
pub use record::{last_claim, last_record};
use record::{
    now_us, previous_holder, read_records, write_record, FileIdentity, LockLine, Place, Record,
};

/// The first line of every lock file this program writes. A lock file that is neither empty nor
/// starts with it is someone else's file, named by mistake: it is refused and never written to.
const MAGIC: &str = "# sentinel-guard lock file";

/// How often to retry when the path was replaced between opening and locking it.
const OPEN_ATTEMPTS: usize = 5;

/// How often a waiting standby looks whether the path still names the file it waits on, and whether
/// its patience has run out. The wait itself is a blocking `flock` that the kernel ends the moment
/// the holder's lock goes: this tick only catches a replaced path and an expired `--wait`.
const WAIT_RECHECK: Duration = Duration::from_millis(500);

/// Where no thread can be started for the blocking wait, the standby retries this often instead.
const WAIT_POLL: Duration = Duration::from_millis(10);

/// The waiting thread only ever blocks in `flock(2)`: a small stack is plenty.
const WAITER_STACK: usize = 64 * 1024;

pub async fn acquire(path: &Path, request: &LockRequest<'_>) -> Result<Acquisition, LockError> {
    let mut contention = Contention::new(&**request.observer);
    loop {
        let (file, holder) = match try_acquire(path, request)? {
            Attempt::Acquired(held) => return Ok(Acquisition::Acquired(held)),
            Attempt::Held(file, holder) => (file, holder),
        };
        if request.patience.exhausted() {
            return Ok(contention.give_up(holder));
        }
        if contention.log_due() {
            contention.waiting(&holder);
        }
        let identity = FileIdentity::of(&file.metadata().map_err(|e| io_error(path, e))?);
        let Some((mut granted, waiter)) = wait_in_kernel(file) else {
            tokio::time::sleep(request.patience.cap(WAIT_POLL)).await;
            continue;
        };
        loop {
            match tokio::time::timeout(request.patience.cap(WAIT_RECHECK), &mut granted).await {
                Ok(Ok(Ok(locked))) => {
                    // It has sent its answer and is ending: joined, so no thread of the wait
                    // outlives it (the app and its watchdog are forked next, and RLIMIT_NPROC
                    // counts threads).
                    let _ = waiter.join();
                    if let Some(held) = hold(locked, path, request)? {
                        return Ok(Acquisition::Acquired(held));
                    }
                    // The file was unlinked or replaced while we waited on it: take the path anew.
                    break;
                }
                // The wait failed (or its thread ended without an answer): try the path again soon.
                Ok(_) => {
                    tokio::time::sleep(request.patience.cap(WAIT_POLL)).await;
                    break;
                }
                // Patience ran out (answered above, with the holder as it is now), or the path names
                // another file than the one waited on: a new guard would lock that one.
                Err(_) if request.patience.exhausted() => break,
                Err(_) if FileIdentity::at(path) != Some(identity) => break,
                Err(_) => {
                    if contention.log_due() {
                        if let Ok(Some(mut file)) = open_to_read(path) {
                            contention.waiting(&describe_holder(&mut file, None));
                        }
                    }
                }
            }
        }
    }
}

/// The lock, taken with a blocking `flock` on a thread of its own, so a standby is woken by the
/// kernel the moment the holder's lock is freed instead of polling for it. `None` if no thread can be
/// started.
///
/// A wait given up (patience run out, a signal, the path replaced) leaves its thread blocked until
/// the holder lets go; the lock it then takes is dropped at once, since no one takes it from the
/// channel, and the thread ends.
fn wait_in_kernel(file: File) -> Option<(Granted, std::thread::JoinHandle<()>)> {
    let (granted, answer) = oneshot::channel();
    let waiter = move || {
        // Signals are for the runtime's thread; a handler run here would only interrupt the wait.
        let _ = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&SigSet::all()), None);
        let mut file = file;
        let result = loop {
            match Flock::lock(file, FlockArg::LockExclusive) {
                Ok(locked) => break Ok(locked),
                Err((again, Errno::EINTR)) => file = again,
                Err((_, errno)) => break Err(errno),
            }
        };
        // Err: the wait was given up; the lock, if taken, is dropped here, which frees it.
        let _ = granted.send(result);
    };
    std::thread::Builder::new()
        .name("sentinel-guard-flock".into())
        .stack_size(WAITER_STACK)
        .spawn(waiter)
        .ok()
        .map(|thread| (answer, thread))
}

/// The waiting thread's answer: the lock, or why the wait failed.
type Granted = oneshot::Receiver<Result<Flock<File>, Errno>>;

enum Attempt {
    Acquired(HeldLock),
    /// Locked by another: the file found locked, and who holds it.
    Held(File, HolderInfo),
}

fn try_acquire(path: &Path, request: &LockRequest<'_>) -> Result<Attempt, LockError> {
    for _ in 0..OPEN_ATTEMPTS {
        let file = open(path)?;
        let locked = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => locked,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let holder = describe_holder(&mut file, None);
                return Ok(Attempt::Held(file, holder));
            }
            Err((_, errno)) => {
                return Err(LockError::Refused(format!(
                    "flock {}: {errno}",
                    path.display()
                )));
            }
        };
        if let Some(held) = hold(locked, path, request)? {
            return Ok(Attempt::Acquired(held));
        }
    }
    Err(LockError::Unsafe(format!(
        "{} keeps being replaced while the guard locks it",
        path.display()
    )))
}

/// Makes a freshly locked file the held lock, if the path still names it: another guard may have
/// locked, then lost, a file that was unlinked after we opened it. `None` (and the lock dropped)
/// otherwise.
fn hold(
    mut locked: Flock<File>,
    path: &Path,
    request: &LockRequest<'_>,
) -> Result<Option<HeldLock>, LockError> {
    let identity = FileIdentity::of(&locked.metadata().map_err(|e| io_error(path, e))?);
    if FileIdentity::at(path) != Some(identity) {
        return Ok(None);
    }
    let (claim, found) = read_records(&mut locked);
    let own_bound = request.timings.detection_bound() + request.timings.grace_period;
    let place = Place::of(path, identity);
    let kernel_lock = local_filesystem(&locked);
    let previous =
        previous_holder(found.as_ref(), &place, kernel_lock, own_bound).map_err(|fence| {
            LockError::Unsafe(set_back_error(
                request.name.as_str(),
                &fence.set_back_detail(),
                &format!(
                "If the counter was reset on purpose, delete {} while no guard holds the lock: \
                 the next holder starts a new one above the clock",
                path.display()
            ),
            ))
        })?;
    let lock = LockLine {
        state: RecordState::Held,
        fence: Fence::next(found.map(|line| line.fence), now_us()),
        place,
        bound: own_bound,
    };
    write_record(
        &mut locked,
        Some(request.holder),
        claim.as_ref(),
        Some(&lock),
    )
    .map_err(|e| io_error(path, e))?;
    info!(event = "lock_acquired", path = %path.display(), fencing_token = lock.fence.token, previous = %previous.reason(), "file lock acquired");
    Ok(Some(HeldLock::new(FileLock {
        record: Box::new(Record {
            holder: request.holder.clone(),
            claim,
            lock,
            previous,
        }),
        file: locked,
        path: path.to_owned(),
        identity,
        check_interval: request.timings.check_interval,
        observer: Arc::clone(request.observer),
    })))
}

/// Who holds the lock now, read from /proc/locks without taking it: even a brief test lock could make
/// a starting guard believe the lock held and exit.
pub fn status(path: &Path) -> Result<Option<HolderInfo>, LockError> {
    let Some(mut file) = open_to_read(path)? else {
        return Ok(None);
    };
    // What the guard refuses to lock is no free lock either: the same answer, exit 2.
    require_ours(&mut file, path)?;
    let meta = file.metadata().map_err(|e| io_error(path, e))?;
    let locks = std::fs::read_to_string("/proc/locks")
        .map_err(|e| io_error(Path::new("/proc/locks"), e))?;
    let Some(pid) = flock_holder(&locks, &meta) else {
        return Ok(None);
    };
    Ok(Some(describe_holder(&mut file, Some(pid))))
}

/// The pid of the process holding a `flock` on the file `meta` describes, from /proc/locks lines such
/// as `3: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF` (device major:minor in hex, then the inode).
fn flock_holder(locks: &str, meta: &std::fs::Metadata) -> Option<u32> {
    let dev = meta.dev();
    let wanted = format!(
        "{:02x}:{:02x}:{}",
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev),
        meta.ino()
    );
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Waiters are listed as "N: -> FLOCK ..."; only the holder counts.
        match fields.as_slice() {
            [_, "FLOCK", _, _, pid, device, ..] if *device == wanted => pid.parse().ok(),
            _ => None,
        }
    })
}

/// std opens every file with O_CLOEXEC, which the lock relies on: an app that inherited the descriptor
/// would keep the lock alive after the guard died. `O_NOFOLLOW`: a symbolic link planted at the path
/// (in a shared directory, the classic attack on a program running as root) is never followed; a new
/// file is created `0644`. Anything but an empty file or one of this program's own is refused before
/// any byte is written, and anything but a regular file before it is even opened (`look`).
fn open(path: &Path) -> Result<File, LockError> {
    let mut file = open_or_create(path)?;
    require_ours(&mut file, path)?;
    Ok(file)
}

/// Refuses a file that is neither empty nor this program's (`is_ours`), having read only its first
/// line; leaves the file at its start.
fn require_ours(file: &mut File, path: &Path) -> Result<(), LockError> {
    let mut head = Vec::new();
    file.take(MAGIC.len() as u64)
        .read_to_end(&mut head)
        .map_err(|e| io_error(path, e))?;
    if !is_ours(&head) {
        return Err(LockError::NotALockFile(format!(
            "{}: not a sentinel-guard lock file (it is not empty and does not start with {MAGIC:?}); \
             it was left untouched: name a new or empty file",
            path.display()
        )));
    }
    file.seek(SeekFrom::Start(0))
        .map_err(|e| io_error(path, e))?;
    Ok(())
}

/// The regular file at `path`, or a new one. A file made by another guard between the look and the
/// creation (two guards started together on a new path) is looked at again.
fn open_or_create(path: &Path) -> Result<File, LockError> {
    for _ in 0..OPEN_ATTEMPTS {
        if let Some(found) = look(path)? {
            return reopen(path, &found, true);
        }
        let created = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(SAFE_OPEN)
            .open(path);
        match created {
            Ok(file) => return Ok(file),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(open_error(path, e)),
        }
    }
    Err(LockError::Unsafe(format!(
        "{} keeps appearing and disappearing while the guard opens it",
        path.display()
    )))
}

/// Flags of every open of a lock path, on top of std's `O_CLOEXEC`: never through a symbolic link;
/// never becoming the controlling terminal; never waiting (had a special file slipped past `look`).
const SAFE_OPEN: i32 = nix::libc::O_NOFOLLOW | nix::libc::O_NOCTTY | nix::libc::O_NONBLOCK;

/// What is at `path`, looked at without opening it for real: opening a FIFO wakes whoever waits on
/// its other end, and opening a device has effects of its own (`/dev/watchdog` arms a reboot timer,
/// a terminal can become the guard's controlling terminal). `O_PATH` opens nothing but the name,
/// without following a link. `None`: nothing there. Anything but a regular file is refused.
fn look(path: &Path) -> Result<Option<File>, LockError> {
    let found = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_PATH | nix::libc::O_NOFOLLOW)
        .open(path);
    let found = match found {
        Ok(found) => found,
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                && path.parent().is_some_and(Path::is_dir) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(open_error(path, e)),
    };
    let kind = found.metadata().map_err(|e| io_error(path, e))?.file_type();
    let what = if kind.is_file() {
        return Ok(Some(found));
    } else if kind.is_symlink() {
        return Err(open_error(
            path,
            std::io::Error::from_raw_os_error(nix::libc::ELOOP),
        ));
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    };
    Err(LockError::NotALockFile(format!(
        "{}: is {what}, not a lock file (it was not opened); a lock file must be a regular file",
        path.display()
    )))
}

/// Opens for real the regular file `look` found, and no other (`input_file::reopen`).
fn reopen(path: &Path, found: &File, write: bool) -> Result<File, LockError> {
    let mut options = OpenOptions::new();
    options.read(true).write(write);
    match crate::input_file::reopen(path, found, &options, nix::libc::O_NOFOLLOW) {
        Ok(Some(file)) => Ok(file),
        Ok(None) => Err(LockError::Refused(format!(
            "{}: was replaced while the guard opened it; try again",
            path.display()
        ))),
        Err(e) => Err(open_error(path, e)),
    }
}

/// An existing regular file at `path`, opened to read only; `None` when nothing is there.
fn open_to_read(path: &Path) -> Result<Option<File>, LockError> {
    look(path)?
        .map(|found| reopen(path, &found, false))
        .transpose()
}

fn open_error(path: &Path, e: std::io::Error) -> LockError {
    match e.raw_os_error() {
        Some(nix::libc::ELOOP) => LockError::NotALockFile(format!(
            "{}: is a symbolic link; a lock file must be a regular file (links are never followed, so \
             a link cannot redirect the guard to another file)",
            path.display()
        )),
        Some(nix::libc::EISDIR) => LockError::NotALockFile(format!(
            "{}: is a directory, not a lock file",
            path.display()
        )),
        // A file another user made (a guard run as root, say) with the default mode: say whose it
        // is and what every guard of the lock needs. A stat, which opens nothing.
        Some(nix::libc::EACCES) => {
            let owner = std::fs::symlink_metadata(path)
                .map(|m| format!("; it belongs to uid {} with mode {:04o}", m.uid(), m.mode() & 0o7777))
                .unwrap_or_default();
            LockError::Refused(format!(
                "{}: {e}{owner}: every guard of a lock must be able to open its file for writing: run \
                 them as one user, or give the file a group they share with mode 0660",
                path.display()
            ))
        }
        _ if e.kind() == std::io::ErrorKind::NotFound => LockError::Refused(format!(
            "{}: the directory {} does not exist",
            path.display(),
            path.parent()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default()
        )),
        _ => io_error(path, e),
    }
}

/// Empty, this program's magic line, or the start of it (a record being written right now: every
/// record rewrites the same magic line in place, so a reader never sees anything else).
fn is_ours(head: &[u8]) -> bool {
    let magic = MAGIC.as_bytes();
    head.starts_with(magic) || magic.starts_with(head)
}

fn io_error(path: &Path, e: std::io::Error) -> LockError {
    LockError::Refused(format!("{}: {e}", path.display()))
}

fn describe_holder(file: &mut File, locked_by: Option<u32>) -> HolderInfo {
    let text = record::read_text(file).unwrap_or_default();
    let info = match locked_by {
        Some(pid) => HolderInfo::default().with("locked_by_pid", pid),
        None => HolderInfo::default(),
    };
    let info = match Holder::parse(&text) {
        Some(holder) => info.with_guard(Some(holder)),
        None => info.with("holder", "unknown (no identity written yet)"),
    };
    // Two guards with different names on one path exclude each other, which surprises: said.
    info.with("lock", "the file's path, whatever --name")
}

/// Whether the file's locks are kept by this kernel alone: not on a network or user-space file
/// system, whose server or daemon may drop a lock on its own. One that cannot be told is not.
fn local_filesystem(file: &File) -> bool {
    /// NFS, SMB, CIFS, SMB2, Ceph, FUSE (virtiofs too), 9P, AFS, Coda, GFS2, OCFS2, Lustre.
    const SHARED: [i64; 12] = [
        0x6969,
        0x517B,
        0xFF53_4D42,
        0xFE53_4D42,
        0x00C3_6400,
        0x6573_5546,
        0x0102_1997,
        0x5346_414F,
        0x7375_7245,
        0x0116_1970,
        0x7461_636F,
        0x0BD0_0BD0,
    ];
    match nix::sys::statfs::fstatfs(file) {
        // The magic's C type differs between C libraries and architectures: a signed 32-bit one
        // would make CIFS's and SMB2's negative, so it is read as its 32 bits.
        #[allow(clippy::unnecessary_cast)]
        Ok(found) => !SHARED.contains(&((found.filesystem_type().0 as u32) as i64)),
        Err(_) => false,
    }
}

pub struct FileLock {
    file: Flock<File>,
    record: Box<Record>,
    path: PathBuf,
    identity: FileIdentity,
    check_interval: std::time::Duration,
    observer: Arc<dyn Observer>,
}

#[async_trait]
impl Held for FileLock {
    fn previous(&self) -> Previous {
        self.record.previous
    }

    fn fencing_token(&self) -> Option<String> {
        Some(self.record.lock.fence.token.to_string())
    }

    /// None: the kernel keeps a frozen guard's flock, so no one else can take it meanwhile.
    fn app_deadline(&self) -> Option<tokio::sync::watch::Receiver<crate::deadline::Deadline>> {
        None
    }

    /// The watchdog keeps a copy of the locked descriptor: the kernel frees a `flock` only when its
    /// last descriptor closes, so a SIGKILLed guard's lock then outlives it until the watchdog has
    /// seen the app's group gone. A release (`LOCK_UN`) frees it whatever copies are open.
    fn farewell(&self) -> Farewell<'_> {
        Farewell {
            message: Vec::new(),
            keep: Some(self.file.as_fd()),
        }
    }

    /// None: a file lock's loss is found by the guard's own poll of `lost`, which acts on it before
    /// it yields to anything else.
    fn loss_reports(&self) -> Option<tokio::sync::watch::Receiver<Option<LockLoss>>> {
        None
    }

    /// A flock is freed by one call: nothing to prepare.
    fn release_coming(&self) {}

    /// The fixed delay's skip rule is Redis's alone; `auto` reads the record instead.
    fn released_cleanly(&self) -> bool {
        false
    }

    async fn lost(&mut self) -> LockLoss {
        let mut ticks = tokio::time::interval(self.check_interval);
        loop {
            ticks.tick().await;
            let started = Instant::now();
            let found = std::fs::metadata(&self.path);
            let reason = match found {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => LossReason::LockFileDeleted,
                Ok(meta) if FileIdentity::of(&meta) != self.identity => {
                    LossReason::LockFileReplaced
                }
                // Another stat error (EACCES after a chmod of the directory, say) proves nothing
                // about the lock, which the open descriptor keeps.
                Err(_) => {
                    self.observer.check(CheckOutcome::Error, started.elapsed());
                    continue;
                }
                Ok(_) => {
                    self.observer.check(CheckOutcome::Ok, started.elapsed());
                    continue;
                }
            };
            self.observer.check(CheckOutcome::Error, started.elapsed());
            return LockLoss {
                reason,
                detail: format!("{} no longer names the locked file", self.path.display()),
            };
        }
    }

    async fn give_back(self: Box<Self>) -> Result<(), LockError> {
        let mut this = *self;
        // Never unlink: a contender may already have the inode open and would lock a file no one else
        // can find. Dropping the holder from the record keeps a stale identity from being reported as
        // the holder; the magic line keeps the file recognisably ours.
        let released = LockLine {
            state: RecordState::Released,
            ..this.record.lock.clone()
        };
        let _ = write_record(
            &mut this.file,
            None,
            this.record.claim.as_ref(),
            Some(&released),
        );
        this.file.unlock().map_err(|(_, errno)| {
            LockError::Refused(format!("unlock {}: {errno}", this.path.display()))
        })?;
        info!(event = "lock_released", path = %this.path.display(), "file lock released");
        Ok(())
    }
}

#[async_trait]
impl WindowStore for FileLock {
    /// Windows come from this host's clock: every guard of a file lock runs on this host.
    async fn claim(&mut self, request: &ClaimRequest<'_>) -> Result<ClaimAnswer, LockError> {
        let window = request.window;
        if request.schedule.window_at(window::local_now()) != *window {
            return Ok(ClaimAnswer::NotNow(
                "this host's clock is outside the window",
            ));
        }
        if let Some(blocked) = ClaimAnswer::blocked_by(self.record.claim.as_ref(), window) {
            return Ok(blocked);
        }
        self.write_claim(Claim {
            window_start: window.start,
            holder_id: request.holder.id.clone(),
            host: request.holder.host.clone(),
            claimed_at: window::local_now(),
            end: None,
        })?;
        Ok(ClaimAnswer::Ours)
    }

    async fn record_end(
        &mut self,
        request: &ClaimRequest<'_>,
        exit: RunExit,
    ) -> Result<(), LockError> {
        let Some(claim) =
            self.record.claim.clone().filter(|c| {
                c.window_start == request.window.start && c.holder_id == request.holder.id
            })
        else {
            return Ok(());
        };
        self.write_claim(Claim {
            end: Some(RunEnd {
                exit_code: exit.code,
                finished_at: window::local_now(),
                started: exit.started,
            }),
            ..claim
        })
    }
}

impl FileLock {
    fn write_claim(&mut self, claim: Claim) -> Result<(), LockError> {
        write_record(
            &mut self.file,
            Some(&self.record.holder),
            Some(&claim),
            Some(&self.record.lock),
        )
        .map_err(|e| io_error(&self.path, e))?;
        self.record.claim = Some(claim);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_empty_files_and_our_own_records_are_ours() {
        assert!(is_ours(b""));
        assert!(is_ours(MAGIC.as_bytes()));
        assert!(is_ours(b"# sentinel-gu"), "a record being written");
        assert!(!is_ours(b"important config\n"));
        assert!(
            !is_ours(b"holder_id=abc host=h pid=1 started=2\n"),
            "a record without magic"
        );
        assert!(!is_ours(b"\x7fELF"));
    }
}
