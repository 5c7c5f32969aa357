//! `--metrics-addr`: `/metrics`, `/healthz` and `/leader` over HTTP/1, served on the guard's own
//! runtime so a guard whose lock logic is stuck cannot answer that it is fine.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::metrics::{self, Metrics};

/// A client that has not sent its request headers by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// At most this many connections are open at once; a new one beyond it closes the oldest. Every
/// response closes its connection (no keep-alive), so the open ones are those still to send a
/// request: idle or slow clients, never a scrape being answered. The port is often bound to
/// 0.0.0.0, and must never cost the guard the descriptors its lock needs.
const MAX_CONNECTIONS: usize = 64;
/// No connection lives longer than this, whatever it sends.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);

/// The bound listening socket. Bound before anything else so a taken address is a usage error
/// (exit 2) raised before any lock is taken.
pub struct Endpoints {
    listener: std::net::TcpListener,
}

impl Endpoints {
    pub fn bind(addr: SocketAddr) -> Result<Endpoints, String> {
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| format!("--metrics-addr {addr}: cannot listen: {e}"))?;
        Ok(Endpoints { listener })
    }

    /// Serves until the runtime ends. Must be called from within the runtime.
    pub fn serve(self, metrics: Metrics) -> std::io::Result<()> {
        let listener = TcpListener::from_std(self.listener)?;
        let addr = listener.local_addr()?;
        info!(event = "metrics_listening", %addr, "serving /metrics, /healthz and /leader");
        tokio::spawn(accept(listener, metrics));
        Ok(())
    }
}

async fn accept(listener: TcpListener, metrics: Metrics) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(false);
    // Oldest first; a connection whose task has ended has a closed sender.
    let mut open: VecDeque<oneshot::Sender<()>> = VecDeque::with_capacity(MAX_CONNECTIONS);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: pause instead of spinning on the error.
                warn!(error = %e, "metrics endpoint cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        open.retain(|connection| !connection.is_closed());
        if open.len() >= MAX_CONNECTIONS {
            if let Some(oldest) = open.pop_front() {
                debug!("metrics endpoint at its connection cap; closing the oldest connection");
                let _ = oldest.send(());
            }
        }
        let (close, closed) = oneshot::channel();
        open.push_back(close);
        let metrics = metrics.clone();
        let connection = http.serve_connection(
            TokioIo::new(stream),
            hyper::service::service_fn(move |request| {
                let response = respond(&metrics, &request);
                async move { Ok::<_, Infallible>(response) }
            }),
        );
        tokio::spawn(async move {
            tokio::select! {
                served = tokio::time::timeout(CONNECTION_DEADLINE, connection) => match served {
                    Ok(Err(e)) => debug!(error = %e, "metrics connection ended with an error"),
                    Err(_) => debug!("metrics connection closed at its deadline"),
                    Ok(Ok(())) => {}
                },
                _ = closed => {}
            }
        });
    }
}

fn respond(metrics: &Metrics, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    }
    match request.uri().path() {
        "/metrics" => Response::builder()
            .header(CONTENT_TYPE, metrics::CONTENT_TYPE)
            .body(Full::new(Bytes::from(metrics.render())))
            .expect("static response parts are valid"),
        "/healthz" if metrics.is_app_unhealthy() => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "the app failed its health check --health-retries times in a row; stepping down\n",
        ),
        "/healthz" if metrics.is_healthy() => plain(StatusCode::OK, "ok\n"),
        "/healthz" => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "lock ownership not proven in time\n",
        ),
        "/leader" if metrics.is_leader() => plain(StatusCode::OK, "leader\n"),
        "/leader" => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "not the leader: this instance does not hold the lock or its app is not running\n",
        ),
        _ => plain(StatusCode::NOT_FOUND, "try /metrics, /healthz or /leader\n"),
    }
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("static response parts are valid")
}
