//! A private `mariadbd` on a free loopback port, in its own temp dir, so a test can kill, pause and
//! restart it without touching anything else.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use super::tls::server_certificate;
use super::{free_port, made_once, must_run, stdout_of, wait_until, TempDir};

pub const USER: &str = "guard";
pub const PASSWORD: &str = "guard-secret-pw-5ee1";

/// Debian installs the server in /usr/sbin, which a non-login PATH may lack.
fn program(name: &str) -> PathBuf {
    ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// One initialised data directory per build, copied for every server: `mariadb-install-db` takes
/// seconds, a copy a fraction of that.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        made_once(
            "mariadb-template",
            |dir| dir.join("mysql").is_dir(),
            |staging| {
                let mut install = Command::new(program("mariadb-install-db"));
                install
                    .args([
                        "--no-defaults",
                        "--user=root",
                        "--auth-root-authentication-method=normal",
                        "--skip-test-db",
                    ])
                    .arg(format!("--datadir={}", staging.display()))
                    // The bootstrap server, like every start, deletes the `#sql*` files of its
                    // temporary directory: in a shared /tmp, other servers' live temporary tables.
                    .env("TMPDIR", staging);
                must_run(
                    install,
                    "mariadb-install-db (apt-get install mariadb-server)",
                );
            },
        )
    })
}

pub struct MariaDb {
    dir: TempDir,
    pub port: u16,
    process: Option<Child>,
    /// Server options beyond the harness's own, e.g. `--max-statement-time=0.5`.
    extra: Vec<String>,
}

impl MariaDb {
    pub fn start() -> MariaDb {
        MariaDb::start_with(&[])
    }

    /// A server started with `extra` options on top of the harness's own.
    pub fn start_with(extra: &[&str]) -> MariaDb {
        MariaDb::start_in(super::scratch_dir(), extra)
    }

    /// A server that also speaks TLS, with a certificate for 127.0.0.1 signed by `ca_cert()`.
    pub fn start_tls() -> MariaDb {
        let dir = super::scratch_dir();
        server_certificate(dir.path());
        let file = |name: &str| dir.path().join(name).display().to_string();
        let extra = [
            format!("--ssl-cert={}", file("server.pem")),
            format!("--ssl-key={}", file("server.key")),
            format!("--ssl-ca={}", file("ca.pem")),
        ];
        MariaDb::start_in(dir, &extra.each_ref().map(String::as_str))
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    fn start_in(dir: TempDir, extra: &[&str]) -> MariaDb {
        let status = Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", template().display()))
            .arg(dir.path().join("data"))
            .status()
            .unwrap();
        assert!(status.success());
        fs::write(
            dir.path().join("init.sql"),
            format!(
                "CREATE USER IF NOT EXISTS '{USER}'@'%' IDENTIFIED BY '{PASSWORD}';\n\
                 GRANT ALL ON *.* TO '{USER}'@'%';\n"
            ),
        )
        .unwrap();
        let mut server = MariaDb {
            dir,
            port: free_port(),
            process: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.boot();
        server
    }

    fn boot(&mut self) {
        let d = self.dir.path();
        let child = Command::new(program("mariadbd"))
            .arg("--no-defaults")
            .arg("--user=root")
            .arg(format!("--datadir={}", d.join("data").display()))
            // Its own temporary directory: a starting server deletes every `#sql*` file in its
            // directory, and a process-list read's on-disk temporary table deleted under it
            // crashes MariaDB 10.11 (SIGSEGV in `ha_maria::drop_table`).
            .arg(format!("--tmpdir={}", d.display()))
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg("--skip-name-resolve")
            .arg(format!("--init-file={}", d.join("init.sql").display()))
            .arg(format!("--log-error={}", d.join("error.log").display()))
            .arg(format!("--pid-file={}", d.join("mariadb.pid").display()))
            .arg("--innodb-buffer-pool-size=16M")
            .arg("--skip-log-bin")
            .arg("--max-connections=1000")
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mariadbd is not installed (apt-get install mariadb-server)");
        self.process = Some(child);
        let up = wait_until(Duration::from_secs(30), || {
            stdout_of(self.client("SELECT 1")).is_some()
        });
        assert!(
            up,
            "mariadbd did not start: {}",
            fs::read_to_string(d.join("error.log")).unwrap_or_default()
        );
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("mysqld.sock")
    }

    pub fn url(&self) -> String {
        format!("mysql://{USER}:{PASSWORD}@127.0.0.1:{}/mysql", self.port)
    }

    /// The guard's URL over the private Unix socket. Its TCP port is one nothing listens on, so only
    /// the socket can reach the server.
    pub fn socket_url(&self) -> String {
        format!(
            "mysql://{USER}:{PASSWORD}@localhost:1/mysql?socket={}",
            self.socket().display()
        )
    }

    pub fn url_with_port(&self, port: u16) -> String {
        format!("mysql://{USER}:{PASSWORD}@127.0.0.1:{port}/mysql")
    }

    pub fn pid(&self) -> i32 {
        self.process.as_ref().expect("server is running").id() as i32
    }

    /// The `mariadb` client, as root over the private socket, running `sql`.
    pub fn client(&self, sql: &str) -> Command {
        let mut cmd = Command::new(program("mariadb"));
        cmd.arg(format!("--socket={}", self.socket().display()))
            .args(["-uroot", "-N", "-B", "-e", sql]);
        cmd
    }

    /// Runs SQL as root over the private socket; panics on failure.
    pub fn sql(&self, sql: &str) -> String {
        let out = self
            .client(sql)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the mariadb client for {sql}: {e}"));
        assert!(
            out.status.success(),
            "query failed ({}): {sql}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The connection id holding `name`, if any.
    pub fn holder_of(&self, name: &str) -> Option<u64> {
        self.sql(&format!("SELECT IS_USED_LOCK('{name}')"))
            .parse()
            .ok()
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.boot();
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        // A failing test shows whether the server still ran (a stray signal, a crash: its status).
        if std::thread::panicking() {
            let state = match self.process.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => format!("had ended: {status}"),
                Some(Ok(None)) => "was running".to_owned(),
                Some(Err(e)) => format!("could not be asked: {e}"),
                None => "was stopped by the test".to_owned(),
            };
            let log = fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!(
                "mariadbd on port {} {state}; it logged, last lines first:\n{}",
                self.port,
                tail.join("\n")
            );
        }
        self.kill9();
    }
}
