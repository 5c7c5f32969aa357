//! `SENTINEL_GUARD_SOCKET`: the app asks the guard, between units of work, whether the lock is still
//! held and for how long the guard can still promise it; `sentinel-guard held` is the asking side.
//!
//! The guard answers each connection with one JSON line and closes it. Nothing is read from the
//! client and nothing is kept per connection, so a flood of clients costs the guard one accept and
//! one write each, and no client can make it wait.

use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::backend::{HeldLock, LockLoss};
use crate::deadline::Deadline;
use crate::vocab::{show_duration, ENV_FENCING_TOKEN, ENV_SOCKET, EXIT_LOCK_LOST, EXIT_USAGE};

/// The socket's name inside the guard's private directory.
const SOCKET_FILE: &str = "held.sock";
/// The longest path a Unix socket address holds (`sun_path`, less its final NUL).
const MAX_SOCKET_PATH: usize = 107;
/// How long `held` waits for the guard's answer; the guard answers as it accepts.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest answer `held` reads; the guard's is a few hundred bytes.
const MAX_ANSWER: u64 = 4096;

/// What the guard can vouch for now. Shared by the guard, which changes it, and the socket, which
/// reads it; held only for the instant of a change or of an answer.
#[derive(Clone)]
pub struct Vouching {
    state: Arc<Mutex<State>>,
    name: String,
    backend: &'static str,
    holder_id: String,
}

enum State {
    /// No app of a held lock runs: before the first acquisition, during a takeover delay, between
    /// scheduled runs, and from the moment a loss is known or a stop begins.
    NotHeld(String),
    /// An acquisition's app runs: the deadline the lock layer keeps moving, and the grace period
    /// that the guard takes off it (the app must be dead by that deadline, so the lock is promised
    /// only until its grace period starts); and where the lock's own task reports a loss, read at
    /// each answer, since the guard may not have acted on a report yet.
    Held {
        fencing_token: Option<String>,
        app_deadline: Option<watch::Receiver<Deadline>>,
        lost: Option<watch::Receiver<Option<LockLoss>>>,
        grace: Duration,
    },
    /// `SINGLE_INSTANCE_GUARD=false`: no lock at all, which the answer says.
    Unguarded,
}

impl Vouching {
    pub fn new(name: &str, backend: &'static str, holder_id: &str) -> Vouching {
        Vouching {
            state: Arc::new(Mutex::new(State::NotHeld(
                "the lock has not been taken yet".to_owned(),
            ))),
            name: name.to_owned(),
            backend,
            holder_id: holder_id.to_owned(),
        }
    }

    fn set(&self, state: State) {
        // A poisoned lock only means an answer panicked; the state itself is whole.
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
    }

    /// The app of `lock`'s acquisition is about to start.
    pub fn held(&self, lock: &HeldLock, grace: Duration) {
        self.set(State::Held {
            fencing_token: lock.fencing_token(),
            app_deadline: lock.app_deadline(),
            lost: lock.loss_reports(),
            grace,
        });
    }

    pub fn unguarded(&self) {
        self.set(State::Unguarded);
    }

    /// From now on, "not held" for `why`: called before the app is signalled, and nothing but a new
    /// acquisition (`held`) says "held" again.
    pub fn not_held(&self, why: impl Into<String>) {
        self.set(State::NotHeld(why.into()));
    }

