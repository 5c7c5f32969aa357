//! A copy of a session lock's own socket, for the watchdog to hold.
//!
//! A MySQL or PostgreSQL lock lives as long as its session, and the session as long as its socket.
//! When the guard dies its descriptors close, and a server whose session sat idle between checks
//! sees the end of the stream at once and frees the lock, while the watchdog may still be killing
//! what is left of the app's group (a process stuck in uninterruptible sleep outlives SIGKILL for as
//! long as it is stuck). A copy of the descriptor in the watchdog keeps the socket, and with it the
//! session and the lock, open until the group is gone, as the file backend's copy of its locked
//! descriptor does.
//!
//! The drivers do not hand out their sockets, so the socket is found among the guard's descriptors:
//! the one TCP socket whose local port is the client port the server reports for the session and
//! whose peer port is the server's. Where that is not exactly one (a proxy that translates ports, a
//! Unix socket), there is no copy and the server's own detection applies, as before.

use std::fs;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::fcntl::{fcntl, FcntlArg};
use nix::sys::socket::{getpeername, getsockname, SockaddrStorage};
use nix::sys::stat::{fstat, SFlag};

/// A close-on-exec copy of the one socket of this process connected from local port `client` to
/// remote port `server`, if there is exactly one.
pub fn copy(client: u16, server: u16) -> Option<OwnedFd> {
    let mut found: Option<RawFd> = None;
    for entry in fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok())
        else {
            continue;
        };
        // SAFETY: only looked at for the duration of this iteration; a descriptor closed meanwhile
        // (the directory's own, say) makes the calls below fail, and nothing else.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        if !is_socket(borrowed) {
            continue;
        }
        if port(getsockname::<SockaddrStorage>(fd).ok()) == Some(client)
            && port(getpeername::<SockaddrStorage>(fd).ok()) == Some(server)
        {
            if found.is_some() {
                return None;
            }
            found = Some(fd);
        }
    }
    // SAFETY: the descriptor is the session's socket, open for as long as the caller holds the
    // connection it belongs to, which it does while asking for this copy.
    let fd = unsafe { BorrowedFd::borrow_raw(found?) };
    let copy = fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(10)).ok()?;
    // SAFETY: a descriptor fcntl just made, owned here alone.
    Some(unsafe { OwnedFd::from_raw_fd(copy) })
}

fn is_socket(fd: BorrowedFd<'_>) -> bool {
    fstat(fd.as_fd())
        .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFSOCK)
}

/// The port of an IPv4 or IPv6 address; none for any other kind of socket.
fn port(addr: Option<SockaddrStorage>) -> Option<u16> {
    let addr = addr?;
    addr.as_sockaddr_in()
        .map(|v4| v4.port())
        .or_else(|| addr.as_sockaddr_in6().map(|v6| v6.port()))
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn the_one_socket_between_two_ports_is_copied_and_no_other() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap().port();
        let client = TcpStream::connect(("127.0.0.1", server)).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let local = client.local_addr().unwrap().port();
        let found = copy(local, server).expect("found");
        assert_ne!(found.as_raw_fd(), client.as_raw_fd());
        assert_eq!(
            port(getpeername::<SockaddrStorage>(found.as_raw_fd()).ok()),
            Some(server)
        );
        // The accepted end runs the other way round; nothing else matches.
        let other_way = copy(server, local).expect("the accepted end");
        assert_eq!(
            port(getpeername::<SockaddrStorage>(other_way.as_raw_fd()).ok()),
            Some(local)
        );
        assert!(copy(local, local).is_none());
        drop(accepted);
    }
}
