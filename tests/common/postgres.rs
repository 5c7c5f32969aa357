//! A private PostgreSQL server (`initdb` + `postgres`) on a free loopback port, in its own temp dir,
//! so a test can kill, pause and restart it without touching anything else. PostgreSQL refuses to
//! run as root: when the tests run as root, the server runs as the `postgres` account, which owns
//! its directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use super::{free_port, made_once, must_run, procs, stdout_of, wait_until, TempDir};

pub const USER: &str = "guard";
pub const PASSWORD: &str = "guard-secret-pw-0d5e";
/// A role that logs in over TCP without a password, as the test pooler needs.
pub const POOLED: &str = "pooled";
/// The server's superuser, reached over the private Unix socket without a password.
const ADMIN: &str = "postgres";

/// Debian keeps the server's programs in /usr/lib/postgresql/<version>/bin, off the PATH; the
/// newest installed version is used.
fn program(name: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = fs::read_dir("/usr/lib/postgresql")
        .map(|dirs| dirs.flatten().map(|d| d.path().join("bin")).collect())
        .unwrap_or_default();
    versions.sort_by_key(|dir| {
        dir.parent()
            .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    versions
        .iter()
        .rev()
        .map(|dir| dir.join(name))
        .chain(
            ["/usr/bin", "/usr/local/bin"]
                .iter()
                .map(|d| Path::new(d).join(name)),
        )
        .find(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

fn running_as_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    unsafe { nix::libc::geteuid() == 0 }
}

/// `cmd`, run as the `postgres` account when the tests run as root.
fn as_server_user(cmd: Command) -> Command {
    if !running_as_root() {
        return cmd;
    }
    let mut wrapped = Command::new("setpriv");
    wrapped
        .args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    wrapped
}

/// Hands `path` (and what is in it) to the server's account.
fn give_to_server_user(path: &Path) {
    if running_as_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(path)
            .status()
            .unwrap();
        assert!(status.success(), "chown {} failed", path.display());
    }
}

/// One initialised data directory per build, copied for every server.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        made_once(
            "postgres-template",
            |dir| dir.join("PG_VERSION").is_file(),
            |staging| {
                fs::create_dir_all(staging).unwrap();
                give_to_server_user(staging);
                let mut initdb = Command::new(program("initdb"));
                initdb
                    .arg("-D")
                    .arg(staging)
                    .args([
                        "-U",
                        ADMIN,
                        "--auth-local=trust",
                        "--auth-host=scram-sha-256",
                    ])
                    .args(["--no-sync", "--encoding=UTF8", "--locale=C"]);
                must_run(
                    as_server_user(initdb),
                    "initdb (apt-get install postgresql)",
                );
                // The role behind the test's transaction pooler (tests/common/pooler.rs) logs in
                // without a password; first, as pg_hba.conf's first matching line wins.
                let hba = staging.join("pg_hba.conf");
                let rules = fs::read_to_string(&hba).unwrap();
                fs::write(
                    &hba,
                    format!("host all {POOLED} 127.0.0.1/32 trust\n{rules}"),
                )
                .unwrap();
            },
        )
    })
}

pub struct Postgres {
    dir: TempDir,
    pub port: u16,
    process: Option<Child>,
    /// Server settings beyond the harness's own, as `-c name=value` pairs.
    extra: Vec<String>,
}

impl Postgres {
    pub fn start() -> Postgres {
        let dir = super::scratch_dir();
        let status = Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", template().display()))
            .arg(dir.path().join("data"))
            .status()
            .unwrap();
        assert!(status.success());
        give_to_server_user(dir.path());
        let server = Postgres::booted(dir);
        // The guard's role may create its lock record table, as an application's own role
        // usually may in its database (PostgreSQL 15 and later no longer grant CREATE on `public`
        // to everyone; the fallback without it has a test of its own).
        server.sql(&format!(
            "CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'; CREATE ROLE {POOLED} LOGIN; \
             GRANT CREATE ON SCHEMA public TO {USER}"
        ));
        server
    }

    /// A hot standby of `primary`, from `pg_basebackup` with `standby.signal`, on a port of its own.
    pub fn standby_of(primary: &Postgres) -> Postgres {
        let dir = super::scratch_dir();
        give_to_server_user(dir.path());
        let mut backup = Command::new(program("pg_basebackup"));
        backup
            .arg("-D")
            .arg(dir.path().join("data"))
            .arg("-h")
            .arg(primary.dir.path())
            .arg("-p")
            .arg(primary.port.to_string())
            .args(["-U", ADMIN, "--write-recovery-conf", "--no-sync"]);
        must_run(as_server_user(backup), "pg_basebackup");
        assert!(dir.path().join("data/standby.signal").exists());
        Postgres::booted(dir)
    }

    /// The server of the data directory `dir/data`, started on a free port.
    fn booted(dir: TempDir) -> Postgres {
        let mut server = Postgres {
            dir,
            port: free_port(),
            process: None,
            extra: Vec::new(),
        };
        server.boot();
        server
    }

