//! A backend URL as it may be printed (`RedactedUrl`), as only the watchdog may read it
//! (`SecretUrl`), the checks every backend's URL goes through before it is parsed, and `--ca-file`.

use std::fmt;
use std::path::{Path, PathBuf};

use super::{invalid, ConfigError};

/// `--ca-file`: the certificate authorities (PEM) a TLS backend's certificate must chain to. They
/// replace the built-in roots, as libpq's `sslrootcert=` does, so a private CA is all that is trusted.
#[derive(Debug, Clone)]
pub struct CaFile {
    pub path: PathBuf,
    pub pem: Vec<u8>,
}

impl CaFile {
    /// Read once at start-up, so a missing or unreadable file is a configuration error (exit 2), not
    /// a backend that refuses the guard.
    pub fn read(path: &Path) -> Result<CaFile, ConfigError> {
        let pem = crate::input_file::read(path)
            .map_err(|e| invalid(format!("--ca-file {}: {e}", path.display())))?;
        if !pem
            .windows(CERTIFICATE_PEM.len())
            .any(|w| w == CERTIFICATE_PEM)
        {
            return Err(invalid(format!(
                "--ca-file {}: no PEM certificate in it (expected {})",
                path.display(),
                String::from_utf8_lossy(CERTIFICATE_PEM)
            )));
        }
        Ok(CaFile {
            path: path.to_owned(),
            pem,
        })
    }
}

const CERTIFICATE_PEM: &[u8] = b"-----BEGIN CERTIFICATE-----";

/// A URL with its credentials, which no `Debug` or `Display` ever prints.
#[derive(Clone)]
pub struct SecretUrl(String);

impl SecretUrl {
    pub fn new(raw: String) -> SecretUrl {
        SecretUrl(raw)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretUrl(<redacted>)")
    }
}

/// A backend URL in the only form that may be printed, with what is needed to scrub its password
/// from any message that echoes it back. Its `Debug` shows the printable form only: a target's
/// derived `Debug` must not print the secrets kept for scrubbing.
#[derive(Clone)]
pub struct RedactedUrl {
    shown: String,
    /// The password, and the value of any query parameter whose name says it holds a secret.
    secrets: Vec<String>,
}

impl RedactedUrl {
    /// A multi-host URL (`redis+sentinel://u:p@h1,h2/g`), which `url::Url` cannot hold.
    pub(super) fn of_parts(
        scheme: &str,
        userinfo: Option<&str>,
        hosts: &str,
        path: &str,
    ) -> RedactedUrl {
        let (user, password) = match userinfo.map(|u| u.split_once(':')) {
            Some(Some((user, password))) => (user, Some(password)),
            Some(None) => (userinfo.unwrap_or_default(), None),
            None => ("", None),
        };
        let password = password.filter(|p| !p.is_empty());
        let credentials = match (userinfo, password) {
            (None, _) => String::new(),
            (Some(_), Some(_)) => format!("{user}:***@"),
            (Some(_), None) => format!("{user}@"),
        };
        let mut secrets = Vec::new();
        if let Some(password) = password {
            keep_secret(&mut secrets, password);
        }
        let path = match path.split_once('?') {
            Some((path, query)) => format!("{path}?{}", masked_query(query, &mut secrets)),
            None => path.to_owned(),
        };
        RedactedUrl::new(format!("{scheme}://{credentials}{hosts}{path}"), secrets)
    }

    pub(super) fn of(url: &url::Url) -> RedactedUrl {
        let mut shown = url.clone();
        let mut secrets = Vec::new();
        if let Some(password) = url.password() {
            let _ = shown.set_password(Some("***"));
            keep_secret(&mut secrets, password);
        }
        if let Some(query) = url.query() {
            shown.set_query(Some(&masked_query(query, &mut secrets)));
        }
        // A fragment means nothing to any backend: a password's tail after a `#`, if anything.
        if let Some(fragment) = url.fragment() {
            secrets.push(fragment.to_owned());
            shown.set_fragment(Some("***"));
        }
        RedactedUrl::new(shown.to_string(), secrets)
    }

    fn new(shown: String, mut secrets: Vec<String>) -> RedactedUrl {
        secrets.retain(|secret| !secret.is_empty());
        secrets.sort();
        secrets.dedup();
        RedactedUrl { shown, secrets }
    }

