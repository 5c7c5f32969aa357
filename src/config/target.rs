//! Where the lock lives, chosen by the URL's scheme: each backend's URL is parsed in its own file
//! (`mysql_target.rs`, ...), and a `--ca-file` applied to the one that uses TLS.

use std::path::PathBuf;

use super::postgres_target::{postgres_socket_with_credentials, postgres_target};
use super::urls::unambiguous_credentials;
use super::*;

/// Where the lock lives, chosen by the URL scheme.
#[derive(Debug)]
pub enum Target {
    Mysql(MysqlTarget),
    Postgres(Box<PostgresTarget>),
    Redis(Box<RedisTarget>),
    Etcd(Box<EtcdTarget>),
    File(PathBuf),
}

impl Target {
    pub fn parse(raw: &str, redis_prefix: &str) -> Result<Target, ConfigError> {
        unambiguous_credentials(raw)?;
        // `redis:/host` or `mysql:host`: a known scheme whose `//` is missing.
        if let Some((scheme, _)) = raw.split_once(':') {
            let known = [
                "mysql",
                "postgres",
                "postgresql",
                "redis",
                "rediss",
                "redis+sentinel",
                "rediss+sentinel",
                "redis+cluster",
                "rediss+cluster",
                "etcd",
                "etcds",
            ];
            if known.contains(&scheme) && !raw[scheme.len()..].starts_with("://") {
                return Err(invalid(format!(
                    "--url: a {scheme} URL starts with {scheme}:// (as in {scheme}://host:port)"
                )));
            }
        }
        if let Some(redis) = RedisTarget::parse(raw, redis_prefix) {
            return Ok(Target::Redis(Box::new(redis?)));
        }
        if let Some(etcd) = EtcdTarget::parse(raw) {
            return Ok(Target::Etcd(Box::new(etcd?)));
        }
        if let Some(socket) = postgres_socket_with_credentials(raw) {
            return socket;
        }
        let url = url::Url::parse(raw).map_err(|e| {
            invalid(format!(
                "--url: not a valid URL ({e}); expected mysql://, postgres://, redis://, rediss://, redis+sentinel://, redis+cluster://, etcd://, etcds:// or file:///abs/path.lock"
            ))
        })?;
        match url.scheme() {
            "mysql" => Ok(Target::Mysql(MysqlTarget::parse(&url, raw)?)),
            "postgres" | "postgresql" => {
                let shown = RedactedUrl::of(&url);
                postgres_target(url, raw, shown, None)
            }
            "file" => {
                // The URL parser reads `file:rel.lock` and `file:./rel.lock` as `/rel.lock`: a lock at
                // the root, far from the relative path the user meant. Only a path that starts at
                // `/` (after `file:` or after `file://host`) is taken.
                if !raw.get("file:".len()..).is_some_and(|rest| rest.starts_with('/')) {
                    return Err(invalid(
                        "--url: a file: URL needs an absolute path; use file:///abs/path.lock",
                    ));
                }
                if !matches!(url.host_str(), None | Some("") | Some("localhost")) {
                    return Err(invalid(format!(
                        "--url {url}: a file lock is local to this host; use file:///abs/path.lock"
                    )));
                }
                let path = url
                    .to_file_path()
                    .map_err(|()| invalid(format!("--url {url}: not an absolute file path")))?;
                if path.file_name().is_none() || raw.ends_with('/') {
                    return Err(invalid(format!("--url {url}: names a directory, not a lock file")));
                }
                Ok(Target::File(path))
            }
            other => Err(invalid(format!(
                "--url: unsupported scheme {other:?}; expected mysql://, postgres://, redis://, rediss://, redis+sentinel://, \
                 redis+cluster:// (or their TLS forms rediss+...), etcd://, etcds:// or file://"
            ))),
        }
    }

    /// The same target, verifying the server's certificate against `ca` only. A CA for a connection
    /// without TLS would protect nothing, so it is a configuration error rather than ignored.
    pub fn trusting(self, ca: &CaFile) -> Result<Target, ConfigError> {
        let shown = ca.path.display();
        match self {
            Target::Mysql(mut mysql) => {
                let Some(tls) = mysql.opts.ssl_opts().cloned() else {
                    return Err(invalid(format!(
                        "--ca-file {shown}: {} does not use TLS; add ?require_ssl=true to the URL",
                        mysql.url
                    )));
                };
                let tls = tls
                    .with_root_certs(vec![ca.pem.clone().into()])
                    .with_disable_built_in_roots(true);
                mysql.opts = mysql_async::OptsBuilder::from_opts(mysql.opts)
                    .ssl_opts(Some(tls))
                    .into();
                mysql.ca_file = Some(ca.path.clone());
                Ok(Target::Mysql(mysql))
            }
            Target::Redis(redis) => {
                if !redis.uses_tls() {
                    return Err(invalid(format!(
                        "--ca-file {shown}: {} does not use TLS; use rediss://, rediss+sentinel:// or rediss+cluster://",
                        redis.url
                    )));
                }
                let url = redis.url.clone();
                let redis = redis
                    .trusting(&ca.pem)
                    .map_err(|e| invalid(format!("--ca-file {shown}: {}", url.scrub(e))))?;
                Ok(Target::Redis(Box::new(redis)))
            }
            Target::Postgres(mut postgres) => {
                if postgres.tls.mode == SslMode::Disable {
                    return Err(invalid(format!(
                        "--ca-file {shown}: {} has sslmode=disable; use sslmode=verify-full",
                        postgres.url
                    )));
                }
                // As libpq does with sslrootcert: a CA to trust means the certificate is checked.
                if matches!(postgres.tls.mode, SslMode::Prefer | SslMode::Require) {
                    postgres.tls.mode = SslMode::VerifyCa;
                }
                postgres.tls.ca_file = Some(ca.path.clone());
                Ok(Target::Postgres(postgres))
            }
            Target::Etcd(mut etcd) => {
                if !etcd.tls {
                    return Err(invalid(format!(
                        "--ca-file {shown}: {} does not use TLS; use etcds://",
                        etcd.url
                    )));
                }
                etcd.ca = Some(ca.clone());
                Ok(Target::Etcd(etcd))
            }
            Target::File(path) => Err(invalid(format!(
                "--ca-file {shown}: file://{} is a local lock and uses no TLS",
                path.display()
            ))),
        }
    }

    /// Where the lock lives, safe to print.
    pub fn location(&self) -> String {
        match self {
            Target::Mysql(mysql) => mysql.url.to_string(),
            Target::Postgres(postgres) => postgres.url.to_string(),
            Target::Redis(redis) => redis.url.to_string(),
            Target::Etcd(etcd) => etcd.url.to_string(),
            Target::File(path) => format!("file://{}", path.display()),
        }
    }

    pub fn backend_name(&self) -> &'static str {
        match self {
            Target::Mysql(_) => "mysql",
            Target::Postgres(_) => "postgres",
            Target::Redis(_) => "redis",
            Target::Etcd(_) => "etcd",
            Target::File(_) => "file",
        }
    }
}
