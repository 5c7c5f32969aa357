//! Where a Redis lock lives: one server, the primary of a Sentinel master group, or a Cluster, as the
//! URL says. Parsed and checked here, before any network I/O; the backend only connects.

use std::fmt;

use redis::cluster::ClusterClient;
use redis::{
    ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisError, TlsCertificates, TlsMode,
};

use super::{invalid, ConfigError, RedactedUrl};

/// The port each form defaults to: a Sentinel's, or a Redis server's.
const SENTINEL_PORT: u16 = 26379;
const REDIS_PORT: u16 = 6379;

#[derive(Clone)]
pub struct RedisTarget {
    pub servers: RedisServers,
    pub url: RedactedUrl,
    /// Keys are `<prefix>:{<name>}`, `<prefix>:{<name>}:fence`, ...: one `{name}` hash tag, so a
    /// lock's keys (its window claim included) live in one Cluster slot.
    pub prefix: String,
    /// `--redis-min-replicas`: replicas that must acknowledge each acquisition and renewal.
    pub min_replicas: u32,
    /// What the URL named, to build the clients again with `--ca-file`'s roots.
    spec: Spec,
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTarget")
            .field("url", &self.url.to_string())
            .field("prefix", &self.prefix)
            .field("min_replicas", &self.min_replicas)
            .finish()
    }
}

/// The clients for each topology.
#[derive(Clone)]
pub enum RedisServers {
    /// One server, addressed directly.
    Primary(redis::Client),
    /// The sentinels of a master group, asked in turn for its primary at every connection.
    Sentinel {
        sentinels: Vec<redis::Client>,
        group: String,
        primary: PrimaryOf,
    },
    /// A Cluster, which follows `MOVED`/`ASK`; `seed` is its first node, for release announcements
    /// (a `PUBLISH` reaches every node of a Cluster).
    Cluster {
        cluster: Box<ClusterClient>,
        seed: redis::Client,
    },
}

/// How to reach the primary a sentinel names: its credentials, database and TLS settings.
#[derive(Clone)]
pub struct PrimaryOf {
    node: ConnectionInfo,
    tls: bool,
    pem: Option<Vec<u8>>,
}

impl PrimaryOf {
    pub fn client(&self, host: &str, port: u16) -> Result<redis::Client, RedisError> {
        let addr = if self.tls {
            ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host.to_owned(), port)
        };
        let info = self.node.clone().set_addr(addr);
        match certificates(self.pem.as_deref()) {
            Some(certs) => redis::Client::build_with_tls(info, certs),
            None => redis::Client::open(info),
        }
    }
}

#[derive(Clone)]
enum Spec {
    Primary(ConnectionInfo),
    Sentinel {
        sentinels: Vec<ConnectionInfo>,
        group: String,
        /// Database and credentials for the primary; the sentinels are asked without credentials.
        node: ConnectionInfo,
        tls: bool,
    },
    Cluster {
        nodes: Vec<ConnectionInfo>,
        tls: bool,
    },
}

impl RedisTarget {
    /// `redis://`, `rediss://`, `redis+sentinel://`, `rediss+sentinel://`, `redis+cluster://` or
    /// `rediss+cluster://`; `None` for any other scheme.
    pub fn parse(raw: &str, prefix: &str) -> Option<Result<RedisTarget, ConfigError>> {
        let (scheme, rest) = raw.split_once("://")?;
        let spec = match scheme {
            "redis" | "rediss" => single(raw),
            "redis+sentinel" | "rediss+sentinel" => sentinel(scheme, rest),
            "redis+cluster" | "rediss+cluster" => cluster(scheme, rest),
            _ => return None,
        };
        Some(spec.and_then(|(spec, url)| {
            validate_prefix(prefix)?;
            let servers = spec
                .servers(None)
                .map_err(|e| invalid(format!("--url {url}: {}", url.scrub(e))))?;
            Ok(RedisTarget {
                servers,
                url,
                prefix: prefix.to_owned(),
                min_replicas: 0,
                spec,
            })
        }))
    }

    pub fn uses_tls(&self) -> bool {
        match &self.spec {
            Spec::Primary(info) => matches!(info.addr(), ConnectionAddr::TcpTls { .. }),
            Spec::Sentinel { tls, .. } | Spec::Cluster { tls, .. } => *tls,
        }
    }

    /// The same servers, trusting only the CAs in `pem`.
    pub fn trusting(mut self, pem: &[u8]) -> Result<RedisTarget, redis::RedisError> {
        self.servers = self.spec.servers(Some(pem))?;
        Ok(self)
    }

    /// Whether a release recorded on the server can be trusted after a failover. A failover may lose
    /// the newest writes (replication is asynchronous), among them an acquisition made after that
    /// release: the marker would then call "clean" a hand-over whose previous holder still runs.
    /// Only acquisitions acknowledged by replicas (`--redis-min-replicas`) rule that out.
    pub fn release_marker_survives_failover(&self) -> bool {
        matches!(self.servers, RedisServers::Primary(_)) || self.min_replicas > 0
    }

