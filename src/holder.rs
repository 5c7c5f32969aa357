//! Who this guard is, as shown to operators and to contenders for the same lock.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

/// The identity a guard writes next to its lock, so a refused instance can say who holds it.
#[derive(Debug, Clone)]
pub struct Holder {
    /// Random per guard process; also given to the app as `SENTINEL_GUARD_HOLDER_ID`.
    pub id: String,
    pub host: String,
    pub pid: u32,
    /// Seconds since the Unix epoch when the guard started.
    pub started: u64,
}

impl Holder {
    pub fn of_this_process() -> Holder {
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "unknown".to_owned());
        Holder {
            id: format!("{:016x}", rand::random::<u64>()),
            host: host.chars().filter(|c| is_plain(*c)).collect(),
            pid: std::process::id(),
            started: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
    }

    /// Parses what `Display` wrote; anything else yields `None` (a foreign or half-written record).
    pub fn parse(text: &str) -> Option<Holder> {
        let field = |key: &str| {
            text.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                .map(str::to_owned)
        };
        Some(Holder {
            id: field("holder_id")?,
            host: field("host")?,
            pid: field("pid")?.parse().ok()?,
            started: field("started")?.parse().ok()?,
        })
    }
}

/// Characters that survive being embedded in SQL comments, files and log lines unquoted.
fn is_plain(c: char) -> bool {
    c.is_ascii_alphanumeric() || "._-".contains(c)
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "holder_id={} host={} pid={} started={}",
            self.id, self.host, self.pid, self.started
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_round_trips_through_parse() {
        let me = Holder::of_this_process();
        let back = Holder::parse(&format!("/* sentinel-guard {me} */")).unwrap();
        assert_eq!(back.id, me.id);
        assert_eq!(back.pid, me.pid);
        assert_eq!(back.host, me.host);
        assert!(Holder::parse("garbage").is_none());
    }
}
