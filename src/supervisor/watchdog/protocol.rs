//! What the guard and its watchdog say to each other: the hand-over at start (the guard's pid, the
//! kept descriptor, the farewell, the cgroup), then the messages, and the pure state machine that
//! turns them into the watchdog's one decision, when to kill the app's tree.

use super::*;

/// What the guard tells its watchdog after the hand-over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// The app's process group: sent by the app's process itself before it executes the command, so
    /// the watchdog knows it before anything of the app can run.
    AppGroup(Pid),
    /// The lock was proven: the app must be dead by this moment if nothing more is heard.
    AppDeadline(Deadline),
    /// The guard is stopping the app itself: SIGKILL the group at this moment if it still lives.
    KillBy(Deadline),
    /// The lock is no longer ours: nothing of it is to be ended or closed on the guard's death.
    LockLost,
    /// The app's tree is gone: exit without acting.
    StandDown,
}

pub(super) const MESSAGE_LEN: usize = 9;

impl Message {
    /// Allocates nothing: the app's process encodes its group between fork and exec.
    pub fn encode(self) -> [u8; MESSAGE_LEN] {
        let (tag, at) = match self {
            Message::AppGroup(group) => (5, u64::from(group.as_raw().unsigned_abs())),
            Message::AppDeadline(at) => (1, at.as_nanos()),
            Message::KillBy(at) => (2, at.as_nanos()),
            Message::LockLost => (3, 0),
            Message::StandDown => (4, 0),
        };
        let mut bytes = [0u8; MESSAGE_LEN];
        bytes[0] = tag;
        bytes[1..].copy_from_slice(&at.to_le_bytes());
        bytes
    }

    pub(super) fn decode(bytes: [u8; MESSAGE_LEN]) -> Option<Message> {
        let mut at = [0u8; 8];
        at.copy_from_slice(&bytes[1..]);
        let at = Deadline::from_nanos(u64::from_le_bytes(at));
        match bytes[0] {
            1 => Some(Message::AppDeadline(at)),
            2 => Some(Message::KillBy(at)),
            3 => Some(Message::LockLost),
            4 => Some(Message::StandDown),
            5 => i32::try_from(at.as_nanos())
                .ok()
                .filter(|group| *group > 1)
                .map(|group| Message::AppGroup(Pid::from_raw(group))),
            _ => None,
        }
    }
}

/// What the watchdog must do to the app's group now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Nothing,
    /// Send the stop signal: the guard is silent and the deadline is within the grace period.
    Stop,
    /// SIGKILL the group: its deadline has come.
    Kill,
}

/// The watchdog's decisions, free of I/O so every transition can be tested.
#[derive(Debug)]
pub(super) struct Switch {
    /// By when the app must be dead; `NEVER` while there is nothing to run out.
    pub(super) app_deadline: Deadline,
    grace: Duration,
    /// The guard is tearing down, or the watchdog has sent the stop signal itself: no stop signal
    /// (again), and the deadline no longer moves later.
    stopping: bool,
    /// The guard is tearing down: a kill at the deadline backs up a guard that is still working,
    /// not one that froze, so the watchdog stays for the stand-down.
    pub(super) teardown: bool,
    /// Whether the lock is still ours to say farewell to on the guard's death.
    pub(super) farewell: bool,
}

impl Switch {
    pub(super) fn new(grace: Duration) -> Switch {
        Switch {
            app_deadline: Deadline::NEVER,
            grace,
            stopping: false,
            teardown: false,
            farewell: true,
        }
    }

    /// When the watchdog sends the stop signal of a silent guard.
    fn stop_at(&self) -> Deadline {
        (self.app_deadline.minus(self.grace) + SLACK).min(self.app_deadline)
    }

    /// What is due at `now`. Checked after every wake-up, before any message is read.
    pub(super) fn due(&self, now: Deadline) -> Action {
        if self.app_deadline == Deadline::NEVER {
            Action::Nothing
        } else if now >= self.app_deadline {
            Action::Kill
        } else if !self.stopping && now >= self.stop_at() {
            Action::Stop
        } else {
            Action::Nothing
        }
    }

    /// When `due` next changes with no message.
    pub(super) fn next_wake(&self) -> Deadline {
        if self.stopping {
            self.app_deadline
        } else {
            self.stop_at()
        }
    }

    pub(super) fn stop_sent(&mut self) {
        self.stopping = true;
    }

    /// The group was SIGKILLed during the guard's teardown: nothing more is due.
    pub(super) fn killed_in_teardown(&mut self) {
        self.app_deadline = Deadline::NEVER;
    }

    /// Applies a message received at `now`. A deadline that has passed is final, and so is one the
    /// app is already being stopped for: neither is ever replaced by a later one.
    pub(super) fn apply(&mut self, message: Message, now: Deadline) {
        let passed = self.app_deadline != Deadline::NEVER && now >= self.app_deadline;
        match message {
            Message::AppDeadline(at) if !passed && !self.stopping => self.app_deadline = at,
            Message::AppDeadline(_) => {}
            Message::KillBy(at) if !passed => {
                self.stopping = true;
                self.teardown = true;
                self.app_deadline = self.app_deadline.min(at);
            }
            Message::KillBy(_) => {}
            Message::LockLost => self.farewell = false,
            Message::AppGroup(_) | Message::StandDown => {}
        }
    }
}

/// The hand-over: the guard's pid, whether fd 4 is kept, the farewell message, and the app's cgroup
/// directory (empty: none), each of the two length-prefixed.
pub(super) fn encode_handover(
    guard: Pid,
    farewell: &Farewell<'_>,
    cgroup: Option<&Path>,
) -> Vec<u8> {
    let cgroup = cgroup.map_or(&[][..], |dir| dir.as_os_str().as_bytes());
    let mut bytes = Vec::with_capacity(farewell.message.len() + cgroup.len() + 13);
    bytes.extend_from_slice(&guard.as_raw().to_le_bytes());
    bytes.push(u8::from(farewell.keep.is_some()));
    for part in [&farewell.message[..], cgroup] {
        let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&part[..len as usize]);
    }
    bytes
}

pub(super) struct Handover {
    pub(super) guard: Pid,
    pub(super) keeps_fd: bool,
    pub(super) message: Vec<u8>,
    pub(super) cgroup: Option<PathBuf>,
}

pub(super) fn decode_handover(pipe: &mut impl Read) -> io::Result<Handover> {
    let mut guard = [0u8; 4];
    pipe.read_exact(&mut guard)?;
    let mut flag = [0u8; 1];
    pipe.read_exact(&mut flag)?;
    let mut part = || -> io::Result<Vec<u8>> {
        let mut len = [0u8; 4];
        pipe.read_exact(&mut len)?;
        let mut bytes = vec![0u8; u32::from_le_bytes(len) as usize];
        pipe.read_exact(&mut bytes)?;
        Ok(bytes)
    };
    let message = part()?;
    let cgroup = part()?;
    Ok(Handover {
        guard: Pid::from_raw(i32::from_le_bytes(guard)),
        keeps_fd: flag[0] == 1,
        message,
        cgroup: (!cgroup.is_empty()).then(|| PathBuf::from(OsString::from_vec(cgroup))),
    })
}
