//! The static release binary (packaging/static-build.sh) runs where there is no C library at all: a
//! root of busybox-static and the guard, nothing else, chrooted. MySQL, PostgreSQL and Redis are
//! reached by a name from the root's /etc/hosts and by a name only a DNS server on loopback knows
//! (dnsmasq), and the app's exit code comes through.
//!
//! The binary is built outside the tests (a release build takes minutes): `.ci/run` builds it and
//! names it in `SENTINEL_STATIC_GUARD`. Without it the test says it skipped, unless
//! `SENTINEL_REQUIRE_STATIC=1`, which CI sets, makes that a failure.

mod common;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::mariadb::MariaDb;
use common::postgres::Postgres;
use common::redis::Redis;
use common::*;

const HOSTS_NAME: &str = "db-by-hosts.sentinel.test";
const DNS_NAME: &str = "db-by-dns.sentinel.test";

fn static_guard() -> Option<PathBuf> {
    match std::env::var_os("SENTINEL_STATIC_GUARD") {
        Some(path) => Some(PathBuf::from(path)),
        None => {
            let required = std::env::var("SENTINEL_REQUIRE_STATIC").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "SENTINEL_REQUIRE_STATIC=1, but SENTINEL_STATIC_GUARD names no binary \
                 (packaging/static-build.sh builds one)"
            );
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "static_binary: skipped: SENTINEL_STATIC_GUARD is not set"
            );
            None
        }
    }
}

/// Whether the ELF file asks for a dynamic loader (a PT_INTERP program header): a static binary
/// does not.
fn wants_a_loader(elf: &[u8]) -> bool {
    assert_eq!(&elf[..4], b"\x7fELF", "not an ELF file");
    assert_eq!(elf[4], 2, "not a 64-bit ELF file");
    let u16_at = |at: usize| u16::from_le_bytes(elf[at..at + 2].try_into().unwrap()) as usize;
    let u64_at = |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().unwrap()) as usize;
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    (0..phnum).any(|i| {
        let at = phoff + i * phentsize;
        u32::from_le_bytes(elf[at..at + 4].try_into().unwrap()) == PT_INTERP
    })
}

/// A root with busybox as /bin, the guard, and /etc holding the hosts file and resolv.conf, plus
/// empty mount points for /proc, /sys and /dev.
fn minimal_root(dir: &Path, guard: &Path, nameserver: &str) -> PathBuf {
    let root = dir.join("root");
    for sub in ["bin", "usr/local/bin", "etc", "tmp", "proc", "sys", "dev"] {
        fs::create_dir_all(root.join(sub)).unwrap();
    }
    fs::copy("/bin/busybox", root.join("bin/busybox")).expect("busybox-static (/bin/busybox)");
    for applet in ["sh", "sleep", "cat"] {
        symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    fs::copy(guard, root.join("usr/local/bin/sentinel-guard")).unwrap();
    fs::write(
        root.join("etc/hosts"),
        format!("127.0.0.1 localhost\n127.0.0.1 {HOSTS_NAME}\n"),
    )
    .unwrap();
    fs::write(
        root.join("etc/resolv.conf"),
        format!("nameserver {nameserver}\noptions timeout:1 attempts:2\n"),
    )
    .unwrap();
    root
}

/// Every shared object under `root`: there must be none.
fn shared_objects(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            if entry.file_type().unwrap().is_dir() {
                dirs.push(path);
            } else if path.to_string_lossy().contains(".so") {
                found.push(path);
            }
        }
    }
    found
}

/// dnsmasq answering `DNS_NAME` with 127.0.0.1, and nothing else, on `address`:53.
struct Dns(Child);

impl Dns {
    fn start(address: &str) -> Dns {
        let child = Command::new("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--port=53",
                "--pid-file=",
                "--log-facility=-",
            ])
            .arg(format!("--listen-address={address}"))
            .arg(format!("--address=/{DNS_NAME}/127.0.0.1"))
            // Every other name of the test's domain is answered "no such name", as a real DNS
            // server answers for a name only the hosts file knows; glibc consults the hosts file
            // after that answer only if nsswitch.conf (or its default) puts it first.
            .arg("--local=/sentinel.test/")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq (apt-get install dnsmasq-base)");
        let dns = Dns(child);
        assert!(
            wait_until(Duration::from_secs(10), || answers_a(address, DNS_NAME)),
            "dnsmasq did not answer on {address}"
        );
        dns
    }
}

