//! systemd's readiness protocol: with `NOTIFY_SOCKET` set, the guard sends `READY=1` once the app runs
//! under the lock, `STATUS=` lines while it waits or stops, and `STOPPING=1`; the app never sees the
//! socket. The test binds the datagram socket itself, as systemd would.

mod common;

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

struct Listener {
    socket: UnixDatagram,
    got: Vec<String>,
}

impl Listener {
    fn at_path(path: &Path) -> Listener {
        Listener::of(UnixDatagram::bind(path).unwrap())
    }

    fn abstract_name(name: &str) -> Listener {
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        Listener::of(UnixDatagram::bind_addr(&addr).unwrap())
    }

    fn of(socket: UnixDatagram) -> Listener {
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        Listener {
            socket,
            got: Vec::new(),
        }
    }

    /// Reads messages until one contains `part`, within `limit`; returns that message.
    fn until(&mut self, part: &str, limit: Duration) -> String {
        let end = Instant::now() + limit;
        let mut buf = [0u8; 4096];
        loop {
            if let Some(found) = self.got.iter().find(|m| m.contains(part)) {
                return found.clone();
            }
            assert!(
                Instant::now() < end,
                "no message with {part:?} within {limit:?}; got {:?}",
                self.got
            );
            if let Ok(n) = self.socket.recv(&mut buf) {
                self.got
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
    }
}

const LIMIT: Duration = Duration::from_secs(10);

#[test]
fn ready_comes_once_the_app_runs_under_the_lock_and_stopping_when_it_is_lost() {
    let mut lab = Lab::new();
    let mut listener = Listener::at_path(&lab.path("notify.sock"));
    let url = lab.file_url("ready.lock");
    let env_seen = lab.path("env");
    let app = format!("env > {}; exec sleep 60", env_seen.display());
    let mut cmd = lab.command(
        &[
            "--url",
            &url,
            "--name",
            "ready",
            "--check-interval",
            "100ms",
        ],
        &["sh", "-c", &app],
    );
    cmd.env("NOTIFY_SOCKET", lab.path("notify.sock"));
    let mut guard = lab.start(cmd);
    let ready = listener.until("READY=1", LIMIT);
    assert!(
        ready.contains("STATUS=running: lock ready held by this guard"),
        "{ready}"
    );
    // READY=1 was sent after the app was started.
    assert!(wait_until(LIMIT, || std::fs::read_to_string(&env_seen)
        .is_ok_and(|e| e.contains("SENTINEL_GUARD_NAME"))));
    let env = std::fs::read_to_string(&env_seen).unwrap();
    assert!(!env.contains("NOTIFY_SOCKET"), "the app saw NOTIFY_SOCKET");
    // A standby says whom it waits for.
    let mut waiting =
        Listener::abstract_name(&format!("sentinel-guard-test-{}", std::process::id()));
    let mut standby_cmd = lab.command(&["--url", &url, "--name", "ready", "--wait"], &["true"]);
    standby_cmd.env(
        "NOTIFY_SOCKET",
        format!("@sentinel-guard-test-{}", std::process::id()),
    );
    let mut standby = lab.start(standby_cmd);
    let status = waiting.until("STATUS=waiting for the lock held by", LIMIT);
    assert!(status.contains("holder_id="), "{status}");
    assert!(!waiting.got.iter().any(|m| m.contains("READY=1")));
    standby.signal(15);
    assert_eq!(standby.code(LIMIT), 1);
    // The leader loses its lock: STOPPING=1 with the reason.
    std::fs::remove_file(lab.path("ready.lock")).unwrap();
    let stopping = listener.until("STOPPING=1", LIMIT);
    assert!(
        stopping.contains("STATUS=stopping the app after lock loss (lock_file_deleted)"),
        "{stopping}"
    );
    assert_eq!(guard.code(LIMIT), 75);
}

#[test]
fn a_notification_socket_nobody_listens_on_changes_nothing() {
    let mut lab = Lab::new();
    let url = lab.file_url("deaf.lock");
    let mut cmd = lab.command(&["--url", &url, "--name", "deaf"], &["sh", "-c", "exit 7"]);
    cmd.env("NOTIFY_SOCKET", lab.path("nobody-here.sock"));
    let mut guard = lab.start(cmd);
    assert_eq!(guard.code(LIMIT), 7);
    let log = guard.log_text();
    assert_eq!(log.matches("notify_failed").count(), 1, "{log}");
}

#[test]
fn a_full_notification_socket_never_holds_the_guard_up() {
    let mut lab = Lab::new();
    let path = lab.path("full.sock");
    let listener = UnixDatagram::bind(&path).unwrap();
    // Fill the listener's queue until a send would block: a systemd that stopped reading.
    let filler = UnixDatagram::unbound().unwrap();
    filler.set_nonblocking(true).unwrap();
    while filler.send_to(&[b'x'; 512], &path).is_ok() {}
    let url = lab.file_url("full.lock");
    let mut cmd = lab.command(&["--url", &url, "--name", "full"], &["sh", "-c", "exit 5"]);
    cmd.env("NOTIFY_SOCKET", &path);
    let started = Instant::now();
    let mut guard = lab.start(cmd);
    assert_eq!(guard.code(LIMIT), 5, "{}", guard.log_text());
    assert!(started.elapsed() < Duration::from_secs(5));
    let log = guard.log_text();
    assert_eq!(log.matches("notify_failed").count(), 1, "{log}");
    drop(listener);
}
