//! A host of its own for a guard: a network namespace joined to this test's namespace by a veth pair,
//! with its own firewall, so a partition is real packets dropped by the kernel between two network
//! stacks, not a proxy that stops forwarding. Needs root and iproute2 and iptables (`.ci/run`
//! installs both).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use super::left_by_dead_tests;

/// Which packets a partition drops, seen from the guard's host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Both,
    /// The guard's requests are lost; the server's answers would pass.
    ToServer,
    /// The guard's requests arrive and are acted on; the answers are lost.
    FromServer,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Both => "both_ways",
            Direction::ToServer => "to_server",
            Direction::FromServer => "from_server",
        }
    }
}

pub struct Host {
    /// The namespace's name, as `ip netns` knows it (`/run/netns/<name>`).
    pub name: String,
    /// This test's end of the link: what the guard's host reaches the servers' relays at.
    pub gateway: String,
    /// The guard's end of the link.
    pub address: String,
}

/// The namespaces this process makes are named `sgnem-<pid>-<n>`: one left by a test process that
/// was killed (its pid no longer runs, or now runs this process) is removed before a new one is
/// made, with its veth pair, once whatever still runs in it is killed.
fn remove_stale() {
    for path in left_by_dead_tests(Path::new("/run/netns"), "sgnem-") {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let pids = Command::new("ip")
            .args(["netns", "pids", &name])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for pid in pids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = quiet(Command::new("ip").args(["netns", "del", &name]));
    }
}

