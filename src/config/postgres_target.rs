//! Where a PostgreSQL lock lives: the driver's configuration, and TLS with libpq's meanings, parsed
//! from a `postgres://` URL before any network I/O.

use std::path::PathBuf;

use super::{invalid, ConfigError, RedactedUrl, SecretUrl, Target};

#[derive(Debug, Clone)]
pub struct PostgresTarget {
    /// Everything but TLS, which `tls` describes: the driver knows neither `verify-ca` nor
    /// `verify-full`, so `sslmode` and `sslrootcert` are taken out of the URL before it parses it.
    pub config: tokio_postgres::Config,
    pub tls: PostgresTls,
    pub url: RedactedUrl,
    /// The URL as given, credentials included, for the guard's watchdog process only.
    pub secret: SecretUrl,
}

/// `sslmode` and `sslrootcert`, with libpq's meanings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresTls {
    pub mode: SslMode,
    /// PEM file of the CA certificates to trust; the system's store when `None`.
    pub ca_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// TLS when the server offers it, without verifying its certificate (libpq's default).
    Prefer,
    /// TLS, without verifying the certificate.
    Require,
    /// TLS with a certificate signed by a trusted CA.
    VerifyCa,
    /// `VerifyCa`, and the certificate names the host connected to.
    VerifyFull,
}

impl PostgresTls {
    /// Splits the TLS parameters off a `postgres://` URL: what is left is for the driver.
    fn take_from(url: &mut url::Url) -> Result<PostgresTls, ConfigError> {
        let mut mode = None;
        let mut ca_file = None;
        let mut rest = Vec::new();
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "sslmode" => mode = Some(value.into_owned()),
                // libpq's word for the system's trust store, which is also what no CA file means.
                "sslrootcert" if value == "system" => ca_file = None,
                "sslrootcert" => ca_file = Some(PathBuf::from(value.as_ref())),
                // The redacted URL hides only the password of the userinfo part.
                "password" => {
                    return Err(invalid(
                        "--url: give the password in the URL's user part (postgres://user:pass@host/db), not as ?password=",
                    ))
                }
                _ => rest.push((key.into_owned(), value.into_owned())),
            }
        }
        let mode = match mode.as_deref() {
            None | Some("prefer") => SslMode::Prefer,
            Some("disable") => SslMode::Disable,
            // libpq: with a CA file, `require` verifies the chain like `verify-ca`.
            Some("require") if ca_file.is_some() => SslMode::VerifyCa,
            Some("require") => SslMode::Require,
            Some("verify-ca") => SslMode::VerifyCa,
            Some("verify-full") => SslMode::VerifyFull,
            Some(other) => {
                return Err(invalid(format!(
                    "--url: sslmode={other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                )))
            }
        };
        if rest.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(rest);
        }
        Ok(PostgresTls { mode, ca_file })
    }
}

/// A PostgreSQL target from its parsed URL; `credentials`, the user and password of a URL whose
/// userinfo had to be taken out before it could be parsed.
pub(super) fn postgres_target(
    url: url::Url,
    raw: &str,
    shown: RedactedUrl,
    credentials: Option<(String, Option<String>)>,
) -> Result<Target, ConfigError> {
    let mut driver_url = url;
    let tls = PostgresTls::take_from(&mut driver_url)?;
    let mut config: tokio_postgres::Config = driver_url.as_str().parse().map_err(|e| {
        // The driver says only "invalid connection string": the parameter it does not know is named.
        let unknown = driver_url
            .query_pairs()
            .map(|(key, _)| key.into_owned())
            .find(|key| !POSTGRES_PARAMETERS.contains(&key.as_str()));
        // Named only if it is a plain word: anything else could be a piece of a mistyped password.
        let plain = |key: &String| key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        match unknown {
            Some(key) => invalid(format!(
                "--url {shown}: unknown parameter {}; known: sslmode, sslrootcert, {}",
                if plain(&key) {
                    format!("{key:?}")
                } else {
                    "(its name is not shown)".to_owned()
                },
                POSTGRES_PARAMETERS.join(", ")
            )),
            None => invalid(format!("--url {shown}: {}", shown.scrub(e))),
        }
    })?;
    if let Some((user, password)) = credentials {
        config.user(user);
        if let Some(password) = password {
            config.password(password);
        }
    }
    Ok(Target::Postgres(Box::new(PostgresTarget {
        config,
        tls,
        url: shown,
        secret: SecretUrl::new(raw.to_owned()),
    })))
}

/// The URL parameters the PostgreSQL driver takes (`sslmode` and `sslrootcert` are the guard's).
const POSTGRES_PARAMETERS: &[&str] = &[
    "user",
    "password",
    "dbname",
    "options",
    "application_name",
    "host",
    "hostaddr",
    "port",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
    "sslnegotiation",
    "sslcert",
    "sslkey",
];

/// libpq's form for a Unix socket with credentials, `postgres://user:pass@/db?host=/dir`, has an
/// empty host, which `url::Url` refuses when a user is named: the credentials are taken out (up to
/// the last `@`, as a password may hold one) and given to the driver apart. `None`: not that form.
pub(super) fn postgres_socket_with_credentials(raw: &str) -> Option<Result<Target, ConfigError>> {
    let (scheme, rest) = raw.split_once("://")?;
    if !matches!(scheme, "postgres" | "postgresql") {
        return None;
    }
    let (userinfo, after) = rest.rsplit_once('@')?;
    if !(after.is_empty() || after.starts_with('/') || after.starts_with('?')) {
        return None;
    }
    let decode = |part: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8_lossy()
            .into_owned()
    };
    let (user, password) = match userinfo.split_once(':') {
        Some((user, password)) => (decode(user), Some(decode(password))),
        None => (decode(userinfo), None),
    };
    let shown = RedactedUrl::of_parts(scheme, Some(userinfo), "", after);
    let hostless = format!("{scheme}://{after}");
    Some(match url::Url::parse(&hostless) {
        Ok(url) => postgres_target(url, raw, shown, Some((user, password))),
        Err(e) => Err(invalid(format!("--url {shown}: not a valid URL ({e})"))),
    })
}
