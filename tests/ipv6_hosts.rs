//! Bracketed IPv6 literal hosts reach the server on every networked backend, for real: each server
//! is reached through a listener on the IPv6 loopback (`[::1]`).

mod common;

use std::time::Duration;

use common::mariadb::MariaDb;
use common::proxy::Proxy;
use common::redis::Redis;
use common::*;

fn takes_the_lock_through(url: &str) {
    let mut lab = Lab::new();
    let (code, log) = lab.run(
        &[&["--url", url, "--name", "ipv6"], FAST].concat(),
        &["sh", "-c", "exit 7"],
        Duration::from_secs(20),
    );
    assert_eq!(
        code, 7,
        "{url}: the app did not run under the lock; log:\n{log}"
    );
    assert!(log.contains("lock_acquired"), "{url}: {log}");
}

#[test]
fn mysql_url_with_a_bracketed_ipv6_literal_connects() {
    let db = MariaDb::start();
    let proxy = Proxy::listening_on("[::1]:0", db.port);
    let url = db
        .url_with_port(proxy.port)
        .replace("@127.0.0.1:", "@[::1]:");
    assert!(url.contains("@[::1]:"), "{url}");
    takes_the_lock_through(&url);
}

#[test]
fn redis_url_with_a_bracketed_ipv6_literal_connects() {
    let redis = Redis::start();
    let proxy = Proxy::listening_on("[::1]:0", redis.port);
    takes_the_lock_through(&format!("redis://[::1]:{}", proxy.port));
}