    /// The JSON line a client gets. A lock whose promise has run out (its deadline, less the grace
    /// period, passed without a renewal) turns "not held" here for good, even before the guard's
    /// own timer reads the same deadline.
    fn answer(&self) -> String {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let State::Held {
            app_deadline,
            lost,
            grace,
            ..
        } = &*state
        {
            let reported = lost.as_ref().and_then(|rx| rx.borrow().clone());
            let expired = app_deadline
                .as_ref()
                .is_some_and(|rx| rx.borrow().minus(*grace).has_passed());
            if let Some(loss) = reported {
                *state = State::NotHeld(format!("the lock was lost ({})", loss.reason));
            } else if expired {
                *state = State::NotHeld(
                    "the lock's deadline passed without proof of ownership".to_owned(),
                );
            }
        }
        let (name, backend, holder_id) = (&self.name, self.backend, &self.holder_id);
        match &*state {
            State::Held {
                fencing_token,
                app_deadline,
                grace,
                ..
            } => {
                let valid_for_ms = app_deadline
                    .as_ref()
                    .map(|rx| rx.borrow().minus(*grace))
                    .filter(|until| *until != Deadline::NEVER)
                    .map(|until| u64::try_from(until.remaining().as_millis()).unwrap_or(u64::MAX));
                json!({"held": true, "name": name, "backend": backend, "holder_id": holder_id,
                       "fencing_token": fencing_token, "valid_for_ms": valid_for_ms})
            }
            State::Unguarded => json!({"held": true, "unguarded": true, "name": name,
                                       "backend": backend, "holder_id": holder_id, "valid_for_ms": null}),
            State::NotHeld(why) => json!({"held": false, "name": name, "backend": backend,
                                          "holder_id": holder_id, "reason": why}),
        }
        .to_string()
    }
}

/// The socket in its private directory, both removed when the guard ends.
pub struct HeldSocket {
    dir: PathBuf,
    listener: Option<std::os::unix::net::UnixListener>,
}