/// Whether the DNS server at `server`:53 answers a query for `name`'s IPv4 address with a record.
fn answers_a(server: &str, name: &str) -> bool {
    let Ok(socket) = std::net::UdpSocket::bind("127.0.0.1:0") else {
        return false;
    };
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // Header: id, flags (recursion desired), one question; then the name as labels, type A, class IN.
    let mut query = vec![0x51, 0x47, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        query.push(label.len() as u8);
        query.extend_from_slice(label.as_bytes());
    }
    query.extend_from_slice(&[0, 0, 1, 0, 1]);
    let mut answer = [0u8; 512];
    socket.send_to(&query, (server, 53)).is_ok()
        && socket
            .recv(&mut answer)
            .is_ok_and(|n| n >= 12 && answer[..2] == query[..2] && answer[7] >= 1)
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the guard chrooted in `root`, as a container would: in a mount namespace of its own with
/// /proc, /sys and /dev mounted, with an environment of nothing but PATH (the host's, for
/// `unshare`, `mount` and `chroot`; the guard runs busybox by absolute path). Returns the exit code and
/// stderr.
fn run_chrooted(root: &Path, url: &str, app: &str) -> (i32, String) {
    let script = r#"root=$1; shift
mount -t proc proc "$root/proc" && mount --rbind /sys "$root/sys" && mount --rbind /dev "$root/dev" \
  && exec chroot "$root" /usr/local/bin/sentinel-guard "$@""#;
    let mut child = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            "sh",
        ])
        .arg(root)
        .args([
            "--url",
            url,
            "--name",
            "static",
            "--connect-timeout",
            "5s",
            "--",
            "/bin/sh",
            "-c",
            app,
        ])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        // A fresh lock has no record: without this the guard would first wait the bound.
        .env("SENTINEL_GUARD_TAKEOVER_DELAY", "0s")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = exit_within(&mut child, Duration::from_secs(60)).unwrap_or_else(|| {
        let _ = child.kill();
        panic!("the chrooted guard for {url} did not exit within 60s")
    });
    let mut log = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    (status.code().unwrap_or(-1), log)
}

#[test]
fn the_static_binary_reaches_every_server_by_name_in_a_root_without_a_c_library() {
    let Some(guard) = static_guard() else { return };
    let binary = fs::read(&guard).unwrap();
    assert!(
        !wants_a_loader(&binary),
        "{} asks for a dynamic loader: it is not static",
        guard.display()
    );
    // A loopback address of this process's own for the DNS server, so that two runs never meet.
    let pid = std::process::id();
    let nameserver = format!("127.53.{}.{}", (pid >> 8) % 250 + 1, pid % 250 + 1);
    let _dns = Dns::start(&nameserver);
    let dir = TempDir::new().unwrap();
    let root = minimal_root(dir.path(), &guard, &nameserver);
    assert_eq!(shared_objects(&root), Vec::<PathBuf>::new());

    let (mysql, postgres, redis) = (MariaDb::start(), Postgres::start(), Redis::start());
    let urls = [mysql.url(), postgres.url(), redis.url()];
    for url in &urls {
        assert!(url.contains("127.0.0.1:"), "{url}");
        for name in [HOSTS_NAME, DNS_NAME] {
            let url = url.replacen("127.0.0.1:", &format!("{name}:"), 1);
            let (code, log) = run_chrooted(&root, &url, "exit 7");
            assert_eq!(
                code, 7,
                "{url}: the app's exit code did not come through:\n{log}"
            );
            assert!(log.contains("lock_acquired"), "{url}:\n{log}");
        }
    }
    // And a name neither knows fails as an unreachable backend does: the lookups above were real.
    let unknown = urls[2].replacen("127.0.0.1:", "nowhere.sentinel.test:", 1);
    let (code, log) = run_chrooted(&root, &unknown, "exit 7");
    assert_eq!(code, 69, "{unknown}:\n{log}");
}
