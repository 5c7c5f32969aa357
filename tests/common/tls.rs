//! Certificates made with the `openssl` command line for the test servers' TLS: a CA of the test's
//! own, and a server certificate for 127.0.0.1 signed by it.

use std::path::Path;
use std::process::Command;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl is not installed");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed CA: `<name>.pem` and `<name>.key` in `dir`.
pub fn make_ca(dir: &Path, name: &str) {
    let (cert, key) = (format!("{name}.pem"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &cert,
            "-days",
            "2",
            "-subj",
            &format!("/CN=test {name}"),
        ],
    );
}

/// In `dir`: a CA (`ca.pem`, `ca.key`) and a certificate for 127.0.0.1 it signed (`server.pem`,
/// `server.key`).
pub fn server_certificate(dir: &Path) {
    make_ca(dir, "ca");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ],
    );
}
