//! Serving connections with bounds a hostile client cannot get around: hyper's header read
//! timeout (a request's headers, and the start of the next request on a kept-alive
//! connection, must arrive in time), a cap on open connections below the process's
//! open-file limit, and graceful shutdown, on hyper-util's server builder.
//!
//! At the cap, a new connection closes the oldest connection that has no request in flight:
//! thousands of half-open sockets (`GET / HTTP/1.1\r\nX: ` and then silence) only ever push
//! each other out, and `/health` gets through. A connection counts as busy from the moment
//! its request's headers have arrived until its response body has been sent or dropped.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, HttpBody};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::task::AbortHandle;
use tower::ServiceExt;

use crate::metrics::Metrics;

/// Concurrent streams one HTTP/2 connection may carry.
const H2_MAX_STREAMS: u32 = 64;
/// Largest request head (request line and headers) an HTTP/1 client may send; beyond it the
/// answer is 431. hyper's default is ~400 KB, far more than any API client sends.
const MAX_HEAD_BYTES: usize = 64 << 10;
/// File descriptors kept for everything but client sockets (model files, the log, ...).
const RESERVED_FDS: usize = 128;

/// One open connection.
#[derive(Default)]
struct Conn {
    /// Requests whose response has not been sent or dropped yet.
    in_flight: AtomicUsize,
    abort: Mutex<Option<AbortHandle>>,
}

/// The open connections, oldest first.
pub(crate) struct Connections {
    max: usize,
    open: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next_id: AtomicUsize,
    metrics: Arc<Metrics>,
}

/// Removes its connection from the table when the connection's task ends (or is aborted).
pub(crate) struct Admitted {
    table: Arc<Connections>,
    id: u64,
    conn: Arc<Conn>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.table.open.lock();
        open.remove(&self.id);
        self.table.metrics.set_connections(open.len());
    }
}

impl Connections {
    /// A table of at most `max` connections, lowered to fit the open-file limit.
    pub(crate) fn new(max: usize, metrics: Arc<Metrics>) -> Arc<Connections> {
        let max = match open_file_limit() {
            Some(limit) if max + RESERVED_FDS > limit => {
                let fitted = limit.saturating_sub(RESERVED_FDS).max(1);
                tracing::warn!(
                    "--max-connections {max} does not fit the open-file limit of {limit}; \
                     serving at most {fitted} connections (raise `ulimit -n` for more)"
                );
                fitted
            }
            _ => max.max(1),
        };
        Arc::new(Connections {
            max,
            open: Mutex::new(BTreeMap::new()),
            next_id: AtomicUsize::new(0),
            metrics,
        })
    }

    /// Makes room for a new connection (closing the oldest idle one at the cap), or `None`
    /// when every open connection is busy and the new one must be closed.
    fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let mut open = self.open.lock();
        if open.len() >= self.max {
            let idle = open
                .iter()
                .find(|(_, c)| c.in_flight.load(Ordering::SeqCst) == 0 && c.abort.lock().is_some())
                .map(|(&id, _)| id);
            let id = idle?;
            if let Some(conn) = open.remove(&id)
                && let Some(abort) = conn.abort.lock().take()
            {
                abort.abort();
            }
            self.metrics.connection_evicted();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) as u64;
        let conn = Arc::new(Conn::default());
        open.insert(id, conn.clone());
        self.metrics.set_connections(open.len());
        Some(Admitted {
            table: self.clone(),
            id,
            conn,
        })
    }

    /// The most connections this table holds.
    pub(crate) fn max(&self) -> usize {
        self.max
    }
}

/// `Max open files` (soft limit) from `/proc/self/limits`, where it can be read.
fn open_file_limit() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Counts a request in flight on its connection until its response body is done.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn enter(conn: &Arc<Conn>) -> InFlight {
        conn.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(conn.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request counted as in flight while it is being sent.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for TrackedBody {
    type Data = <Body as HttpBody>::Data;
    type Error = <Body as HttpBody>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Accepts connections on `listener` and serves `router` on each until `stop` resolves; then
/// stops accepting and lets open connections finish within `grace`.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    table: Arc<Connections>,
    header_read_timeout: Duration,
    grace: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_STREAMS);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tracing::info!(
        max_connections = table.max(),
        header_read_timeout_s = header_read_timeout.as_secs_f64(),
        "accepting connections"
    );
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(err) => {
                // Out of file descriptors or a connection reset before accept: not fatal.
                tracing::warn!("accepting a connection failed: {err}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        // Streamed tokens are small writes, each of which must leave at once: with Nagle's
        // algorithm a WebSocket message written right after another waited for the client's
        // delayed ACK (~40 ms on Linux; seen as the gap between a `token` notification and the
        // result of a one-token `generate`).
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!("setting TCP_NODELAY failed: {err}");
        }
        let Some(admitted) = table.admit() else {
            tracing::debug!("every connection is busy; closing a new one");
            drop(stream);
            continue;
        };
        let conn = admitted.conn.clone();
        let evictable = admitted.conn.clone();
        let router = router.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<_>| {
            let in_flight = InFlight::enter(&conn);
            let router = router.clone();
            async move {
                let response = router.oneshot(request.map(Body::new)).await?;
                Ok::<_, Infallible>(response.map(|inner| {
                    Body::new(TrackedBody {
                        inner,
                        _in_flight: in_flight,
                    })
                }))
            }
        });
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        let task = tokio::spawn(async move {
            let _admitted = admitted;
            if let Err(err) = connection.await {
                tracing::debug!("connection ended: {err}");
            }
        });
        // Set after spawning: until then the connection cannot be evicted, which is fine.
        *evictable.abort.lock() = Some(task.abort_handle());
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace + Duration::from_secs(1)) => {
            tracing::warn!("connections still open after the grace period; closing them");
        }
    }
}
