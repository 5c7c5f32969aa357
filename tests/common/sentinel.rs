//! Replicated Redis on loopback: a primary, two replicas and three sentinels with short failure
//! detection (`Sentinels`), or a three-primary Cluster (`Cluster`); every process in a temp dir, on
//! free ports, killed on Drop.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::redis::Redis;
use super::{free_port, wait_until, TempDir};

pub const GROUP: &str = "mymaster";
/// Every node also listens here, where the nemesis's guards reach it: the group's own traffic, all
/// on 127.0.0.1, can then be cut (`LoopbackCut`) while the guards' still flows.
pub const SECOND_ADDRESS: std::net::Ipv4Addr = std::net::Ipv4Addr::new(127, 0, 0, 2);
/// ttl 10s - margin 200ms - grace 1s = 8.8s >= renew 1s + check-timeout 1s: room for a failover
/// (1s to call the primary down, then the election and the replicas' reconfiguration) without losing
/// the lease.
pub const FAILOVER_LEASE: &[&str] = &[
    "--ttl",
    "10s",
    "--renew-interval",
    "1s",
    "--check-timeout",
    "1s",
    "--grace-period",
    "1s",
];
/// How long a primary may be silent before the sentinels call it down.
const DOWN_AFTER_MS: u32 = 1000;

fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A node's options: both addresses, and the primary it replicates, if any.
fn node_args(replica_of: Option<u16>) -> Vec<String> {
    let mut args = vec![
        "--bind".to_owned(),
        "127.0.0.1".to_owned(),
        SECOND_ADDRESS.to_string(),
    ];
    if let Some(port) = replica_of {
        args.extend([
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            port.to_string(),
        ]);
    }
    args
}

/// A `redis-sentinel` watching `GROUP`.
struct Sentinel {
    _dir: TempDir,
    port: u16,
    process: Child,
}

