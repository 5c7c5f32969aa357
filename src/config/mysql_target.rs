//! Where a MySQL lock lives, parsed from a `mysql://` URL before any network I/O, and the timing
//! rule of MySQL's own: the session's `wait_timeout` has a ceiling.

use std::fmt;
use std::path::PathBuf;

use super::{invalid, ConfigError, RedactedUrl, SecretUrl, Timings};

/// Its `Debug` is written by hand: the driver's options print the password.
#[derive(Clone)]
pub struct MysqlTarget {
    pub opts: mysql_async::Opts,
    pub url: RedactedUrl,
    /// The URL as given, credentials included, for the guard's watchdog process only.
    pub secret: SecretUrl,
    /// `--ca-file`, which the watchdog reads again should it have to end the session.
    pub ca_file: Option<PathBuf>,
}

impl fmt::Debug for MysqlTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlTarget")
            .field("url", &self.url)
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}

/// The largest `wait_timeout` MySQL and MariaDB accept on Unix (a year).
const MAX_WAIT_TIMEOUT_SECS: u64 = 31_536_000;

impl MysqlTarget {
    pub(super) fn parse(url: &url::Url, raw: &str) -> Result<MysqlTarget, ConfigError> {
        let shown = RedactedUrl::of(url);
        let mut opts = mysql_async::Opts::from_url(raw).map_err(|e| {
            // libpq's and the MySQL client's words for TLS, which this driver does not know.
            let tls_word = url.query_pairs().any(|(key, _)| {
                matches!(
                    key.to_ascii_lowercase().as_str(),
                    "ssl-mode" | "sslmode" | "ssl_mode" | "ssl"
                )
            });
            let hint = if tls_word {
                "; ask for TLS with ?require_ssl=true (and --ca-file for a private CA)"
            } else {
                ""
            };
            invalid(format!("--url {shown}: {}{hint}", shown.scrub(e)))
        })?;
        // The driver would hand a bracketed IPv6 literal ("[::1]") to the resolver as a host name;
        // it gets the address itself instead.
        if let Some(url::Host::Ipv6(address)) = url.host() {
            opts = mysql_async::OptsBuilder::from_opts(opts)
                .ip_or_hostname(address.to_string())
                .into();
        }
        Ok(MysqlTarget {
            opts,
            url: shown,
            secret: SecretUrl::new(raw.to_owned()),
            ca_file: None,
        })
    }

    /// The server must not free the lock before the guard has stopped the command: the session's
    /// `wait_timeout` covers that, and a server takes no more than a year.
    pub(super) fn check_timings(timings: &Timings) -> Result<(), ConfigError> {
        let show = |d| crate::vocab::show_duration(d);
        let wait_timeout = timings.session_timeout_secs();
        if wait_timeout > MAX_WAIT_TIMEOUT_SECS {
            return Err(invalid(format!(
                "the MySQL server must not free the lock before the guard has stopped the command, \
                 which needs wait_timeout = lock wait {} + check-interval {} + 2 x check-timeout {} + grace-period {} + margin {} = {wait_timeout}s, \
                 above the server's maximum of {MAX_WAIT_TIMEOUT_SECS}s: shorten --grace-period or --check-interval",
                show(super::MAX_LOCK_WAIT_CHUNK),
                show(timings.check_interval),
                show(timings.check_timeout),
                show(timings.grace_period),
                show(super::SESSION_SAFETY_MARGIN),
            )));
        }
        Ok(())
    }
}