    /// `message` with every stretch that any secret covers replaced by one `***`. The stretches
    /// are marked in the message as it came, every occurrence of every secret, overlapping ones
    /// too, before anything is replaced: replacing one secret at a time would leave the tail of
    /// another that overlaps it (`abcd` and `cdef` in `abcdef`).
    pub fn scrub(&self, message: impl fmt::Display) -> String {
        let message = message.to_string();
        let mut covered = vec![false; message.len()];
        for secret in &self.secrets {
            let mut from = 0;
            while let Some(at) = message[from..].find(secret.as_str()) {
                let start = from + at;
                covered[start..start + secret.len()].fill(true);
                // On to the next character, not past the match: occurrences may overlap.
                from = start + message[start..].chars().next().map_or(1, char::len_utf8);
            }
        }
        let mut scrubbed = String::with_capacity(message.len());
        // A secret is valid UTF-8 found in valid UTF-8, so each stretch starts and ends on a
        // character boundary.
        for (at, c) in message.char_indices() {
            match (covered[at], at > 0 && covered[at - 1]) {
                (false, _) => scrubbed.push(c),
                (true, false) => scrubbed.push_str("***"),
                (true, true) => {}
            }
        }
        scrubbed
    }
}

impl fmt::Debug for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedactedUrl({:?})", self.shown)
    }
}

impl fmt::Display for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

/// Keeps a secret as written in the URL (percent-encoded) and as decoded: a message may echo either.
fn keep_secret(secrets: &mut Vec<String>, raw: &str) {
    secrets.push(raw.to_owned());
    secrets.push(
        percent_encoding::percent_decode_str(raw)
            .decode_utf8_lossy()
            .into_owned(),
    );
}

/// Refuses a MySQL, PostgreSQL or Redis URL with an `@` after the first `/`, `?` or `#` of its
/// authority. Either a password holds one of those (`2024#Spring!@db`), which a URL parser reads as
/// a host and a fragment and prints unmasked, or a path or query holds an `@`, which a reader that
/// ends the credentials at the last `@` takes for another server. No guess is safe: both must be
/// percent-encoded. (etcd's URLs end the credentials at the last `@`, and say so.)
pub(super) fn unambiguous_credentials(raw: &str) -> Result<(), ConfigError> {
    let Some((scheme, rest)) = raw.split_once("://") else {
        return Ok(());
    };
    let sql_or_redis =
        matches!(scheme, "mysql" | "postgres" | "postgresql") || scheme.starts_with("redis");
    let after_delimiter = rest
        .find(['/', '?', '#'])
        .is_some_and(|at| rest[at..].contains('@'));
    if sql_or_redis && after_delimiter {
        return Err(invalid(
            "--url: an @ comes after a /, ? or # (the URL is not shown, since it may hold a \
             password): percent-encode a password's / ? # as %2F %3F %23, and an @ in a path or \
             query as %40",
        ));
    }
    Ok(())
}

/// A URL's query as it may be printed: the values of the parameters known to hold no secret, and
/// `***` for every other (a driver that refuses `?password=`, or a misspelt `?pasword=`, echoes the
/// URL). The hidden values join `secrets`, so a message that repeats one is scrubbed too; values
/// too short to be a credential stay out (or every `1` of a message would be scrubbed), unless their
/// parameter names a credential.
fn masked_query(query: &str, secrets: &mut Vec<String>) -> String {
    const CREDENTIAL_WORDS: &[&str] = &["password", "pass", "pwd", "token", "secret"];
    const SHOWN: &[&str] = &[
        "sslmode",
        "sslrootcert",
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "application_name",
        "connect_timeout",
        "target_session_attrs",
        "socket",
        "prefer_socket",
        "require_ssl",
        "verify_ca",
        "verify_identity",
        "wait_timeout",
        "db",
        "protocol",
    ];
    // After a credential, a parameter that is not a known one may be the credential's tail (an `&`
    // left unencoded in it): its name and value are secrets however short.
    let mut after_credential = false;
    query
        .split('&')
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = |text: &str| {
                url::form_urlencoded::parse(format!("x={text}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default()
            };
            let name = decode(key);
            let lowercase = name.to_ascii_lowercase();
            if SHOWN.contains(&lowercase.as_str()) {
                pair.to_owned()
            } else {
                let credential = CREDENTIAL_WORDS.contains(&lowercase.as_str());
                let tail = after_credential;
                after_credential |= credential;
                // A credential's value is a secret however short; any other value only from four
                // characters on.
                if credential || tail || decode(value).len() >= 4 {
                    // As written, as a form decodes it (`+` a space), as a driver does (`+` kept).
                    keep_secret(secrets, value);
                    secrets.push(decode(value));
                }
                // The name too: `?password=Xy7&kP9qRt` makes a parameter of a password's tail,
                // and a driver that refuses it names it. Only the words that say a credential
                // follows stay out of the scrubbing, so messages keep them.
                if !credential && (tail || name.len() >= 4) {
                    secrets.push(name);
                }
                "***=***".to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("&")
}
