//! Reading the guard's own input files (`--url-file`, `--ca-file`, PostgreSQL's `sslrootcert=`):
//! no path given there may make start-up, or a watchdog's farewell, wait or fill memory.

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Far above any URL or CA bundle (Debian's whole bundle is about 220 KB).
const MAX_LEN: u64 = 4 << 20;

/// The content of a regular file of at most `MAX_LEN` bytes. Anything else is refused before it is
/// opened (a FIFO would block the read until a writer came, a device could be armed by the open),
/// and checked again once open, as the path may have changed between; symbolic links are followed,
/// as CA bundles usually are links.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let refuse = |why: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, why.to_owned()));
    if !std::fs::metadata(path)?.is_file() {
        return refuse("not a regular file");
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return refuse("not a regular file");
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
