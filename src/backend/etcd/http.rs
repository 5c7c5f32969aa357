//! etcd's v3 API as JSON over HTTP/1.1: the gateway every etcd member serves on its client port
//! (`/v3/kv/txn`, `/v3/lease/keepalive`, `/v3/watch`, ...), the same requests and answers as its
//! gRPC API. Chosen over the gRPC client crate, whose build needs `protoc` on the building machine
//! and which brings HTTP/2 and a gRPC stack into every guard; hyper, serde_json and rustls are
//! here already.
//!
//! The client fails over between members: a member that cannot be reached, or answers that it has
//! no leader, is left for the next one, within the call's one bound. Every request etcd serves this
//! way is linearizable (the gateway never asks for serializable reads).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};

use crate::config::EtcdTarget;

/// The largest answer read: the guard's requests name one key, whose answers are a few hundred
/// bytes; anything far larger is not an etcd answer to them.
const MAX_ANSWER: usize = 1 << 20;

/// Why a call did not answer with a value.
#[derive(Debug)]
pub enum CallError {
    /// No member could be reached, or none had a leader (what the last one said).
    Unreachable(String),
    /// A member refused the guard: its credentials, its permissions, the member's certificate.
    Refused(String),
    /// A member answered with another error.
    Failed(String),
    /// No answer within the call's bound.
    Silent(Duration),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unreachable(why) | CallError::Refused(why) | CallError::Failed(why) => {
                f.write_str(why)
            }
            CallError::Silent(limit) => {
                write!(
                    f,
                    "no answer within {}",
                    crate::vocab::show_duration(*limit)
                )
            }
        }
    }
}

/// What one member did with a request: answered, or is to be left for the next member.
enum Exchange {
    Next(String),
    Final(CallError),
}

/// A connection to one member at a time, the member it reaches, and the authentication token.
pub struct Client {
    target: Arc<EtcdTarget>,
    tls: Option<Arc<rustls::ClientConfig>>,
    member: usize,
    conn: Option<SendRequest<Full<Bytes>>>,
    token: Option<String>,
}

/// An open watch of one key.
pub struct Watch {
    body: Incoming,
    buffer: Vec<u8>,
    /// The connection the watch streams on: closed with the watch.
    _conn: SendRequest<Full<Bytes>>,
}

pub fn base64(raw: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(raw)
}

/// A base64 field of an answer, as text; empty when missing or not UTF-8.
pub fn text(field: &Value) -> String {
    field
        .as_str()
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .unwrap_or_default()
}

