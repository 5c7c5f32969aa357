//! A TCP proxy between the guard and its server that can go silent: bytes stop flowing both ways
//! while every socket stays open, as in a network partition.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

pub struct Proxy {
    pub port: u16,
    silent: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(upstream_port: u16) -> Proxy {
        Proxy::listening_on("127.0.0.1:0", upstream_port)
    }

    /// A proxy listening on `address` (e.g. `[::1]:0`, to reach an IPv4-only server over IPv6).
    pub fn listening_on(address: &str, upstream_port: u16) -> Proxy {
        let listener = TcpListener::bind(address).unwrap();
        let port = listener.local_addr().unwrap().port();
        let silent = Arc::new(AtomicBool::new(false));
        let flag = silent.clone();
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream_port)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                pump(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    flag.clone(),
                );
                pump(server, client, flag.clone());
            }
        });
        Proxy { port, silent }
    }

    /// From now on, every byte in either direction is dropped; no connection is closed.
    pub fn partition(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, silent: Arc<AtomicBool>) {
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if silent.load(Ordering::SeqCst) {
                continue;
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        if !silent.load(Ordering::SeqCst) {
            let _ = to.shutdown(Shutdown::Write);
        }
    });
}
