//! A stand-in for a connection pooler in transaction (or statement) mode, as PgBouncer or RDS Proxy
//! run: each statement a client sends goes to a server connection of its own, so consecutive
//! statements run on different backends. Speaks just enough of the PostgreSQL protocol for simple
//! queries, and reaches the server as a role that needs no password.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;

/// The protocol codes of the requests that come before a startup message.
const SSL_REQUEST: u32 = 80_877_103;
const CANCEL_REQUEST: u32 = 80_877_102;

pub struct Pooler {
    pub port: u16,
}

impl Pooler {
    pub fn start(upstream_port: u16) -> Pooler {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                thread::spawn(move || {
                    let _ = serve(client, upstream_port);
                });
            }
        });
        Pooler { port }
    }
}

fn serve(mut client: TcpStream, upstream_port: u16) -> io::Result<()> {
    let startup = loop {
        let packet = read_startup(&mut client)?;
        match u32::from_be_bytes(packet[4..8].try_into().unwrap()) {
            SSL_REQUEST => client.write_all(b"N")?,
            CANCEL_REQUEST => return Ok(()),
            _ => break packet,
        }
    };
    // The client's session starts on one server connection...
    let (_, greeting) = open(&startup, upstream_port)?;
    client.write_all(&greeting)?;
    loop {
        let (kind, message) = read_message(&mut client)?;
        if kind != b'Q' {
            break;
        }
        // ...and every statement runs on a new one.
        let (mut server, _) = open(&startup, upstream_port)?;
        server.write_all(&message)?;
        client.write_all(&until_ready(&mut server)?)?;
        let _ = server.shutdown(Shutdown::Both);
    }
    let _ = client.shutdown(Shutdown::Both);
    Ok(())
}

/// A server connection past its startup, and what the server said up to ReadyForQuery.
fn open(startup: &[u8], port: u16) -> io::Result<(TcpStream, Vec<u8>)> {
    let mut server = TcpStream::connect(("127.0.0.1", port))?;
    server.write_all(startup)?;
    let greeting = until_ready(&mut server)?;
    Ok((server, greeting))
}

/// The server's messages up to and including ReadyForQuery.
fn until_ready(server: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut all = Vec::new();
    loop {
        let (kind, message) = read_message(server)?;
        all.extend_from_slice(&message);
        if kind == b'Z' {
            return Ok(all);
        }
    }
}

/// A length-prefixed packet without a type byte (startup, SSL and cancel requests).
fn read_startup(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let mut packet = len.to_vec();
    packet.resize(u32::from_be_bytes(len) as usize, 0);
    stream.read_exact(&mut packet[4..])?;
    Ok(packet)
}

/// A typed message, returned whole (type byte and length included).
fn read_message(stream: &mut TcpStream) -> io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    stream.read_exact(&mut head)?;
    let len = u32::from_be_bytes(head[1..5].try_into().unwrap()) as usize;
    let mut message = head.to_vec();
    message.resize(1 + len, 0);
    stream.read_exact(&mut message[5..])?;
    Ok((head[0], message))
}