impl HeldSocket {
    /// Makes a directory only the guard's user can enter and binds the socket in it, in the first
    /// of `$XDG_RUNTIME_DIR`, `$TMPDIR` and `/tmp` that is an absolute directory where that works
    /// (a read-only root, a path too long for a socket address). The directory's name is random and
    /// mkdir fails on an existing name, so no one can prepare it in advance. Every place tried and
    /// why it failed, when none works.
    pub fn bind() -> Result<HeldSocket, String> {
        let mut tried = Vec::new();
        let bases = ["XDG_RUNTIME_DIR", "TMPDIR"]
            .into_iter()
            .filter_map(|var| std::env::var_os(var).map(PathBuf::from))
            .chain(std::iter::once(PathBuf::from("/tmp")));
        for base in bases {
            if !base.is_absolute() || !base.is_dir() {
                tried.push(format!("{}: not an absolute directory", base.display()));
                continue;
            }
            match HeldSocket::bind_in(&base) {
                Ok(socket) => return Ok(socket),
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(tried.join("; "))
    }

    fn bind_in(base: &Path) -> io::Result<HeldSocket> {
        let dir = base.join(format!(
            "sentinel-guard-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let path = dir.join(SOCKET_FILE);
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(io::Error::other(format!(
                "{}: longer than a socket address can be",
                path.display()
            )));
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
        // Removed again by its drop should anything below fail.
        let mut socket = HeldSocket {
            dir,
            listener: None,
        };
        // The umask may have narrowed the mode, never widened it; set it exactly.
        std::fs::set_permissions(&socket.dir, std::fs::Permissions::from_mode(0o700))?;
        let listener = std::os::unix::net::UnixListener::bind(&path)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        socket.listener = Some(listener);
        Ok(socket)
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(SOCKET_FILE)
    }

    /// Answers every connection until the runtime ends. Must be called from within the runtime.
    pub fn serve(&mut self, vouching: Vouching) -> io::Result<()> {
        let Some(listener) = self.listener.take() else {
            return Ok(());
        };
        let listener = UnixListener::from_std(listener)?;
        debug!(event = "held_socket_listening", path = %self.path().display(), "answering the app's questions about the lock");
        tokio::spawn(answer_all(listener, vouching));
        Ok(())
    }
}

impl Drop for HeldSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join(SOCKET_FILE));
        let _ = std::fs::remove_dir(&self.dir);
    }
}

async fn answer_all(listener: UnixListener, vouching: Vouching) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let mut line = vouching.answer();
                line.push('\n');
                // A fresh socket's buffer takes the whole line; should it not, the client gets a
                // short line it refuses, and the guard never waits for a reader.
                let _ = stream.try_write(line.as_bytes());
            }
            Err(e) => {
                // Out of descriptors and the like: pause instead of spinning on the error.
                warn!(event = "held_socket_error", error = %e, "cannot accept a connection on the app's socket");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// `sentinel-guard held`: asks the guard named by `SENTINEL_GUARD_SOCKET`; the exit code says
/// held (0), not held or not for long enough (75), or no guard to ask (2).
pub fn ask(min_validity: Duration, json_output: bool) -> u8 {
    let Some(path) = std::env::var_os(ENV_SOCKET).filter(|p| !p.is_empty()) else {
        eprintln!("sentinel-guard held: not run under a guard: {ENV_SOCKET} is not set (run this from the app a guard started)");
        return EXIT_USAGE;
    };
    let path = PathBuf::from(path);
    let line = match read_answer(&path) {
        Ok(line) => line,
        Err(e) => {
            eprintln!("sentinel-guard held: no guard answers at {} ({ENV_SOCKET}): {e}; the guard has ended or this is not run under one", path.display());
            return EXIT_USAGE;
        }
    };
    let Ok(answer) = serde_json::from_str::<serde_json::Value>(&line) else {
        eprintln!(
            "sentinel-guard held: what answers at {} is not a guard",
            path.display()
        );
        return EXIT_USAGE;
    };
    let held = answer["held"].as_bool() == Some(true);
    let valid_for = answer["valid_for_ms"].as_u64().map(Duration::from_millis);
    // A process started under an earlier acquisition (with --rejoin) is not the app of this one.
    let own_token = std::env::var(ENV_FENCING_TOKEN).ok();
    let other_acquisition = match (&own_token, answer["fencing_token"].as_str()) {
        (Some(own), Some(now)) => own != now,
        _ => false,
    };
    let verdict = match (held, valid_for) {
        (false, _) => Err(format!(
            "not held: {}",
            answer["reason"].as_str().unwrap_or("no reason given")
        )),
        (true, _) if other_acquisition => Err(format!(
            "held, but by a later acquisition (fencing token {}) than the one this process was started under ({})",
            answer["fencing_token"].as_str().unwrap_or_default(),
            own_token.unwrap_or_default()
        )),
        (true, Some(valid_for)) if valid_for < min_validity => Err(format!(
            "held, but promised for {} only, less than --min-validity {}",
            show_duration(valid_for),
            show_duration(min_validity)
        )),
        (true, _) => Ok(()),
    };
    if json_output {
        println!("{answer}");
    } else {
        println!("{}", text_line(&answer));
    }
    if answer["unguarded"].as_bool() == Some(true) {
        eprintln!("sentinel-guard held: unguarded (SINGLE_INSTANCE_GUARD=false): no lock is held, and every copy of the app is told yes");
    }
    match verdict {
        Ok(()) => 0,
        Err(why) => {
            eprintln!("sentinel-guard held: {why}");
            EXIT_LOCK_LOST
        }
    }
}

fn read_answer(path: &Path) -> io::Result<String> {
    let stream = UnixStream::connect(path)?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let mut line = String::new();
    stream.take(MAX_ANSWER).read_to_string(&mut line)?;
    if !line.ends_with('\n') {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the answer ended before its line did",
        ));
    }
    Ok(line.trim_end().to_owned())
}

/// The answer as `key=value` pairs in the answer's order, as `status` prints its line.
fn text_line(answer: &serde_json::Value) -> String {
    let Some(fields) = answer.as_object() else {
        return answer.to_string();
    };
    fields
        .iter()
        .map(|(key, value)| match value {
            serde_json::Value::String(s) if !s.contains(char::is_whitespace) && !s.is_empty() => {
                format!("{key}={s}")
            }
            serde_json::Value::String(s) => format!("{key}={s:?}"),
            other => format!("{key}={other}"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}
