//! The lock file's content: the holder's identity, the lock line (state, bound, fencing token) and
//! the last claimed window, written in place while the lock is held and read by the next holder.

use super::*;

/// Overwrites the record in place, magic line first, then cuts what an older, longer record left:
/// the file never stops starting with the magic line, so a contender never mistakes it for a foreign
/// file. The record is the holder while held, and the last claimed window of scheduled runs, which
/// outlives every holder. Only called with the lock held, on a file `open` found to be ours.
pub(super) fn write_record(
    file: &mut File,
    holder: Option<&Holder>,
    claim: Option<&Claim>,
    lock: Option<&LockLine>,
) -> std::io::Result<()> {
    let mut record = format!("{MAGIC}\n");
    if let Some(holder) = holder {
        record.push_str(&format!("{holder}\n"));
    }
    if let Some(claim) = claim {
        record.push_str(&format!("{}\n", claim.encode()));
    }
    if let Some(lock) = lock {
        record.push_str(&format!("{}\n", lock.encode()));
    }
    file.seek(SeekFrom::Start(0))?;
    file.write_all(record.as_bytes())?;
    file.set_len(record.len() as u64)?;
    file.flush()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileIdentity {
    dev: u64,
    ino: u64,
}

impl FileIdentity {
    pub(super) fn of(meta: &std::fs::Metadata) -> FileIdentity {
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }

    pub(super) fn at(path: &Path) -> Option<FileIdentity> {
        std::fs::metadata(path).ok().map(|m| FileIdentity::of(&m))
    }
}

/// Far above a record's two lines: a lock file grown past it (written to by something else) is read
/// only this far, so it cannot fill the guard's memory; whatever record it holds beyond counts as
/// none, and the hand-over waits.
const MAX_RECORD_LEN: u64 = 64 << 10;

/// The file's text from where it is read, at most `MAX_RECORD_LEN` bytes of it; a character cut
/// at that end (or any byte that is not UTF-8) spoils only itself, not the lines before it.
pub(super) fn read_text(file: &mut File) -> Option<String> {
    let mut bytes = Vec::new();
    file.take(MAX_RECORD_LEN).read_to_end(&mut bytes).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The claim line and the lock line of the record, where there are.
pub(super) fn read_records(file: &mut File) -> (Option<Claim>, Option<LockLine>) {
    let Some(text) = file
        .seek(SeekFrom::Start(0))
        .ok()
        .and_then(|_| read_text(file))
    else {
        return (None, None);
    };
    (
        text.lines().find_map(Claim::parse),
        text.lines().find_map(LockLine::parse),
    )
}

/// The last claimed window recorded in the lock file, read without taking the lock.
pub fn last_claim(path: &Path) -> Option<Claim> {
    read_records(&mut open_to_read(path).ok()??).0
}

/// The lock file's record, read without taking the lock.
pub fn last_record(path: &Path) -> Option<RecordFacts> {
    let line = read_records(&mut open_to_read(path).ok()??).1?;
    Some(RecordFacts {
        state: line.state,
        token: line.fence.token,
    })
}

/// The lock file's lock record: its state, the fencing token of the acquisition that wrote it, the
/// file it was written in, and that holder's "app dead by" bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LockLine {
    pub(super) state: RecordState,
    pub(super) fence: Fence,
    pub(super) place: Place,
    pub(super) bound: std::time::Duration,
}

/// The file a lock line was written in: its inode, and the path it was locked at. A lock file
/// renamed or linked over this path from another lock keeps its inode, not its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Place {
    identity: FileIdentity,
    /// The absolute path, each byte escaped as Rust escapes ASCII (`\n`, `\xNN`), so the line
    /// stays one line; compared in this form, never decoded.
    path: String,
}

impl Place {
    pub(super) fn of(path: &Path, identity: FileIdentity) -> Place {
        use std::os::unix::ffi::OsStrExt;
        let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
        Place {
            identity,
            path: absolute
                .as_os_str()
                .as_bytes()
                .iter()
                .flat_map(|b| std::ascii::escape_default(*b))
                .map(char::from)
                .collect(),
        }
    }
}

/// This host's clock in microseconds since the epoch: every guard of a file lock reads it.
pub(super) fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as u64)
}

impl LockLine {
    /// The path last: it may hold spaces.
    fn encode(&self) -> String {
        format!(
            "lock_state={} fence={} drawn_us={} dev={} ino={} bound_ms={} path={}",
            self.state.as_str(),
            self.fence.token,
            self.fence.drawn_us,
            self.place.identity.dev,
            self.place.identity.ino,
            self.bound.as_millis(),
            self.place.path,
        )
    }

    fn parse(line: &str) -> Option<LockLine> {
        let (fields, path) = line.split_once(" path=")?;
        let field = |key: &str| {
            fields
                .split(' ')
                .find_map(|pair| pair.strip_prefix(key)?.strip_prefix('='))
        };
        let number = |key: &str| field(key)?.parse::<u64>().ok();
        Some(LockLine {
            state: RecordState::parse(field("lock_state")?)?,
            fence: Fence {
                token: number("fence")?,
                drawn_us: number("drawn_us")?,
            },
            place: Place {
                identity: FileIdentity {
                    dev: number("dev")?,
                    ino: number("ino")?,
                },
                path: path.to_owned(),
            },
            bound: std::time::Duration::from_millis(number("bound_ms")?),
        })
    }
}

/// What the lock line found in a freshly locked file says of the previous holder. A `flock` is freed
/// only by its holder's unlock (after its release wrote `released`) or when every descriptor of it
/// is closed: the guard's, and the watchdog's copy, which it closes only once the app's tree is
/// gone. So a `held` line written in this very file, at this path, means the tree is gone, where
/// the lock is the kernel's (`kernel_lock`): a network file system's server may drop a client's
/// lock (a lease that ran out, an evicted client) while its descriptors stay open. In another file
/// or at another path (the path was deleted or replaced, a lock file renamed or linked over it, a
/// record copied) it proves nothing: the lock was taken away. `Err` with the token of a line whose
/// counter was set back (`Fence::set_back`).
pub(super) fn previous_holder(
    found: Option<&LockLine>,
    place: &Place,
    kernel_lock: bool,
    own_bound: std::time::Duration,
) -> Result<Previous, Fence> {
    Ok(match found {
        None => Previous::MayRun {
            bound: own_bound,
            why: "no_record",
        },
        Some(line) if line.fence.set_back() => return Err(line.fence),
        Some(line) if line.place != *place => Previous::MayRun {
            bound: line.bound.max(own_bound),
            why: "taken_away",
        },
        Some(line) if line.state == RecordState::Held && !kernel_lock => Previous::MayRun {
            bound: line.bound.max(own_bound),
            why: "shared_filesystem",
        },
        Some(line) if line.state == RecordState::Held => Previous::Gone("tree_gone"),
        Some(line) => Previous::from_record(line.state, line.bound),
    })
}

/// What the held lock's file says: the holder, the last claimed window (kept across holders), and
/// the lock line this acquisition wrote.
pub(super) struct Record {
    pub(super) holder: Holder,
    pub(super) claim: Option<Claim>,
    pub(super) lock: LockLine,
    pub(super) previous: Previous,
}
