//! systemd's readiness protocol (`sd_notify`): when `NOTIFY_SOCKET` names a socket, the guard tells
//! systemd when the app runs under the lock (`READY=1`), what it is doing (`STATUS=`), and that it is
//! stopping (`STOPPING=1`).
//!
//! One datagram per message on a non-blocking socket, so no send ever waits, and none is on the way
//! to a kill (each is sent after the signal it reports). A failed send is logged once and otherwise
//! ignored: systemd's view is a convenience, the lock's safety never depends on it.

use std::ffi::OsStr;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use tracing::warn;

/// Where systemd listens; a leading `@` names a socket in the abstract namespace.
pub const SOCKET_VAR: &str = "NOTIFY_SOCKET";

struct Notifier {
    socket: UnixDatagram,
    to: SocketAddr,
}

static NOTIFIER: OnceLock<Option<Notifier>> = OnceLock::new();
static SEND_FAILED: AtomicBool = AtomicBool::new(false);

/// Opens the socket if `NOTIFY_SOCKET` is set; without it every message is a no-op.
pub fn init() {
    NOTIFIER.get_or_init(|| {
        let path = std::env::var_os(SOCKET_VAR)?;
        match open(&path) {
            Ok(notifier) => Some(notifier),
            Err(e) => {
                warn!(event = "notify_failed", error = %e, socket = %path.to_string_lossy(), "cannot open systemd's notification socket; systemd will not hear from the guard");
                None
            }
        }
    });
}

fn open(path: &OsStr) -> io::Result<Notifier> {
    let to = match path.as_bytes().strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(path)?,
    };
    let socket = UnixDatagram::unbound()?;
    socket.set_nonblocking(true)?;
    Ok(Notifier { socket, to })
}

/// The app runs under the lock (or unguarded): the service is up.
pub fn ready(status: &str) {
    send(&format!("READY=1\nSTATUS={}", one_line(status)));
}

pub fn status(status: &str) {
    send(&format!("STATUS={}", one_line(status)));
}

/// The guard has begun stopping the app.
pub fn stopping(status: &str) {
    send(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
}

/// A `STATUS=` value ends at the first newline.
fn one_line(status: &str) -> String {
    status.replace(['\n', '\r'], " ")
}

fn send(message: &str) {
    let Some(Some(notifier)) = NOTIFIER.get() else {
        return;
    };
    if let Err(e) = notifier
        .socket
        .send_to_addr(message.as_bytes(), &notifier.to)
    {
        if !SEND_FAILED.swap(true, Ordering::Relaxed) {
            warn!(event = "notify_failed", error = %e, "cannot notify systemd; later failures are not logged");
        }
    }
}
