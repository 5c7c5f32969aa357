//! Reading the guard's own input files (`--url-file`, `--ca-file`, PostgreSQL's `sslrootcert=`):
//! no path given there may make start-up, or a watchdog's farewell, wait or fill memory. And opening
//! only the regular file that was looked at, here and for lock files.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Far above any URL or CA bundle (Debian's whole bundle is about 220 KB).
const MAX_LEN: u64 = 4 << 20;

/// The content of a regular file of at most `MAX_LEN` bytes. Anything else is refused before it is
/// opened for real (a FIFO would block the read until a writer came, a device could be armed by the
/// open): `O_PATH` names the file without opening it, and the file read is the one looked at
/// (`reopen`); symbolic links are followed, as CA bundles usually are links.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let refuse = |why: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, why.to_owned()));
    let found = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_PATH)
        .open(path)?;
    if !found.metadata()?.is_file() {
        return refuse("not a regular file");
    }
    let mut options = OpenOptions::new();
    options.read(true);
    let Some(file) = reopen(path, &found, &options, 0)? else {
        return refuse("it was replaced while the guard opened it; try again");
    };
    let meta = file.metadata()?;
    if meta.len() > MAX_LEN {
        return refuse(&format!("larger than {MAX_LEN} bytes"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_LEN + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_LEN {
        return refuse(&format!("larger than {MAX_LEN} bytes"));
    }
    Ok(bytes)
}

/// Opens for real the file that `found` (an `O_PATH` descriptor of a regular file) names, and no
/// other: through `/proc/self/fd`, which names the very inode looked at, so a path swapped meanwhile
/// cannot slip a FIFO or a device in. Where that fails (no /proc in a bare chroot, a policy that
/// refuses it), `path` itself, which a special file swapped in at that moment would see opened before
/// it is refused. Never waiting, never a controlling terminal, and `extra_flags` on the path. Either
/// way the inode opened is compared with the one looked at: `None` when it is another.
pub fn reopen(
    path: &Path,
    found: &File,
    options: &OpenOptions,
    extra_flags: i32,
) -> io::Result<Option<File>> {
    reopen_in(
        Path::new("/proc/self/fd"),
        path,
        found,
        options,
        extra_flags,
    )
}

fn reopen_in(
    fd_dir: &Path,
    path: &Path,
    found: &File,
    options: &OpenOptions,
    extra_flags: i32,
) -> io::Result<Option<File>> {
    let safe = nix::libc::O_NOCTTY | nix::libc::O_NONBLOCK;
    // The fd's link is followed, as it must be: it is not the path, but the inode itself.
    let file = match options
        .clone()
        .custom_flags(safe)
        .open(fd_dir.join(found.as_raw_fd().to_string()))
    {
        Ok(file) => file,
        Err(_) => options
            .clone()
            .custom_flags(safe | extra_flags)
            .open(path)?,
    };
    let same = |f: &File| f.metadata().ok().map(|m| (m.dev(), m.ino()));
    Ok((same(&file).is_some() && same(&file) == same(found)).then_some(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_opened_is_the_one_looked_at() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("url");
        std::fs::write(&path, b"first").unwrap();
        let found = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_PATH)
            .open(&path)
            .unwrap();
        // Swapped in between the look and the open: a FIFO, whose open would wait for a writer.
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        std::fs::rename(&fifo, &path).unwrap();
        let mut options = OpenOptions::new();
        options.read(true);
        let mut text = String::new();
        reopen(&path, &found, &options, 0)
            .unwrap()
            .expect("the file looked at")
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "first");
        // Without /proc the path is opened and found to be another file.
        let other = dir.path().join("other");
        std::fs::write(&other, b"second").unwrap();
        std::fs::rename(&other, &path).unwrap();
        let no_proc = dir.path().join("no-proc");
        assert!(reopen_in(&no_proc, &path, &found, &options, 0)
            .unwrap()
            .is_none());
        let found = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_PATH)
            .open(&path)
            .unwrap();
        assert!(reopen_in(&no_proc, &path, &found, &options, 0)
            .unwrap()
            .is_some());
    }

    #[test]
    fn only_a_small_regular_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ca.pem");
        std::fs::write(&file, b"pem").unwrap();
        assert_eq!(read(&file).unwrap(), b"pem");
        let link = dir.path().join("link.pem");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read(&link).unwrap(), b"pem");
        // A FIFO with no writer: refused at once, where a plain read would wait for ever.
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(read(&fifo).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert!(read(dir.path()).is_err());
        assert!(read(Path::new("/dev/zero")).is_err());
        let big = dir.path().join("big");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(MAX_LEN + 1)
            .unwrap();
        assert!(read(&big).is_err());
    }
}
