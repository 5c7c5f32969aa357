//! The farewell message of a session-holding backend (MySQL, PostgreSQL, and etcd, whose lease is
//! its session): what the guard's watchdog needs to end the dead guard's session once its app is
//! gone, so a standby takes over at once rather than when the server notices the dead client (at
//! the end of the outstanding check, or of the lease).
//!
//! The watchdog acts only if the lock is still held by that very session, as its backend checks:
//! after a server restart session ids start again, and the id may by then be a stranger's.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::{CaFile, SecretUrl, Target};

/// Which backend wrote a message, and so which one ends the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Mysql,
    Postgres,
    Etcd,
}

impl Server {
    fn tag(self) -> u8 {
        match self {
            Server::Mysql => b'm',
            Server::Postgres => b'p',
            Server::Etcd => b'e',
        }
    }

    fn of_tag(tag: u8) -> Option<Server> {
        [Server::Mysql, Server::Postgres, Server::Etcd]
            .into_iter()
            .find(|server| server.tag() == tag)
    }
}

pub struct SessionFarewell {
    pub server: Server,
    pub url: SecretUrl,
    /// MySQL's connection id, PostgreSQL's backend pid, etcd's lease id.
    pub session_id: u64,
    /// etcd: the lock key's create revision (the fencing token), compared with the lease, as a lease
    /// id alone could be another holder's (a client may ask for any id). 0 elsewhere: the session
    /// id, checked against the holder id, names the session.
    pub revision: u64,
    pub name: String,
    /// The dead guard's holder id, which its session shows (a query comment, `application_name`).
    pub holder_id: String,
    /// Bounds connecting and each statement.
    pub timeout: Duration,
    /// `--ca-file`, read again when needed: a path fits the pipe, a CA bundle may not.
    pub ca_file: Option<PathBuf>,
}

impl SessionFarewell {
    pub fn encode(&self) -> Vec<u8> {
        let url = self.url.expose().as_bytes();
        let mut bytes = vec![self.server.tag()];
        bytes.extend_from_slice(&self.session_id.to_le_bytes());
        bytes.extend_from_slice(&self.revision.to_le_bytes());
        let timeout_ms = u32::try_from(self.timeout.as_millis()).unwrap_or(u32::MAX);
        bytes.extend_from_slice(&timeout_ms.to_le_bytes());
        // Lock names (at most 64 bytes, validated) and holder ids (hex) fit one length byte.
        for field in [&self.name, &self.holder_id] {
            bytes.push(field.len() as u8);
            bytes.extend_from_slice(field.as_bytes());
        }
        // A path longer than PATH_MAX (4096) cannot name a file anyway.
        let ca = self
            .ca_file
            .as_deref()
            .map_or(&[][..], |path| path.as_os_str().as_bytes());
        let ca = &ca[..ca.len().min(usize::from(u16::MAX))];
        bytes.extend_from_slice(&(ca.len() as u16).to_le_bytes());
        bytes.extend_from_slice(ca);
        bytes.extend_from_slice(url);
        bytes
    }

    pub fn decode(bytes: &[u8]) -> Option<SessionFarewell> {
        let (&tag, rest) = bytes.split_first()?;
        let server = Server::of_tag(tag)?;
        if rest.len() < 21 {
            return None;
        }
        let session_id = u64::from_le_bytes(rest[0..8].try_into().ok()?);
        let revision = u64::from_le_bytes(rest[8..16].try_into().ok()?);
        let timeout_ms = u32::from_le_bytes(rest[16..20].try_into().ok()?);
        let mut rest = &rest[20..];
        let mut field = || {
            let (&len, tail) = rest.split_first()?;
            let value = std::str::from_utf8(tail.get(..usize::from(len))?).ok()?;
            rest = &tail[usize::from(len)..];
            Some(value.to_owned())
        };
        // Both go into the farewell's SQL unquoted: what a guard could not have written is refused.
        let name = field()?;
        crate::config::LockName::parse(&name).ok()?;
        let holder_id = field()?;
        if holder_id.is_empty() || !holder_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let ca_len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
        let ca = rest.get(2..2 + ca_len)?;
        let ca_file = (!ca.is_empty()).then(|| PathBuf::from(OsStr::from_bytes(ca)));
        let url = std::str::from_utf8(&rest[2 + ca_len..]).ok()?;
        Some(SessionFarewell {
            server,
            url: SecretUrl::new(url.to_owned()),
            session_id,
            revision,
            name,
            holder_id,
            timeout: Duration::from_millis(u64::from(timeout_ms)),
            ca_file,
        })
    }

    /// Where the dead guard's lock lives, trusting the CA it was told to trust.
    pub fn target(&self) -> Result<Target, String> {
        let target = Target::parse(self.url.expose(), "").map_err(|e| e.to_string())?;
        match &self.ca_file {
            Some(path) => CaFile::read(path)
                .and_then(|ca| target.trusting(&ca))
                .map_err(|e| e.to_string()),
            None => Ok(target),
        }
    }

    /// Runs `end` on a runtime of its own (the watchdog has none).
    pub fn on_runtime<F>(&self, end: F) -> Result<String, String>
    where
        F: std::future::Future<Output = Result<String, String>>,
    {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?
            .block_on(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn farewell_messages_round_trip_and_others_are_refused() {
        let farewell_of = |server, name: &str, holder_id: &str| SessionFarewell {
            server,
            url: SecretUrl::new("mysql://sg:pw@db:3306/app".to_owned()),
            session_id: 9_000_000_000_000_000_001,
            revision: 77,
            name: name.to_owned(),
            holder_id: holder_id.to_owned(),
            timeout: Duration::from_millis(1500),
            ca_file: Some(PathBuf::from("/etc/ssl/private ca.pem")),
        };
        for server in [Server::Mysql, Server::Postgres, Server::Etcd] {
            let farewell = farewell_of(server, "billing", "27e1d7a4c2e445db");
            let decoded = SessionFarewell::decode(&farewell.encode()).unwrap();
            assert_eq!(decoded.ca_file, farewell.ca_file);
            assert_eq!(decoded.server, server);
            assert_eq!(decoded.url.expose(), "mysql://sg:pw@db:3306/app");
            assert_eq!(decoded.session_id, 9_000_000_000_000_000_001);
            assert_eq!(decoded.revision, 77);
            assert_eq!(decoded.name, "billing");
            assert_eq!(decoded.holder_id, "27e1d7a4c2e445db");
            assert_eq!(decoded.timeout, Duration::from_millis(1500));
            let mut truncated = farewell.encode();
            truncated.truncate(12);
            assert!(SessionFarewell::decode(&truncated).is_none());
            // What no guard writes, and what would change the farewell's SQL, is refused.
            for (name, holder_id) in [("bill'ing", "27e1d7a4c2e445db"), ("billing", "27e1' OR 1")] {
                let odd = farewell_of(server, name, holder_id).encode();
                assert!(
                    SessionFarewell::decode(&odd).is_none(),
                    "{name} {holder_id}"
                );
            }
        }
        assert!(SessionFarewell::decode(b"").is_none());
        assert!(SessionFarewell::decode(b"x12345678").is_none());
    }
}