    /// A server that offers TLS with a certificate for `db.example` only (not for 127.0.0.1),
    /// signed by a CA of its own; returns the CA certificate's path too.
    pub fn start_with_tls() -> (Postgres, PathBuf) {
        let mut server = Postgres::start();
        let d = server.dir.path().to_owned();
        let openssl = |args: &[&str]| {
            let mut cmd = Command::new("openssl");
            cmd.current_dir(&d).args(args);
            must_run(cmd, "openssl");
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.crt",
                    "-days",
                    "2",
                    "-subj",
                    "/CN=sentinel-guard test CA",
                ],
            ]
            .concat(),
        );
        openssl(
            &[
                &["req"][..],
                &ec,
                &[
                    "-keyout",
                    "server.key",
                    "-out",
                    "server.csr",
                    "-subj",
                    "/CN=db.example",
                ],
            ]
            .concat(),
        );
        fs::write(
            d.join("server.ext"),
            "subjectAltName=DNS:db.example\nbasicConstraints=CA:FALSE\n",
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ]);
        give_to_server_user(&d);
        let key = d.join("server.key");
        fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        server.extra = vec![
            "ssl=on".to_owned(),
            format!("ssl_cert_file={}", d.join("server.crt").display()),
            format!("ssl_key_file={}", key.display()),
        ];
        server.restart();
        (server, d.join("ca.crt"))
    }

    fn boot(&mut self) {
        let d = self.dir.path();
        let log = fs::File::create(d.join("server.log")).unwrap();
        give_to_server_user(&d.join("server.log"));
        let mut postgres = Command::new(program("postgres"));
        postgres
            .arg("-D")
            .arg(d.join("data"))
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", &format!("port={}", self.port)])
            .args(["-c", &format!("unix_socket_directories={}", d.display())])
            // A SIGKILLed server keeps what it wrote (the kernel has it); only a host crash
            // would lose it.
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB"])
            .args(["-c", "max_connections=300"]);
        for setting in &self.extra {
            postgres.args(["-c", setting]);
        }
        let child = as_server_user(postgres)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("postgres is not installed (apt-get install postgresql)");
        self.process = Some(child);
        let up = wait_until(Duration::from_secs(30), || {
            stdout_of(self.client("SELECT 1")).is_some()
        });
        assert!(
            up,
            "postgres did not start: {}",
            fs::read_to_string(d.join("server.log")).unwrap_or_default()
        );
    }

    pub fn url(&self) -> String {
        self.url_with_port(self.port)
    }

    pub fn url_with_port(&self, port: u16) -> String {
        format!("postgres://{USER}:{PASSWORD}@127.0.0.1:{port}/postgres")
    }

    /// The guard's URL over the private Unix socket, as libpq takes it (`host=` a directory), with
    /// `query` appended (`&sslmode=...`).
    pub fn socket_url(&self, query: &str) -> String {
        format!(
            "postgres://{USER}:{PASSWORD}@/postgres?host={}&port={}{query}",
            self.dir.path().display(),
            self.port
        )
    }

    /// The postmaster's pid.
    pub fn pid(&self) -> i32 {
        self.process.as_ref().expect("server is running").id() as i32
    }

    /// Sends `signal` to the whole server: the postmaster first (so it starts no new process),
    /// then its children. Each backend leads a process group of its own, so one group signal
    /// would not reach them.
    pub fn signal_all(&self, signal: i32) {
        let postmaster = self.pid();
        // SAFETY: kill(2) touches no memory.
        let send = |pid: i32, signal: i32| unsafe {
            nix::libc::kill(pid, signal);
        };
        // The postmaster reaps its children: stopped, it cannot, so the pids read now stay theirs
        // (a child that exits meanwhile stays a zombie) and no other test's process is signalled.
        send(postmaster, nix::libc::SIGSTOP);
        for child in procs::children(postmaster) {
            send(child, signal);
        }
        send(postmaster, signal);
        if signal != nix::libc::SIGSTOP {
            send(postmaster, nix::libc::SIGCONT);
        }
    }

    /// `psql` as the superuser over the private socket, running `sql`.
    pub fn client(&self, sql: &str) -> Command {
        let mut cmd = Command::new(program("psql"));
        cmd.arg("-h")
            .arg(self.dir.path())
            .arg("-p")
            .arg(self.port.to_string())
            .args([
                "-U",
                ADMIN,
                "-d",
                "postgres",
                "-AtXq",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ]);
        cmd
    }

    /// Runs SQL as the superuser over the private socket; panics on failure.
    pub fn sql(&self, sql: &str) -> String {
        stdout_of(self.client(sql)).unwrap_or_else(|| panic!("query failed: {sql}"))
    }

    /// The backend pid holding the guard's advisory lock for `name`, if any.
    pub fn holder_of(&self, name: &str) -> Option<i32> {
        self.sql(&format!(
            "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
             AND l.objsubid = 1 AND ((l.classid::int8 << 32) | l.objid::int8) = \
             ('x' || left(encode(sha256('sentinel-guard:{name}'), 'hex'), 16))::bit(64)::int8"
        ))
        .parse()
        .ok()
    }

    pub fn kill9(&mut self) {
        if self.process.is_none() {
            return;
        }
        let postmaster = self.pid();
        let backends = procs::children(postmaster);
        self.signal_all(nix::libc::SIGKILL);
        if let Some(mut child) = self.process.take() {
            let _ = child.wait();
        }
        // A restart must not meet the old backends still holding the data directory.
        wait_until(Duration::from_secs(10), || {
            backends
                .iter()
                .all(|pid| matches!(procs::state(*pid), None | Some('Z' | 'X')))
        });
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.boot();
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.kill9();
    }
}
