//! The server: the router with its auth / metrics / body-limit layers, and serving with
//! graceful shutdown. The state the handlers share lives in [`crate::state`].

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::connections::Connections;
use crate::engine::Engine;
use crate::error::{ApiError, ServerError};
use crate::metrics::Metrics;
use crate::models::{ModelSource, Registry, SourceModel};
use crate::routes;
use crate::state::{AppState, ServerConfig};

/// Reads API keys from `path`: one per line; blank lines and `#` comments are skipped.
pub fn load_api_key_file(path: &Path) -> Result<Vec<String>, ServerError> {
    let text = std::fs::read_to_string(path).map_err(|source| ServerError::KeyFile {
        path: path.to_path_buf(),
        source,
    })?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    if keys.is_empty() {
        return Err(ServerError::EmptyKeyFile {
            path: path.to_path_buf(),
        });
    }
    Ok(keys)
}

/// An OpenAI-compatible server. Create it, start serving, and hand it the model when loaded:
/// `/health` answers 503 until then.
#[derive(Clone)]
pub struct Server {
    state: Arc<AppState>,
}

impl Server {
    pub fn new(config: ServerConfig) -> Server {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let models = Registry::new(config.memory_budget);
        Server {
            state: Arc::new(AppState {
                config,
                metrics: Arc::new(Metrics::new()),
                models,
                shutting_down: AtomicBool::new(false),
                started,
            }),
        }
    }

    /// Makes the default model available and starts its worker thread.
    pub fn set_engine(&self, engine: Arc<dyn Engine>) {
        tracing::info!(
            model = engine.model_id(),
            context = engine.context_length(),
            "model ready"
        );
        self.state.finish_default_load(Ok(engine));
    }

    /// Records that loading the default model failed; requests get 503 with `message`.
    pub fn set_load_failed(&self, message: impl Into<String>) {
        self.state.finish_default_load(Err(message.into()));
    }

    /// Serves several models: `default` is the one being loaded at start (`set_engine`), and
    /// requests naming another model that `source` knows load it on demand (see
    /// [`crate::models`] for the limits). Call before serving.
    pub fn set_model_source(&self, source: Arc<dyn ModelSource>, default: SourceModel) {
        self.state.set_model_source(source, default);
    }

    /// The routes with all layers.
    pub fn router(&self) -> Router {
        let state = self.state.clone();
        let v1 = Router::new()
            .route("/v1/models", get(routes::models))
            .route("/v1/models/{id}", get(routes::model))
            .route("/v1/models/{id}/load", post(routes::load_model))
            .route("/v1/models/{id}/unload", post(routes::unload_model))
            .route("/v1/chat/completions", post(routes::chat_completions))
            .route("/v1/completions", post(routes::completions))
            .route("/v1/embeddings", post(routes::embeddings))
            .route_layer(middleware::from_fn_with_state(
                state.clone(),
                require_api_key,
            ));
        let router = Router::new()
            .route("/health", get(routes::health))
            // Outside the key layer: a WebSocket client may authenticate in its first message.
            .route("/v1/ws", get(crate::ws::upgrade))
            .route("/metrics", get(routes::metrics))
            .route("/api/ps", get(routes::ps))
            .merge(v1)
            .fallback(routes::fallback)
            .layer(DefaultBodyLimit::max(state.config.body_limit));
        // Outside the API-key check: a browser's preflight carries no credentials.
        let router = match &state.config.cors_origins {
            Some(origins) => router.layer(origins.layer()),
            None => router,
        };
        router
            .layer(middleware::from_fn_with_state(state.clone(), observe))
            .with_state(state)
    }

    /// Serves gRPC (KServe v2 health/metadata/ModelInfer and `gdsllm.v1.Generation`) on
    /// `listener` beside [`Server::serve`]'s HTTP, until that begins shutting down.
    pub async fn serve_grpc(&self, listener: tokio::net::TcpListener) -> Result<(), ServerError> {
        crate::grpc::serve(self.state.clone(), listener).await
    }

    /// Serves on `listener` until `shutdown` resolves; then refuses new work, lets in-flight
    /// requests finish for `shutdown_grace`, cancels what is left, and stops the worker.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let state = self.state.clone();
        let on_shutdown = async move {
            shutdown.await;
            tracing::info!("shutting down: refusing new requests, finishing in-flight ones");
            state.shutting_down.store(true, Ordering::SeqCst);
            let schedulers = state.schedulers();
            for scheduler in &schedulers {
                scheduler.close();
            }
            let grace = state.config.shutdown_grace;
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                tracing::warn!("shutdown grace period over: cancelling in-flight requests");
                for scheduler in schedulers {
                    scheduler.cancel_all();
                }
            });
        };
        if let Some(timeout) = self.state.config.model_idle_timeout {
            tokio::spawn(crate::models::unload_idle_models(
                self.state.clone(),
                timeout,
            ));
        }
        let config = &self.state.config;
        let table = Connections::new(config.max_connections, self.state.metrics.clone());
        crate::connections::serve(
            listener,
            self.router(),
            table,
            config.header_read_timeout,
            config.shutdown_grace,
            on_shutdown,
        )
        .await;
        for scheduler in self.state.schedulers() {
            scheduler.cancel_all();
            scheduler.close();
            let _ = tokio::task::spawn_blocking(move || scheduler.join()).await;
        }
        tracing::info!("server stopped");
        Ok(())
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(err) => {
                tracing::warn!("cannot listen for SIGTERM: {err}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = term => tracing::info!("SIGTERM received"),
    }
}

/// Equal-length keys are compared without an early exit, so timing does not reveal a prefix.
fn key_matches(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let keys = &state.config.api_keys;
    if keys.is_empty() {
        return next.run(request).await;
    }
    let header = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match check_bearer(keys, header) {
        Some(Ok(())) => next.run(request).await,
        None => ApiError::unauthorized(
            "missing API key: send `Authorization: Bearer <key>` (this server was started with --api-key)",
        )
        .into_response(),
        Some(Err(err)) => err.into_response(),
    }
}

/// Whether `key` is one of `keys`.
pub(crate) fn key_allowed(keys: &[String], key: &str) -> bool {
    keys.iter().any(|k| key_matches(key, k))
}

/// An `Authorization: Bearer KEY` header value (HTTP, or gRPC's `authorization` metadata)
/// checked against `keys`: `None` when there is none.
pub(crate) fn check_bearer(keys: &[String], header: Option<&str>) -> Option<Result<(), ApiError>> {
    let given = header
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)?;
    Some(if key_allowed(keys, given) {
        Ok(())
    } else {
        // The key itself never goes into the message or the log.
        Err(ApiError::unauthorized("incorrect API key provided"))
    })
}

/// Counts every request by endpoint and status and logs it (path and status only: headers
/// carry keys).
async fn observe(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let endpoint = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "other".to_string());
    let method = request.method().clone();
    let start = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16();
    state.metrics.request(endpoint.clone(), status);
    tracing::info!(
        %method,
        endpoint,
        status,
        ms = start.elapsed().as_millis() as u64,
        "request"
    );
    response
}