/// An int64 field of an answer (the gateway writes them as strings); 0 when missing, as protobuf's
/// JSON leaves zero values out.
pub fn int(field: &Value) -> i64 {
    match field {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

impl Client {
    pub fn new(target: &EtcdTarget) -> Result<Client, CallError> {
        let tls = target.tls.then(|| tls_config(target)).transpose()?;
        Ok(Client {
            target: Arc::new(target.clone()),
            tls,
            member: 0,
            conn: None,
            token: None,
        })
    }

    /// Drops the connection: the next call opens a new one.
    pub fn disconnect(&mut self) {
        self.conn = None;
    }

    /// Where the client is connected, safe to print.
    pub fn member(&self) -> String {
        let (host, port) = &self.target.members[self.member];
        authority(host, *port)
    }

    /// POSTs `body` to `path`, on the members in turn, all within `limit`.
    pub async fn call(
        &mut self,
        path: &str,
        body: &Value,
        limit: Duration,
    ) -> Result<Value, CallError> {
        let until = Instant::now() + limit;
        let members = self.target.members.len();
        let mut last = String::new();
        for tried in 0..members {
            // The member in use gets most of the bound (a reconnect and a TLS handshake must fit);
            // if it is silent, the others share the rest.
            let left = until.saturating_duration_since(Instant::now());
            let share = match members - tried {
                1 => left,
                _ if tried == 0 => left * 2 / 3,
                others => left / others as u32,
            };
            match timeout(share, self.on_member(path, body)).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(Exchange::Final(error))) => {
                    self.conn = None;
                    return Err(error);
                }
                Ok(Err(Exchange::Next(why))) => last = format!("{}: {why}", self.member()),
                Err(_) if members == 1 => {
                    self.conn = None;
                    return Err(CallError::Silent(limit));
                }
                Err(_) => last = format!("{}: no answer", self.member()),
            }
            self.conn = None;
            self.member = (self.member + 1) % members;
        }
        Err(CallError::Unreachable(last))
    }

    async fn on_member(&mut self, path: &str, body: &Value) -> Result<Value, Exchange> {
        if self.conn.is_none() {
            self.conn = Some(self.connect().await?);
        }
        let mut token_renewed = false;
        loop {
            if self.token.is_none() {
                self.authenticate().await?;
            }
            match self.post(path, body).await {
                // A token that expired (`--auth-token-ttl`, a restart): once more with a new one.
                Err(Exchange::Final(CallError::Refused(why)))
                    if why.contains("invalid auth token") && !token_renewed =>
                {
                    self.token = None;
                    token_renewed = true;
                }
                answered => return answered,
            }
        }
    }

    async fn authenticate(&mut self) -> Result<(), Exchange> {
        let Some((name, password)) = self.target.credentials.clone() else {
            return Ok(());
        };
        let body = json!({ "name": name, "password": password });
        let answer = self.post("/v3/auth/authenticate", &body).await?;
        match answer["token"].as_str() {
            Some(token) => {
                self.token = Some(token.to_owned());
                Ok(())
            }
            None => Err(Exchange::Final(CallError::Refused(
                "the member gave no authentication token".to_owned(),
            ))),
        }
    }

    async fn post(&mut self, path: &str, body: &Value) -> Result<Value, Exchange> {
        let member = self.member();
        let Some(conn) = self.conn.as_mut() else {
            return Err(Exchange::Next("not connected".to_owned()));
        };
        let response = send(conn, &member, self.token.as_deref(), path, body).await?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| Exchange::Next(e.to_string()))?
            .to_bytes();
        let answer: Value = serde_json::from_slice(&bytes).map_err(|_| {
            Exchange::Next(format!(
                "not an etcd answer (HTTP {status}): is this an etcd client port?"
            ))
        })?;
        // A streamed request (a keep-alive) answers `{"result": ...}` or `{"error": {...}}`; the others
        // answer themselves, or `{"error": "...", "code": N}` with an HTTP error status.
        let error = match &answer["error"] {
            Value::Null if status.is_success() => {
                return Ok(match answer.get("result") {
                    Some(result) => result.clone(),
                    None => answer,
                })
            }
            Value::Object(streamed) => (
                int(&streamed["grpc_code"]),
                streamed["message"].as_str().unwrap_or_default().to_owned(),
            ),
            other => (
                int(&answer["code"]),
                other
                    .as_str()
                    .or(answer["message"].as_str())
                    .map_or_else(|| format!("HTTP {status}"), str::to_owned),
            ),
        };
        Err(classify(error.0, error.1))
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, Exchange> {
        let (host, port) = &self.target.members[self.member];
        let tcp = TcpStream::connect((host.as_str(), *port))
            .await
            .map_err(|e| Exchange::Next(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => handshake(tcp).await,
            Some(config) => {
                let name = ServerName::try_from(host.clone())
                    .map_err(|e| Exchange::Final(CallError::Refused(format!("{host}: {e}"))))?;
                let stream = tokio_rustls::TlsConnector::from(Arc::clone(config))
                    .connect(name, tcp)
                    .await
                    .map_err(|e| {
                        let message = e.to_string();
                        if message.contains("invalid peer certificate") {
                            Exchange::Final(CallError::Refused(format!(
                                "TLS certificate not trusted (give the CA that signed the members' \
                                 certificates with --ca-file): {message}"
                            )))
                        } else {
                            Exchange::Next(message)
                        }
                    })?;
                handshake(stream).await
            }
        }
    }

    /// Watches `key` from `revision` on, on a connection of its own to the current member.
    pub async fn watch(
        &mut self,
        key: &str,
        revision: i64,
        limit: Duration,
    ) -> Result<Watch, CallError> {
        let opened = timeout(limit, async {
            if self.token.is_none() && self.target.credentials.is_some() {
                if self.conn.is_none() {
                    self.conn = Some(self.connect().await?);
                }
                self.authenticate().await?;
            }
            let mut conn = self.connect().await?;
            let body = json!({ "create_request": { "key": base64(key), "start_revision": revision.to_string() } });
            let response = send(
                &mut conn,
                &self.member(),
                self.token.as_deref(),
                "/v3/watch",
                &body,
            )
            .await?;
            Ok(Watch {
                body: response.into_body(),
                buffer: Vec::new(),
                _conn: conn,
            })
        })
        .await;
        match opened {
            Ok(Ok(watch)) => Ok(watch),
            Ok(Err(Exchange::Next(why))) => Err(CallError::Unreachable(why)),
            Ok(Err(Exchange::Final(error))) => Err(error),
            Err(_) => Err(CallError::Silent(limit)),
        }
    }
}

impl Watch {
    /// Resolves with true once an event deletes the key (its lease expired or was revoked, or its
    /// holder deleted it), with false if the watch ends or fails.
    pub async fn deleted(&mut self) -> bool {
        loop {
            let mut parsed = 0;
            let mut stream =
                serde_json::Deserializer::from_slice(&self.buffer).into_iter::<Value>();
            let mut found = false;
            while let Some(Ok(message)) = stream.next() {
                parsed = stream.byte_offset();
                let result = &message["result"];
                if !message["error"].is_null() || result["canceled"].as_bool() == Some(true) {
                    return false;
                }
                if let Some(events) = result["events"].as_array() {
                    found |= events.iter().any(|event| event["type"] == "DELETE");
                }
            }
            self.buffer.drain(..parsed);
            if found {
                return true;
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.buffer.extend_from_slice(data);
                    }
                    if self.buffer.len() > MAX_ANSWER {
                        return false;
                    }
                }
                _ => return false,
            }
        }
    }
}

