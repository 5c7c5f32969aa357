//! A private single-member `etcd` on free loopback ports, for measuring `etcdctl lock` beside the
//! guard. `None` where etcd is not installed: the comparison is optional, the guard's tests are not.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_until, TempDir};

pub struct Etcd {
    _dir: TempDir,
    endpoint: String,
    process: Child,
}

impl Etcd {
    pub fn start() -> Option<Etcd> {
        Command::new("etcd").arg("--version").output().ok()?;
        Command::new("etcdctl").arg("version").output().ok()?;
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (
            format!("http://127.0.0.1:{}", free_port()),
            format!("http://127.0.0.1:{}", free_port()),
        );
        let process = Command::new("etcd")
            .arg("--name=bench")
            .arg(format!("--data-dir={}", dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=bench={peer}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let etcd = Etcd {
            _dir: dir,
            endpoint: client,
            process,
        };
        let healthy = wait_until(Duration::from_secs(20), || {
            etcd.ctl()
                .args(["endpoint", "health"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        assert!(
            healthy,
            "private etcd at {} never became healthy",
            etcd.endpoint
        );
        Some(etcd)
    }

    /// `etcdctl` pointed at this server (API v3).
    pub fn ctl(&self) -> Command {
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoint));
        cmd
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
