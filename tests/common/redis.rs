//! A private `redis-server` on a free loopback port that keeps nothing on disk, so a restart comes
//! back empty; optionally TLS-only with a CA generated for the test.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::tls::server_certificate;
use super::{free_port, wait_until, TempDir};

pub struct Redis {
    dir: TempDir,
    pub port: u16,
    tls: bool,
    /// More `redis-server` options: replication, cluster mode.
    extra: Vec<String>,
    process: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        Redis::launch(false, &[])
    }

    /// With more `redis-server` options, e.g. `["--replicaof", "127.0.0.1", "6380"]`.
    pub fn start_with(extra: &[String]) -> Redis {
        Redis::launch(false, extra)
    }

    /// TLS only, with a server certificate for 127.0.0.1 signed by `ca_cert()`.
    pub fn start_tls() -> Redis {
        Redis::launch(true, &[])
    }

    fn launch(tls: bool, extra: &[String]) -> Redis {
        let dir = super::scratch_dir();
        if tls {
            server_certificate(dir.path());
        }
        let mut server = Redis {
            dir,
            port: free_port(),
            tls,
            extra: extra.to_vec(),
            process: None,
        };
        server.boot();
        server
    }

    fn boot(&mut self) {
        let d = self.dir.path();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(d)
            .arg("--logfile")
            .arg(d.join("redis.log"));
        if self.tls {
            cmd.args([
                "--port",
                "0",
                "--tls-port",
                &self.port.to_string(),
                "--tls-auth-clients",
                "no",
            ])
            .arg("--tls-cert-file")
            .arg(d.join("server.pem"))
            .arg("--tls-key-file")
            .arg(d.join("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(d.join("ca.pem"));
        } else {
            cmd.args(["--port", &self.port.to_string()]);
        }
        cmd.args(&self.extra);
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed (apt-get install redis-server)");
        self.process = Some(child);
        let up = wait_until(Duration::from_secs(10), || {
            self.try_cli(&["PING"]).as_deref() == Some("PONG")
        });
        assert!(
            up,
            "redis-server did not start: {}",
            std::fs::read_to_string(d.join("redis.log")).unwrap_or_default()
        );
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// Whether it runs: not between `kill9` and `restart`.
    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    pub fn pid(&self) -> i32 {
        self.process.as_ref().expect("server is running").id() as i32
    }

    fn try_cli(&self, args: &[&str]) -> Option<String> {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if self.tls {
            cmd.arg("--tls").arg("--cacert").arg(self.ca_cert());
        }
        let out = cmd.args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Runs a command with redis-cli; panics on failure.
    pub fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args)
            .unwrap_or_else(|| panic!("redis-cli {args:?} failed"))
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Restarts on the same port; nothing is persisted, so it comes back empty.
    pub fn restart(&mut self) {
        self.kill9();
        self.boot();
    }

    /// Restarts on the same port with `extra` in place of the options it was started with.
    pub fn restart_with(&mut self, extra: &[String]) {
        self.extra = extra.to_vec();
        self.restart();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill9();
    }
}