    pub fn topology(&self) -> &'static str {
        match self.servers {
            RedisServers::Primary(_) => "primary",
            RedisServers::Sentinel { .. } => "sentinel",
            RedisServers::Cluster { .. } => "cluster",
        }
    }
}

fn certificates(pem: Option<&[u8]>) -> Option<TlsCertificates> {
    pem.map(|pem| TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.to_vec()),
    })
}

impl Spec {
    fn servers(&self, pem: Option<&[u8]>) -> Result<RedisServers, redis::RedisError> {
        let client = |info: &ConnectionInfo| match certificates(pem) {
            Some(certs) => redis::Client::build_with_tls(info.clone(), certs),
            None => redis::Client::open(info.clone()),
        };
        Ok(match self {
            Spec::Primary(info) => RedisServers::Primary(client(info)?),
            Spec::Sentinel {
                sentinels,
                group,
                node,
                tls,
            } => RedisServers::Sentinel {
                sentinels: sentinels.iter().map(client).collect::<Result<_, _>>()?,
                group: group.clone(),
                primary: PrimaryOf {
                    node: node.clone(),
                    tls: *tls,
                    pem: pem.map(<[u8]>::to_vec),
                },
            },
            Spec::Cluster { nodes, tls } => {
                // The guard bounds every command itself; within that bound the client follows
                // redirections, refreshes the slot map, and re-sends a request (a whole pipeline)
                // whose answer an I/O error lost, which the lock's scripts and claims allow for.
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone());
                if *tls {
                    builder = builder.tls(TlsMode::Secure);
                }
                if let Some(certs) = certificates(pem) {
                    builder = builder.certs(certs);
                }
                RedisServers::Cluster {
                    cluster: Box::new(builder.build()?),
                    seed: client(&nodes[0])?,
                }
            }
        })
    }
}

/// `redis://[user:pass@]host[:port][/db]`, `rediss://...`: the redis crate reads it.
fn single(raw: &str) -> Result<(Spec, RedactedUrl), ConfigError> {
    let url = url::Url::parse(raw).map_err(|e| invalid(format!("--url: not a valid URL ({e})")))?;
    let shown = RedactedUrl::of(&url);
    let info = raw
        .into_connection_info()
        .map(unannounced)
        .map_err(|e| invalid(format!("--url {shown}: {}", shown.scrub(e))))?;
    Ok((Spec::Primary(info), shown))
}

/// Without the driver's `CLIENT SETINFO` on connecting: a round trip on every start-up and
/// reconnection that only tells the server the driver's name and version.
fn unannounced(info: ConnectionInfo) -> ConnectionInfo {
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    info.set_redis_settings(settings)
}

/// `redis+sentinel://[user:pass@]host1[:26379],host2[:26379]/group[/db]`: the credentials and the
/// database are the primary's.
fn sentinel(scheme: &str, rest: &str) -> Result<(Spec, RedactedUrl), ConfigError> {
    let hosts = Hosts::parse(scheme, rest, SENTINEL_PORT)?;
    let shown = &hosts.shown;
    let mut parts = hosts.path.trim_start_matches('/').splitn(2, '/');
    let group = parts.next().unwrap_or_default();
    if group.is_empty() || group.contains(char::is_whitespace) {
        return Err(invalid(format!(
            "--url {shown}: name the master group after the hosts: {scheme}://host1:26379,host2:26379/mymaster[/db]"
        )));
    }
    let db = match parts.next().filter(|db| !db.is_empty()) {
        Some(db) => db.parse::<i64>().map_err(|_| {
            invalid(format!(
                "--url {shown}: the database after the group must be a number, got {db:?}"
            ))
        })?,
        None => 0,
    };
    let node = hosts.nodes[0]
        .clone()
        .set_redis_settings(hosts.nodes[0].redis_settings().clone().set_db(db));
    Ok((
        Spec::Sentinel {
            // The sentinels are asked without credentials.
            sentinels: hosts
                .nodes
                .iter()
                .map(|n| n.clone().set_redis_settings(Default::default()))
                .collect(),
            group: group.to_owned(),
            node,
            tls: hosts.tls,
        },
        hosts.shown,
    ))
}

/// `redis+cluster://[user:pass@]host1[:6379],host2[:6379]`: any reachable node tells the rest.
fn cluster(scheme: &str, rest: &str) -> Result<(Spec, RedactedUrl), ConfigError> {
    let hosts = Hosts::parse(scheme, rest, REDIS_PORT)?;
    if !matches!(hosts.path.as_str(), "" | "/") {
        return Err(invalid(format!(
            "--url {}: a Redis Cluster has only database 0; use {scheme}://host1:port,host2:port",
            hosts.shown
        )));
    }
    Ok((
        Spec::Cluster {
            nodes: hosts.nodes,
            tls: hosts.tls,
        },
        hosts.shown,
    ))
}

/// The comma-separated hosts of a multi-host URL, which `url::Url` cannot hold: each is read as a
/// `redis://` (or `rediss://`) URL of its own, with the shared credentials.
struct Hosts {
    nodes: Vec<ConnectionInfo>,
    path: String,
    tls: bool,
    shown: RedactedUrl,
}