impl Sentinel {
    fn start(primary: u16) -> Sentinel {
        let dir = super::scratch_dir();
        let port = free_port();
        let config = dir.path().join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel monitor {GROUP} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {GROUP} {DOWN_AFTER_MS}\n\
                 sentinel failover-timeout {GROUP} 4000\n\
                 sentinel parallel-syncs {GROUP} 2\n",
                dir = dir.path().display()
            ),
        )
        .unwrap();
        let process = Command::new("redis-sentinel")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-sentinel is not installed (apt-get install redis-sentinel)");
        Sentinel {
            _dir: dir,
            port,
            process,
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

pub struct Sentinels {
    /// The primary and the two replicas; which is which changes with each failover.
    pub nodes: Vec<Redis>,
    sentinels: Vec<Sentinel>,
}

impl Sentinels {
    pub fn start() -> Sentinels {
        let primary = Redis::start_with(&node_args(None));
        let replica = node_args(Some(primary.port));
        let mut nodes = vec![primary];
        nodes.extend((0..2).map(|_| Redis::start_with(&replica)));
        let primary = nodes[0].port;
        let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::start(primary)).collect();
        let group = Sentinels { nodes, sentinels };
        // Ready once every sentinel knows both replicas (in sync) and the two other sentinels: a
        // failover needs them all.
        let ready = wait_until(Duration::from_secs(30), || {
            group.sentinels.iter().all(|s| {
                let count = |what: &str| {
                    cli(s.port, &["SENTINEL", what, GROUP])
                        .map(|out| out.lines().filter(|l| *l == "name").count())
                        .unwrap_or(0)
                };
                count("REPLICAS") == 2 && count("SENTINELS") == 2
            }) && group.nodes[1..].iter().all(|r| {
                r.cli(&["INFO", "replication"])
                    .contains("master_link_status:up")
            })
        });
        assert!(ready, "the sentinels never saw the whole group");
        group
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/mymaster`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{GROUP}", hosts.join(","))
    }

    /// The primary's port, as the sentinels name it.
    pub fn primary_port(&self) -> Option<u16> {
        let out = cli(
            self.sentinels[0].port,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", GROUP],
        )?;
        out.lines().nth(1)?.parse().ok()
    }

    /// The index in `nodes` of the node the sentinels name as primary.
    pub fn primary_node(&self) -> Option<usize> {
        let port = self.primary_port()?;
        self.nodes.iter().position(|n| n.port == port)
    }

    /// Restarts node `i` empty, as a node without persistence comes back: still the primary if the
    /// sentinels still name it (its replicas then copy its empty dataset), else a replica of the
    /// one they name. With the `--replicaof` of its first start, a node the failovers had made
    /// primary could come back as a replica of its own replica, and neither would ever sync.
    pub fn restart_node(&mut self, i: usize) {
        let primary = self.primary_port().filter(|p| *p != self.nodes[i].port);
        self.nodes[i].restart_with(&node_args(primary));
    }

    /// The node the sentinels name as primary.
    pub fn primary(&mut self) -> &mut Redis {
        let port = self.primary_port().expect("the sentinels name a primary");
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node of the group")
    }

    /// Waits until every sentinel names a primary other than `old`, and that node says it is one.
    pub fn await_new_primary(&self, old: u16, limit: Duration) -> u16 {
        let mut new = None;
        let moved = wait_until(limit, || {
            let ports: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .map(|s| {
                    cli(s.port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", GROUP])
                        .and_then(|out| out.lines().nth(1)?.parse().ok())
                })
                .collect();
            new = ports[0];
            ports.iter().all(|p| *p == new && *p != Some(old))
                && new.is_some_and(|p| {
                    cli(p, &["ROLE"]).is_some_and(|role| role.starts_with("master"))
                })
        });
        assert!(moved, "no failover away from {old} within {limit:?}");
        new.unwrap()
    }

    /// `SENTINEL FAILOVER`: a replica is promoted; returns the new primary's port.
    pub fn failover(&self) -> u16 {
        let old = self.primary_port().expect("a primary");
        assert!(self.request_failover(), "SENTINEL FAILOVER refused");
        self.await_new_primary(old, Duration::from_secs(20))
    }

    /// Asks a sentinel for a failover without waiting for it; false if it refused (one already
    /// under way, no replica in a state to be promoted).
    pub fn request_failover(&self) -> bool {
        cli(self.sentinels[0].port, &["SENTINEL", "FAILOVER", GROUP]).as_deref() == Some("OK")
    }

    /// `DEL key` on the primary the sentinels name; whether a key was deleted.
    pub fn delete_on_primary(&self, key: &str) -> bool {
        self.primary_port()
            .and_then(|port| cli(port, &["DEL", key]))
            .is_some_and(|out| out == "1")
    }

    /// Every port of the group, the sentinels' and the nodes': what a guard must reach.
    pub fn ports(&self) -> Vec<u16> {
        let sentinels = self.sentinels.iter().map(|s| s.port);
        sentinels.chain(self.nodes.iter().map(|n| n.port)).collect()
    }

    /// Runs `args` with redis-cli on the node at `port`.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, args).unwrap_or_else(|| panic!("redis-cli -p {port} {args:?} failed"))
    }
}

/// A Redis Cluster of three primaries without replicas.
pub struct Cluster {
    pub nodes: Vec<Redis>,
}

impl Cluster {
    pub fn start() -> Cluster {
        // The cluster bus's port is given, not left to the default of port + 10000: that lands in the
        // kernel's ephemeral range, where another test's outgoing connection may hold it.
        let nodes: Vec<Redis> = (0..3)
            .map(|_| {
                let bus = free_port().to_string();
                let options = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-port",
                    &bus,
                ]
                .map(String::from);
                Redis::start_with(&options)
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Cluster { nodes };
        let ok = wait_until(Duration::from_secs(20), || {
            cluster
                .nodes
                .iter()
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
        });
        assert!(ok, "the cluster never reached cluster_state:ok");
        cluster
    }

    /// Seed nodes: the first two; the client learns the third from them.
    pub fn url(&self) -> String {
        format!(
            "redis+cluster://127.0.0.1:{},127.0.0.1:{}",
            self.nodes[0].port, self.nodes[1].port
        )
    }

    /// The node that owns `key`'s slot.
    pub fn owner(&self, key: &str) -> &Redis {
        let slot: u16 = self.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .parse()
            .unwrap();
        let owner = self.owner_id(slot);
        self.nodes
            .iter()
            .find(|n| n.cli(&["CLUSTER", "MYID"]) == owner)
            .expect("a node owns the slot")
    }

    /// Moves the slot of `key`, with its keys, to the node at `to` (an index into `nodes`): the
    /// `CLUSTER SETSLOT ... IMPORTING/MIGRATING`, `MIGRATE`, `SETSLOT ... NODE` steps of a reshard.
    pub fn move_slot(&self, key: &str, to: usize) {
        let slot = self.nodes[0].cli(&["CLUSTER", "KEYSLOT", key]);
        let from = self.owner(key);
        let target = &self.nodes[to];
        let (from_id, to_id) = (
            from.cli(&["CLUSTER", "MYID"]),
            target.cli(&["CLUSTER", "MYID"]),
        );
        assert_ne!(from_id, to_id, "the slot is already there");
        target.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]);
        from.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]);
        let keys = from.cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
        let port = target.port.to_string();
        for key in keys.lines().filter(|k| !k.is_empty()) {
            from.cli(&["MIGRATE", "127.0.0.1", &port, key, "0", "5000"]);
        }
        for node in &self.nodes {
            node.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]);
        }
    }

    fn owner_id(&self, slot: u16) -> String {
        // `CLUSTER NODES` lines: <id> <addr> <flags> <master> <ping> <pong> <epoch> <state> <slots>...
        let nodes = self.nodes[0].cli(&["CLUSTER", "NODES"]);
        nodes
            .lines()
            .find(|line| {
                line.split_whitespace().skip(8).any(|range| {
                    let (from, to) = range.split_once('-').unwrap_or((range, range));
                    match (from.parse::<u16>(), to.parse::<u16>()) {
                        (Ok(from), Ok(to)) => (from..=to).contains(&slot),
                        _ => false,
                    }
                })
            })
            .and_then(|line| line.split_whitespace().next())
            .expect("a node owns the slot")
            .to_owned()
    }
}
