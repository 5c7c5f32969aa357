//! Signals sent to the guard become events to forward to the app.

use nix::libc;
use nix::sys::signal::Signal;
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
        Ok(SignalEvents { received })
    }

    pub async fn next(&mut self) -> i32 {
        match self.received.recv().await {
            Some(signal) => signal,
            None => std::future::pending().await,
        }
    }
}