impl Hosts {
    fn parse(scheme: &str, rest: &str, default_port: u16) -> Result<Hosts, ConfigError> {
        let tls = scheme.starts_with("rediss");
        let single = if tls { "rediss" } else { "redis" };
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let credentials = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
        let mut parsed = Vec::new();
        for host in hosts.split(',') {
            let url = url::Url::parse(&format!("{single}://{credentials}{host}"))
                .ok()
                .filter(|url| !host.is_empty() && url.host().is_some() && url.path().is_empty());
            let Some(mut url) = url else {
                let shown = RedactedUrl::of_parts(scheme, userinfo, hosts, path);
                return Err(invalid(format!(
                    "--url {shown}: {host:?} is not a host[:port]; expected {scheme}://[user:pass@]host1:port,host2:port{}",
                    if scheme.ends_with("sentinel") { "/mymaster[/db]" } else { "" }
                )));
            };
            if url.port().is_none() {
                let _ = url.set_port(Some(default_port));
            }
            parsed.push(url);
        }
        let shown = RedactedUrl::of_parts(scheme, userinfo, hosts, path);
        if path.contains(['?', '#']) {
            return Err(invalid(format!(
                "--url {shown}: query parameters are not supported with {scheme}://"
            )));
        }
        let nodes = parsed
            .iter()
            .map(|url| url.as_str().into_connection_info().map(unannounced))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("--url {shown}: {}", shown.scrub(e))))?;
        Ok(Hosts {
            nodes,
            path: path.to_owned(),
            tls,
            shown,
        })
    }
}

/// The prefix must not break the `{name}` hash tag that keeps a lock's keys in one cluster slot.
fn validate_prefix(prefix: &str) -> Result<(), ConfigError> {
    if prefix.is_empty()
        || prefix
            .chars()
            .any(|c| c.is_whitespace() || c == '{' || c == '}')
    {
        return Err(invalid(format!(
            "--redis-prefix {prefix:?}: must be non-empty, without spaces or braces"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(raw: &str) -> Result<RedisTarget, String> {
        RedisTarget::parse(raw, "sg")
            .expect("a redis scheme")
            .map_err(|e| e.to_string())
    }

    #[test]
    fn sentinel_urls_name_the_sentinels_the_group_and_the_database() {
        let t = target("redis+sentinel://u:s%40cret@10.0.0.1,[::1]:26380/mymaster/2").unwrap();
        assert_eq!(
            t.url.to_string(),
            "redis+sentinel://u:***@10.0.0.1,[::1]:26380/mymaster/2"
        );
        assert_eq!(t.url.scrub("denied for s@cret"), "denied for ***");
        assert_eq!(t.url.scrub("no user u:s%40cret"), "no user u:***");
        let Spec::Sentinel {
            sentinels,
            group,
            node,
            tls,
        } = &t.spec
        else {
            panic!("not sentinel")
        };
        assert_eq!(group, "mymaster");
        assert!(!tls);
        assert_eq!(node.redis_settings().db(), 2);
        assert_eq!(node.redis_settings().password(), Some("s@cret"));
        let addresses: Vec<&ConnectionAddr> = sentinels.iter().map(|s| s.addr()).collect();
        assert_eq!(
            addresses,
            vec![
                &ConnectionAddr::Tcp("10.0.0.1".into(), 26379),
                &ConnectionAddr::Tcp("::1".into(), 26380)
            ]
        );
        assert!(sentinels
            .iter()
            .all(|s| s.redis_settings().password().is_none()));
        assert!(target("rediss+sentinel://h1,h2/g").unwrap().uses_tls());
        for bad in [
            "redis+sentinel://h1,h2",
            "redis+sentinel://h1,h2/",
            "redis+sentinel://h1,,h2/g",
            "redis+sentinel://h1:notaport/g",
            "redis+sentinel://h1/g/x",
            "redis+sentinel://h1/g?db=1",
        ] {
            assert!(target(bad).is_err(), "{bad} was accepted");
        }
        let error = target("redis+sentinel://:hunter2@h1:x/g").unwrap_err();
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn cluster_urls_name_seed_nodes_without_a_database() {
        let t = target("rediss+cluster://:pw@n1:7000,n2:7001").unwrap();
        assert_eq!(t.url.to_string(), "rediss+cluster://:***@n1:7000,n2:7001");
        assert!(t.uses_tls());
        assert_eq!(t.topology(), "cluster");
        assert!(target("redis+cluster://n1:7000/1").is_err());
        assert!(RedisTarget::parse("mysql://x", "sg").is_none());
    }

    #[test]
    fn only_acknowledged_acquisitions_let_a_release_marker_survive_a_failover() {
        let mut t = target("redis+sentinel://h1/g").unwrap();
        assert!(!t.release_marker_survives_failover());
        t.min_replicas = 1;
        assert!(t.release_marker_survives_failover());
        assert!(target("redis://h1")
            .unwrap()
            .release_marker_survives_failover());
    }
}
