//! A private etcd cluster on free loopback ports: one member for the benchmark's `etcdctl lock`
//! rows (`None` where etcd is not installed), three for the etcd backend's tests. Elections are
//! fast (50ms heartbeat, 500ms election timeout) so a lost leader is replaced well within a lease.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, send, wait_until, TempDir};

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    process: Option<Child>,
}

pub struct Etcd {
    dir: TempDir,
    members: Vec<Member>,
    initial_cluster: String,
    /// `root:password` once authentication is on.
    root: Option<String>,
}

impl Etcd {
    /// One member, where etcd is installed.
    pub fn start() -> Option<Etcd> {
        Command::new("etcd").arg("--version").output().ok()?;
        Command::new("etcdctl").arg("version").output().ok()?;
        Some(Etcd::cluster(1))
    }

    /// `size` members forming one cluster, each healthy before this returns. A port picked free can
    /// be taken by another test before its member binds it (the member then exits): such a cluster
    /// is given up and made again on new ports, at most three times.
    pub fn cluster(size: usize) -> Etcd {
        for _ in 0..3 {
            let members: Vec<Member> = (0..size)
                .map(|i| Member {
                    name: format!("m{i}"),
                    client_port: free_port(),
                    peer_port: free_port(),
                    process: None,
                })
                .collect();
            let initial_cluster = members
                .iter()
                .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
                .collect::<Vec<_>>()
                .join(",");
            let mut etcd = Etcd {
                dir: super::scratch_dir(),
                members,
                initial_cluster,
                root: None,
            };
            for i in 0..size {
                etcd.launch(i);
            }
            let mut exited = false;
            let healthy = wait_until(Duration::from_secs(30), || {
                exited = etcd.members.iter_mut().any(|m| {
                    m.process
                        .as_mut()
                        .is_some_and(|p| p.try_wait().ok().flatten().is_some())
                });
                exited || etcd.healthy()
            });
            if healthy && !exited {
                return etcd;
            }
        }
        panic!("private etcd cluster never became healthy, in three tries on fresh ports");
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(&self.members[i].name)
    }

    fn launch(&mut self, i: usize) {
        let data = self.data_dir(i);
        let member = &self.members[i];
        let client = format!("http://127.0.0.1:{}", member.client_port);
        let peer = format!("http://127.0.0.1:{}", member.peer_port);
        let process = Command::new("etcd")
            .arg(format!("--name={}", member.name))
            .arg(format!("--data-dir={}", data.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster={}", self.initial_cluster))
            .arg("--initial-cluster-state=new")
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=500")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd is installed (.ci/run installs etcd-server)");
        self.members[i].process = Some(process);
    }

    fn healthy(&self) -> bool {
        self.ctl()
            .args(["endpoint", "health"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Every member, as the guard's `--url`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect();
        format!("etcd://{}", hosts.join(","))
    }

    pub fn client_port(&self, i: usize) -> u16 {
        self.members[i].client_port
    }

    /// `etcdctl` pointed at the members still running (API v3).
    pub fn ctl(&self) -> Command {
        let endpoints: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.process.is_some())
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect();
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", endpoints.join(",")));
        if let Some(root) = &self.root {
            cmd.arg(format!("--user={root}"));
        }
        cmd
    }

    /// The index of the member that leads the cluster now.
    pub fn leader(&self) -> usize {
        let mut found = None;
        wait_until(Duration::from_secs(10), || {
            found = self.members.iter().position(|m| {
                m.process.is_some()
                    && Command::new("etcdctl")
                        .env("ETCDCTL_API", "3")
                        .arg(format!("--endpoints=http://127.0.0.1:{}", m.client_port))
                        .args(["endpoint", "status", "-w", "fields"])
                        .output()
                        .is_ok_and(|out| leader_is_self(&String::from_utf8_lossy(&out.stdout)))
            });
            found.is_some()
        });
        found.expect("the cluster has a leader")
    }

    /// Turns on authentication: `root` (password `root_password`) and `user`, whose role may read and
    /// write the keys under `prefix`. `etcdctl` is root from then on.
    pub fn enable_auth(&mut self, root_password: &str, user: &str, password: &str, prefix: &str) {
        let run = |args: &[&str]| {
            let mut cmd = self.ctl();
            cmd.args(args).stdout(Stdio::null());
            super::must_run(cmd, &format!("etcdctl {}", args.join(" ")));
        };
        run(&["user", "add", &format!("root:{root_password}")]);
        run(&["user", "add", &format!("{user}:{password}")]);
        run(&["role", "add", user]);
        run(&[
            "role",
            "grant-permission",
            user,
            "readwrite",
            "--prefix=true",
            prefix,
        ]);
        run(&["user", "grant-role", user, user]);
        run(&["auth", "enable"]);
        self.root = Some(format!("root:{root_password}"));
    }

    /// Sends `signal` to every member still running.
    pub fn signal_all(&self, signal: i32) {
        for member in self.members.iter().filter_map(|m| m.process.as_ref()) {
            send(member.id() as i32, signal);
        }
    }

    /// Starts member `i` again on its ports and data, after a `kill`.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.launch(i);
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut process) = self.members[i].process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

/// Whether `etcdctl endpoint status -w fields` describes the member that leads.
fn leader_is_self(fields: &str) -> bool {
    let value = |key: &str| {
        fields
            .lines()
            .find_map(|line| line.strip_prefix(&format!("\"{key}\" : ")))
            .map(str::trim)
            .map(str::to_owned)
    };
    value("MemberID").is_some() && value("MemberID") == value("Leader")
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