/// POSTs `body` to `path` on `conn`, which reaches `member`, with the authentication token if any.
async fn send(
    conn: &mut SendRequest<Full<Bytes>>,
    member: &str,
    token: Option<&str>,
    path: &str,
    body: &Value,
) -> Result<hyper::Response<Incoming>, Exchange> {
    let mut request = Request::post(path)
        .header(HOST, member)
        .header(CONTENT_TYPE, "application/json");
    if let Some(token) = token {
        request = request.header(AUTHORIZATION, token);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| Exchange::Final(CallError::Failed(e.to_string())))?;
    let lost = |e: hyper::Error| Exchange::Next(e.to_string());
    conn.ready().await.map_err(lost)?;
    conn.send_request(request).await.map_err(lost)
}

/// What an error code (gRPC's) and message say to do: leave a member without a leader or shutting
/// down for the next one; stop at a refusal.
fn classify(code: i64, message: String) -> Exchange {
    const UNAVAILABLE: i64 = 14;
    const PERMISSION_DENIED: i64 = 7;
    const UNAUTHENTICATED: i64 = 16;
    let refusal = message.contains("authentication failed")
        || message.contains("invalid auth token")
        || message.contains("user name is empty")
        || message.contains("permission denied");
    if refusal || matches!(code, PERMISSION_DENIED | UNAUTHENTICATED) {
        Exchange::Final(CallError::Refused(format!(
            "etcd refused the guard: {message}"
        )))
    } else if code == UNAVAILABLE || message.contains("no leader") || message.contains("stopped") {
        Exchange::Next(message)
    } else {
        Exchange::Final(CallError::Failed(message))
    }
}

async fn handshake<S>(stream: S) -> Result<SendRequest<Full<Bytes>>, Exchange>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| Exchange::Next(e.to_string()))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

fn authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Verifies members' certificates against `--ca-file` alone, or the system's roots.
fn tls_config(target: &EtcdTarget) -> Result<Arc<rustls::ClientConfig>, CallError> {
    let certs: Vec<CertificateDer<'static>> = match &target.ca {
        Some(ca) => rustls::pki_types::pem::PemObject::pem_slice_iter(&ca.pem)
            .collect::<Result<_, _>>()
            .map_err(|e| CallError::Refused(format!("--ca-file {}: {e}", ca.path.display())))?,
        None => rustls_native_certs::load_native_certs().certs,
    };
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(CallError::Refused(
            "no CA certificate to verify the members with; give one with --ca-file".to_owned(),
        ));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| CallError::Refused(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