fn quiet(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("iproute2");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Host {
    /// A new namespace with its loopback up and a /30 link to this test's namespace.
    pub fn create() -> Host {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        if n == 0 {
            remove_stale();
            remove_stale_cuts();
        }
        assert!(n < 64, "too many hosts for one test process");
        let pid = std::process::id();
        let name = format!("sgnem-{pid}-{n}");
        // Interface names are at most 15 bytes: "sg", a pid of up to 7 digits, a letter and n < 64.
        let (outer, inner) = (format!("sg{pid}h{n}"), format!("sg{pid}g{n}"));
        // One /30 per host in 10.<100 + pid % 100>.0.0/16, skipping any /30 whose gateway address
        // this namespace already has (another test process whose pid ends alike). Test processes
        // run in parallel: the scan and the address's assignment are one step under a lock file.
        let _scan = nix::fcntl::Flock::lock(
            std::fs::File::create("/run/sentinel-guard-test-netns.lock").unwrap(),
            nix::fcntl::FlockArg::LockExclusive,
        )
        .unwrap_or_else(|(_, e)| panic!("lock the /30 scan: {e}"));
        let taken = Command::new("ip")
            .args(["-o", "-4", "addr", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let (gateway, address) = (0..64 * 256)
            .map(|k| {
                let octet =
                    |j: u32| format!("10.{}.{}.{}", 100 + pid % 100, k / 64, (k % 64) * 4 + j);
                (octet(1), octet(2))
            })
            .skip(n as usize)
            .find(|(gateway, _)| !taken.contains(&format!("inet {gateway}/")))
            .expect("a free /30 for a test host");
        ip(&["netns", "add", &name]);
        let host = Host {
            name,
            gateway,
            address,
        };
        ip(&[
            "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ]);
        ip(&["link", "set", &inner, "netns", &host.name]);
        ip(&[
            "addr",
            "add",
            &format!("{}/30", host.gateway),
            "dev",
            &outer,
        ]);
        ip(&["link", "set", &outer, "up"]);
        ip(&[
            "-n",
            &host.name,
            "addr",
            "add",
            &format!("{}/30", host.address),
            "dev",
            &inner,
        ]);
        ip(&["-n", &host.name, "link", "set", &inner, "up"]);
        ip(&["-n", &host.name, "link", "set", "lo", "up"]);
        host
    }

    /// The `nsenter` option that runs a program on this host. Unlike `ip netns exec`, nsenter
    /// leaves the mount namespace alone, so the guard still sees the cgroup filesystems, and it
    /// execs, so the program keeps nsenter's pid.
    pub fn nsenter_arg(&self) -> String {
        format!("--net=/run/netns/{}", self.name)
    }

    fn iptables(&self, args: &[&str]) {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "iptables", "-w", "5"])
            .args(args)
            .output()
            .expect("iptables");
        assert!(
            out.status.success(),
            "iptables {} on {}: {}",
            args.join(" "),
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Drops the packets between this host and the gateway in `direction`, every socket left open.
    pub fn partition(&self, direction: Direction) {
        if direction != Direction::FromServer {
            self.iptables(&["-A", "OUTPUT", "-d", &self.gateway, "-j", "DROP"]);
        }
        if direction != Direction::ToServer {
            self.iptables(&["-A", "INPUT", "-s", &self.gateway, "-j", "DROP"]);
        }
    }

    /// Drops each packet between this host and the gateway, either way, with `probability`.
    pub fn lose(&self, probability: f64) {
        let p = format!("{probability:.2}");
        for (chain, side) in [("OUTPUT", "-d"), ("INPUT", "-s")] {
            self.iptables(&[
                "-A",
                chain,
                side,
                &self.gateway,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ]);
        }
    }

    /// Every rule gone: the link passes everything again.
    pub fn heal(&self) {
        self.iptables(&["-F"]);
    }
}

/// A server cut off from its peers on loopback: packets to and from `127.0.0.1:port` are dropped,
/// in this namespace, while the server's other addresses still pass. Rules carry the comment
/// `sgcut-<pid>`; those of a test process that died are removed before a new cut is made.
pub struct LoopbackCut {
    rules: Vec<Vec<String>>,
}

fn root_iptables(action: &str, rule: &[String]) -> bool {
    quiet(
        Command::new("iptables")
            .args(["-w", "5", action])
            .args(rule),
    )
}

impl LoopbackCut {
    pub fn new(port: u16) -> LoopbackCut {
        remove_stale_cuts();
        let (port, tag) = (port.to_string(), format!("sgcut-{}", std::process::id()));
        let rule = |side: &str, port_side: &str| -> Vec<String> {
            [
                "INPUT",
                "-i",
                "lo",
                "-p",
                "tcp",
                side,
                "127.0.0.1",
                port_side,
                &port,
                "-m",
                "comment",
                "--comment",
                &tag,
                "-j",
                "DROP",
            ]
            .map(str::to_owned)
            .to_vec()
        };
        // Each rule is kept as it is inserted, so a failure still removes the ones before it.
        let mut cut = LoopbackCut { rules: Vec::new() };
        for rule in [rule("-d", "--dport"), rule("-s", "--sport")] {
            assert!(root_iptables("-I", &rule), "iptables -I {}", rule.join(" "));
            cut.rules.push(rule);
        }
        cut
    }
}

impl Drop for LoopbackCut {
    fn drop(&mut self) {
        for rule in &self.rules {
            if !root_iptables("-D", rule) {
                eprintln!("could not remove iptables rule {}", rule.join(" "));
            }
        }
    }
}

/// Deletes the cuts whose test process no longer runs: their ports may be any new server's.
fn remove_stale_cuts() {
    let listed = Command::new("iptables")
        .args(["-w", "5", "-S", "INPUT"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for line in listed.lines() {
        let dead = line
            .split_once("sgcut-")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|pid| pid.trim_matches('"').parse::<i32>().ok())
            .is_some_and(|pid| !super::alive(pid));
        if let (true, Some(rule)) = (dead, line.strip_prefix("-A ")) {
            let rule: Vec<String> = rule.split_whitespace().map(str::to_owned).collect();
            let _ = root_iptables("-D", &rule);
        }
    }
}

impl Drop for Host {
    /// Removing the namespace removes its end of the veth pair, and with it ours.
    fn drop(&mut self) {
        if !quiet(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!("could not remove network namespace {}", self.name);
        }
    }
}
