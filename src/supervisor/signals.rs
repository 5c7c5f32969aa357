//! Signals sent to the guard become events to forward to the app.

use nix::libc;
use nix::sys::signal::{kill, Signal};
use nix::unistd::{getpid, getppid, Pid};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// Every catchable signal except SIGCHLD (the reaper's), the synchronous ones (SEGV, BUS, ILL, FPE,
/// ABRT, TRAP, SYS: they describe a fault of the guard itself) and SIGPIPE (raised by the guard's own
/// writes to a closed pipe, never meant for the app). Catching TSTP/TTIN/TTOU also means the guard
/// is never stopped by them.
fn forwarded() -> Vec<i32> {
    let named = [
        Signal::SIGHUP,
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGALRM,
        Signal::SIGTERM,
        Signal::SIGCONT,
        Signal::SIGTSTP,
        Signal::SIGTTIN,
        Signal::SIGTTOU,
        Signal::SIGURG,
        Signal::SIGXCPU,
        Signal::SIGXFSZ,
        Signal::SIGVTALRM,
        Signal::SIGPROF,
        Signal::SIGWINCH,
        Signal::SIGIO,
        Signal::SIGPWR,
    ];
    named
        .into_iter()
        .map(|s| s as i32)
        .chain(libc::SIGRTMIN()..=libc::SIGRTMAX())
        .collect()
}

/// Signals after which the app gets grace-period to exit before it is killed.
pub fn is_shutdown(signal: i32) -> bool {
    signal == Signal::SIGTERM as i32 || signal == Signal::SIGINT as i32
}

/// Signals that end the guard while no app runs yet (taking or waiting for the lock, takeover delay):
/// the ones whose default action would have terminated it.
pub fn ends_wait(signal: i32) -> bool {
    [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ]
    .iter()
    .any(|s| *s as i32 == signal)
}

pub struct SignalEvents {
    received: mpsc::UnboundedReceiver<i32>,
    /// A SIGTERM or SIGINT was read: the guard is asked to end once its app has stopped (a
    /// scheduler starts no later run).
    shutdown_asked: bool,
}

impl SignalEvents {
    /// Installs the handlers. Until then a signal has its default effect, which for most is to kill
    /// the guard (and with it, through PDEATHSIG, the app).
    pub fn register() -> std::io::Result<SignalEvents> {
        let (sender, received) = mpsc::unbounded_channel();
        for number in forwarded() {
            let mut stream = signal(SignalKind::from_raw(number))?;
            let sender = sender.clone();
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if sender.send(number).is_err() {
                        return;
                    }
                }
            });
        }
        Ok(SignalEvents {
            received,
            shutdown_asked: false,
        })
    }

    /// Signals that a test sends down the channel instead of the kernel.
    #[cfg(test)]
    pub fn from_test(received: mpsc::UnboundedReceiver<i32>) -> SignalEvents {
        SignalEvents {
            received,
            shutdown_asked: false,
        }
    }

    pub async fn next(&mut self) -> i32 {
        match self.received.recv().await {
            Some(signal) => {
                self.shutdown_asked |= is_shutdown(signal);
                signal
            }
            None => std::future::pending().await,
        }
    }

    /// Whether a SIGTERM or SIGINT has been read.
    pub fn shutdown_asked(&self) -> bool {
        self.shutdown_asked
    }
}

/// What `--parent-death-signal` found when it was set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParentWatch {
    /// The kernel sends the signal when the parent dies.
    Armed,
    /// The parent the guard started under was already gone; the guard sent the signal to itself.
    AlreadyGone,
    /// The guard is PID 1 of a namespace, whose parent lives outside it and has no pid here: armed,
    /// but a parent that died before that cannot be noticed.
    Unseen,
}

/// Asks the kernel to send `signal` to the guard when its parent dies (`PR_SET_PDEATHSIG`). Call it
/// once the handlers are installed, so the signal arrives as an event like any other. A parent that
/// died before the request never triggers it, so the guard compares its parent with
/// `parent_at_start`, read first thing in `main`, and sends the signal itself if that one is gone.
pub fn on_parent_death(signal: Signal, parent_at_start: Pid) -> nix::Result<ParentWatch> {
    nix::sys::prctl::set_pdeathsig(signal)?;
    if parent_at_start.as_raw() == 0 {
        return Ok(ParentWatch::Unseen);
    }
    if getppid() != parent_at_start {
        kill(getpid(), signal)?;
        return Ok(ParentWatch::AlreadyGone);
    }
    Ok(ParentWatch::Armed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SIGWINCH is ignored by default, so the test process survives sending it to itself.
    #[test]
    fn a_parent_other_than_the_one_at_start_means_it_died_before_the_signal_was_set() {
        let signal = Signal::SIGWINCH;
        assert_eq!(on_parent_death(signal, getppid()), Ok(ParentWatch::Armed));
        let someone_else = Pid::from_raw(getppid().as_raw() + 1_000_000);
        assert_eq!(
            on_parent_death(signal, someone_else),
            Ok(ParentWatch::AlreadyGone)
        );
        assert_eq!(
            on_parent_death(signal, Pid::from_raw(0)),
            Ok(ParentWatch::Unseen)
        );
        nix::sys::prctl::set_pdeathsig(None).unwrap();
    }
}
