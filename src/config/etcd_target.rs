//! Where an etcd lock lives: the cluster's members, TLS, credentials and the key prefix, as the URL
//! `etcd://[user:pass@]host1:2379[,host2:2379,...][/prefix]` (`etcds://` for TLS) says. Parsed and
//! checked here, before any network I/O; the backend only connects.

use std::fmt;

use super::{invalid, CaFile, ConfigError, RedactedUrl, SecretUrl};

const ETCD_PORT: u16 = 2379;
/// Keys are `<prefix>/lock/<name>` and `<prefix>/record/<name>`.
const DEFAULT_PREFIX: &str = "sentinel-guard";

#[derive(Clone)]
pub struct EtcdTarget {
    /// The members, tried in turn: `(host, port)`, an IPv6 address without brackets.
    pub members: Vec<(String, u16)>,
    pub tls: bool,
    /// User name and password for etcd's authentication, when the URL has them.
    pub credentials: Option<(String, String)>,
    pub prefix: String,
    pub url: RedactedUrl,
    /// The URL as given, credentials included, for the guard's watchdog process only.
    pub secret: SecretUrl,
    /// `--ca-file`: what the members' certificates must chain to (else the system's roots).
    pub ca: Option<CaFile>,
}

impl fmt::Debug for EtcdTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTarget")
            .field("url", &self.url.to_string())
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl EtcdTarget {
    /// `etcd://` or `etcds://`; `None` for any other scheme.
    pub fn parse(raw: &str) -> Option<Result<EtcdTarget, ConfigError>> {
        let (scheme, rest) = raw.split_once("://")?;
        let tls = match scheme {
            "etcd" => false,
            "etcds" => true,
            _ => return None,
        };
        Some(parse_rest(raw, scheme, rest, tls))
    }

    pub fn lock_key(&self, name: &str) -> String {
        format!("{}/lock/{name}", self.prefix)
    }

    pub fn record_key(&self, name: &str) -> String {
        format!("{}/record/{name}", self.prefix)
    }
}

fn parse_rest(raw: &str, scheme: &str, rest: &str, tls: bool) -> Result<EtcdTarget, ConfigError> {
    // The credentials end at the last `@`, whatever they contain (`/`, `?`, `#`), so no part of a
    // password is ever read, or shown, as a host or a prefix.
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((userinfo, rest)) => (Some(userinfo), rest),
        None => (None, rest),
    };
    let (hosts, path) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    let url = RedactedUrl::of_parts(scheme, userinfo, hosts, path);
    let bad = |why: &str| invalid(format!("--url {url}: {why}"));
    if path.contains(['?', '#']) {
        return Err(bad("an etcd URL takes no query or fragment"));
    }
    let prefix = path.trim_matches('/');
    if prefix.contains("//") || prefix.chars().any(|c| c.is_control() || c == ' ') {
        return Err(bad("the key prefix must be path segments without spaces"));
    }
    let decode = |part: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|_| bad("the user name and password must be UTF-8"))
    };
    let credentials = match userinfo {
        None => None,
        Some(userinfo) => {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            if user.is_empty() {
                return Err(bad(
                    "etcd authentication needs a user name before the password",
                ));
            }
            Some((decode(user)?, decode(password)?))
        }
    };
    let mut members = Vec::new();
    for member in hosts.split(',') {
        members.push(parse_member(member).ok_or_else(|| {
            bad(&format!(
                "{member:?} is not host:port (an IPv6 address in brackets: [::1]:2379)"
            ))
        })?);
    }
    Ok(EtcdTarget {
        members,
        tls,
        credentials,
        prefix: if prefix.is_empty() {
            DEFAULT_PREFIX.to_owned()
        } else {
            prefix.to_owned()
        },
        url,
        secret: SecretUrl::new(raw.to_owned()),
        ca: None,
    })
}

fn parse_member(member: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(bracketed) = member.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']')?;
        host.parse::<std::net::Ipv6Addr>().ok()?;
        (host, after.strip_prefix(':'))
    } else {
        match member.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (member, None),
        }
    };
    let valid = |c: char| c.is_ascii_alphanumeric() || ".-_:".contains(c);
    if host.is_empty() || !host.chars().all(valid) {
        return None;
    }
    let port = match port {
        Some(port) => port.parse().ok().filter(|p| *p != 0)?,
        None => ETCD_PORT,
    };
    Some((host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_credentials_and_prefix_are_read_and_the_password_never_shown() {
        let target = EtcdTarget::parse("etcds://sg:s%40cret@a:2379,[::1]:32379,c/team/locks")
            .unwrap()
            .unwrap();
        assert!(target.tls);
        assert_eq!(
            target.members,
            vec![
                ("a".to_owned(), 2379),
                ("::1".to_owned(), 32379),
                ("c".to_owned(), 2379)
            ]
        );
        assert_eq!(
            target.credentials,
            Some(("sg".to_owned(), "s@cret".to_owned()))
        );
        assert_eq!(target.lock_key("billing"), "team/locks/lock/billing");
        assert_eq!(target.record_key("billing"), "team/locks/record/billing");
        assert!(!target.url.to_string().contains("cret"));
        assert!(!format!("{target:?}").contains("cret"));
        let plain = EtcdTarget::parse("etcd://127.0.0.1:2379").unwrap().unwrap();
        assert_eq!(plain.lock_key("b"), "sentinel-guard/lock/b");
        assert!(plain.credentials.is_none() && !plain.tls);
        assert!(EtcdTarget::parse("redis://x").is_none());
        // A password with `/`, `?` or `#` in it is the password, never a host or a prefix.
        for (raw, password) in [
            ("etcd://u:pa/ss@h:1", "pa/ss"),
            ("etcd://u:p?w#x@h:1/pre", "p?w#x"),
        ] {
            let target = EtcdTarget::parse(raw).unwrap().unwrap();
            assert_eq!(target.members, vec![("h".to_owned(), 1)]);
            assert!(!target.url.to_string().contains(password), "{}", target.url);
            assert_eq!(target.credentials.unwrap().1, password);
        }
        let bad = EtcdTarget::parse("etcd://u:s3cret/x@h:bad")
            .unwrap()
            .unwrap_err();
        assert!(!bad.to_string().contains("s3cret"), "{bad}");
        for bad in [
            "etcd://",
            "etcd://a:0",
            "etcd://a:x",
            "etcd://a,,b",
            "etcd://[zz]:1",
            "etcd://:pw@a",
            "etcd://a/p?x=1",
            "etcd://a/p//q",
        ] {
            assert!(EtcdTarget::parse(bad).unwrap().is_err(), "{bad} accepted");
        }
    }
}
