//! gRPC (`gdsllm serve --grpc-port N`), for service-to-service calls: the KServe v2 / Open
//! Inference Protocol health and metadata RPCs and `ModelInfer` for embeddings
//! (proto/grpc_predict_v2.proto), and this project's server-streaming `Generate`
//! (proto/gdsllm.proto). Both share the REST API's scheduler, batching, request validation,
//! limits and API keys (`authorization: Bearer KEY` metadata, on every RPC).
//!
//! Deadlines: a unary call's `grpc-timeout` is enforced by tonic (the call is dropped, which
//! cancels its work); `Generate` ends its stream with DEADLINE_EXCEEDED when its own deadline
//! passes. A client that cancels a call, or goes away, drops its stream, which cancels the
//! sequence.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use futures::Stream;
use serde_json::{Value, json};
use tonic::{Request, Response, Status};

use crate::error::{ApiError, ServerError};
use crate::params::PromptInput;
use crate::routes;
use crate::scheduler::{Event, SequenceHandle};
use crate::server::check_bearer;
use crate::state::AppState;

/// Code generated from proto/grpc_predict_v2.proto (package `inference`).
pub mod inference {
    tonic::include_proto!("inference");
}

/// Code generated from proto/gdsllm.proto (package `gdsllm.v1`).
pub mod gdsllm_v1 {
    tonic::include_proto!("gdsllm.v1");
}

use gdsllm_v1::generation_server::{Generation, GenerationServer};
use gdsllm_v1::{GenerateRequest, GenerateResponse, generate_response};
use inference::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use inference::model_infer_response::InferOutputTensor;
use inference::model_metadata_response::TensorMetadata;
use inference::*;

/// The name of `ModelInfer`'s input (BYTES, one UTF-8 text per element) and output (FP32,
/// one row per input).
pub const INPUT_NAME: &str = "text";
pub const OUTPUT_NAME: &str = "embedding";

/// How often the gRPC server looks whether the HTTP server has begun shutting down.
const SHUTDOWN_POLL: Duration = Duration::from_millis(100);

/// REST's statuses as gRPC codes; the message is REST's, naming the field at fault.
pub(crate) fn status(err: &ApiError) -> Status {
    let message = match &err.param {
        Some(param) if !err.message.contains(param.as_str()) => {
            format!("{} (field `{param}`)", err.message)
        }
        _ => err.message.clone(),
    };
    match err.status {
        StatusCode::UNAUTHORIZED => Status::unauthenticated(message),
        StatusCode::NOT_FOUND => Status::not_found(message),
        StatusCode::TOO_MANY_REQUESTS => Status::resource_exhausted(message),
        StatusCode::SERVICE_UNAVAILABLE => Status::unavailable(message),
        s if s.is_client_error() => Status::invalid_argument(message),
        _ => Status::internal(message),
    }
}

/// The services' shared state.
#[derive(Clone)]
struct Services {
    state: Arc<AppState>,
}

/// Checks `authorization` metadata against the server's keys (none: open).
fn authorize(
    keys: Arc<Vec<String>>,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |request: Request<()>| {
        if keys.is_empty() {
            return Ok(request);
        }
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        match check_bearer(&keys, header) {
            Some(Ok(())) => Ok(request),
            None => Err(Status::unauthenticated(
                "missing API key: send `authorization: Bearer <key>` metadata (this server was \
                 started with --api-key)",
            )),
            Some(Err(err)) => Err(status(&err)),
        }
    }
}

/// Serves gRPC on `listener` until the server begins shutting down; in-flight calls then get
/// the same grace as HTTP ones.
pub(crate) async fn serve(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
) -> Result<(), ServerError> {
    let keys = Arc::new(state.config.api_keys.clone());
    let limit = state.config.body_limit;
    let services = Services {
        state: state.clone(),
    };
    let inference = GrpcInferenceServiceServer::new(services.clone())
        .max_decoding_message_size(limit)
        .max_encoding_message_size(usize::MAX);
    let generation = GenerationServer::new(services).max_decoding_message_size(limit);
    let stop = {
        let state = state.clone();
        async move {
            while !state.shutting_down.load(Ordering::SeqCst) {
                tokio::time::sleep(SHUTDOWN_POLL).await;
            }
        }
    };
    tonic::transport::Server::builder()
        .add_service(tonic::service::interceptor::InterceptedService::new(
            inference,
            authorize(keys.clone()),
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            generation,
            authorize(keys),
        ))
        .serve_with_incoming_shutdown(
            // TCP_NODELAY, as on the HTTP port: each streamed token leaves at once.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop,
        )
        .await
        .map_err(|e| ServerError::Grpc(e.to_string()))
}

impl Services {
    /// The model name to answer with; an empty request name means the served model.
    fn model_name(&self, requested: &str) -> Result<String, Status> {
        let (engine, _) = self.state.ready().map_err(|e| status(&e))?;
        let requested = Some(requested).filter(|n| !n.is_empty());
        routes::check_model(&self.state, &*engine, requested).map_err(|e| status(&e))
    }
}

/// The texts of `ModelInfer`'s one BYTES input, from `contents` or `raw_input_contents`.
fn infer_texts(request: &ModelInferRequest) -> Result<Vec<String>, Status> {
    let invalid = |m: String| Err(Status::invalid_argument(m));
    if let Some(name) = request.parameters.keys().next() {
        return invalid(format!("request parameter `{name}` is not supported"));
    }
    if let Some(out) = request.outputs.iter().find(|o| o.name != OUTPUT_NAME) {
        return invalid(format!(
            "unknown output `{}`: this model has one output, `{OUTPUT_NAME}`",
            out.name
        ));
    }
    let [input] = request.inputs.as_slice() else {
        return invalid(format!(
            "expected exactly one input (`{INPUT_NAME}`, BYTES), got {}",
            request.inputs.len()
        ));
    };
    if input.name != INPUT_NAME {
        return invalid(format!(
            "unknown input `{}`: this model takes `{INPUT_NAME}`",
            input.name
        ));
    }
    if input.datatype != "BYTES" {
        return invalid(format!(
            "input `{INPUT_NAME}` must be BYTES, not {:?}",
            input.datatype
        ));
    }
    if let Some(name) = input.parameters.keys().next() {
        return invalid(format!("input parameter `{name}` is not supported"));
    }
    let elements: Vec<Vec<u8>> = match (&input.contents, request.raw_input_contents.as_slice()) {
        (Some(c), []) => c.bytes_contents.clone(),
        (None, [raw]) => split_raw_bytes(raw)?,
        (None, []) => return invalid(format!("input `{INPUT_NAME}` has no data")),
        _ => {
            return invalid(
                "give the input's data either in `contents` or in `raw_input_contents`, once"
                    .into(),
            );
        }
    };
    let count: i64 = input.shape.iter().product();
    let shape_ok = matches!(input.shape.as_slice(), [_] | [_, 1]);
    if !shape_ok || count != elements.len() as i64 {
        return invalid(format!(
            "input `{INPUT_NAME}` has shape {:?} but {} elements (expected [N] or [N, 1])",
            input.shape,
            elements.len()
        ));
    }
    elements
        .into_iter()
        .enumerate()
        .map(|(i, bytes)| {
            String::from_utf8(bytes).map_err(|_| {
                Status::invalid_argument(format!("element {i} of `{INPUT_NAME}` is not UTF-8"))
            })
        })
        .collect()
}

/// KServe's raw BYTES encoding: each element is a u32 little-endian length, then its bytes.
fn split_raw_bytes(mut raw: &[u8]) -> Result<Vec<Vec<u8>>, Status> {
    let mut elements = Vec::new();
    while !raw.is_empty() {
        let truncated = || Status::invalid_argument("raw_input_contents is truncated");
        let len_bytes: [u8; 4] = raw
            .get(..4)
            .ok_or_else(truncated)?
            .try_into()
            .expect("4 bytes");
        let len = u32::from_le_bytes(len_bytes) as usize;
        let element = raw.get(4..4 + len).ok_or_else(truncated)?;
        elements.push(element.to_vec());
        raw = &raw[4 + len..];
    }
    Ok(elements)
}

#[tonic::async_trait]
impl GrpcInferenceService for Services {
    async fn server_live(
        &self,
        _: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        let ready = self.state.ready().is_ok();
        Ok(Response::new(ServerReadyResponse { ready }))
    }

    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let ready = self.model_name(&request.get_ref().name).is_ok();
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: "gdsllm".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: Vec::new(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let name = self.model_name(&request.get_ref().name)?;
        Ok(Response::new(ModelMetadataResponse {
            name,
            versions: Vec::new(),
            platform: "gdsllm".into(),
            inputs: vec![TensorMetadata {
                name: INPUT_NAME.into(),
                datatype: "BYTES".into(),
                shape: vec![-1],
            }],
            outputs: vec![TensorMetadata {
                name: OUTPUT_NAME.into(),
                datatype: "FP32".into(),
                shape: vec![-1, -1],
            }],
        }))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let request = request.into_inner();
        let model_name = self.model_name(&request.model_name)?;
        let texts = infer_texts(&request)?;
        let (engine, scheduler) = self.state.ready().map_err(|e| status(&e))?;
        let inputs = texts.into_iter().map(PromptInput::Text).collect();
        let inputs = routes::embedding_tokens(&*engine, inputs).map_err(|e| status(&e))?;
        let vectors = scheduler.embed(inputs).await.map_err(|e| status(&e))?;
        let dim = vectors.first().map_or(0, Vec::len);
        let output = InferOutputTensor {
            name: OUTPUT_NAME.into(),
            datatype: "FP32".into(),
            shape: vec![vectors.len() as i64, dim as i64],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                fp32_contents: vectors.concat(),
                ..Default::default()
            }),
        };
        Ok(Response::new(ModelInferResponse {
            model_name,
            model_version: request.model_version,
            id: request.id,
            parameters: Default::default(),
            outputs: vec![output],
            raw_output_contents: Vec::new(),
        }))
    }
}

/// A `GenerateRequest` as the JSON body REST would take for it, so it is checked by the same
/// code with the same messages.
fn generate_body(request: &GenerateRequest) -> Result<(Value, bool), Status> {
    let chat = !request.messages.is_empty();
    if chat && !request.prompt.is_empty() {
        return Err(Status::invalid_argument(
            "set either `prompt` or `messages`, not both",
        ));
    }
    let mut body = json!({});
    if !request.model.is_empty() {
        body["model"] = json!(request.model);
    }
    if chat {
        let messages: Vec<Value> = request
            .messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect();
        body["messages"] = json!(messages);
    } else {
        body["prompt"] = json!(request.prompt);
    }
    if let Some(n) = request.max_tokens {
        body["max_tokens"] = json!(n);
    }
    if let Some(t) = request.temperature {
        body["temperature"] = json!(t);
    }
    if let Some(p) = request.top_p {
        body["top_p"] = json!(p);
    }
    if let Some(k) = request.top_k {
        body["top_k"] = json!(k);
    }
    if let Some(seed) = request.seed {
        body["seed"] = json!(seed);
    }
    if !request.stop.is_empty() {
        body["stop"] = json!(request.stop);
    }
    Ok((body, chat))
}

/// `grpc-timeout` metadata: an integer and a unit (H, M, S, m, u, n).
fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// One `Generate` call's stream. It owns the sequence's handle: dropping it (the client
/// cancelled or went away) cancels the sequence.
struct GenerateStream {
    handle: SequenceHandle,
    model: String,
    prompt_tokens: usize,
    index: u32,
    /// Text released at the end (held back for a possible stop string).
    held: String,
    deadline: Option<tokio::time::Instant>,
    finished: bool,
}

impl GenerateStream {
    async fn next_message(&mut self) -> Option<Result<GenerateResponse, Status>> {
        if self.finished {
            return None;
        }
        loop {
            let event = match self.deadline {
                Some(at) => match tokio::time::timeout_at(at, self.handle.events.recv()).await {
                    Ok(event) => event,
                    Err(_) => {
                        self.finished = true;
                        return Some(Err(Status::deadline_exceeded(
                            "the call's deadline passed; the sequence was cancelled",
                        )));
                    }
                },
                None => self.handle.events.recv().await,
            };
            let message = match event {
                Some(Event::Delta {
                    text,
                    token: Some(token),
                }) => {
                    let index = self.index;
                    self.index += 1;
                    generate_response::Event::Token(gdsllm_v1::Token {
                        index,
                        id: token.id,
                        text,
                    })
                }
                Some(Event::Delta { text, token: None }) => {
                    self.held.push_str(&text);
                    continue;
                }
                Some(Event::Done {
                    finish,
                    completion_tokens,
                }) => {
                    self.finished = true;
                    let (p, c) = (self.prompt_tokens as u32, completion_tokens as u32);
                    generate_response::Event::Done(gdsllm_v1::Done {
                        finish_reason: finish.as_openai().into(),
                        usage: Some(gdsllm_v1::Usage {
                            prompt_tokens: p,
                            completion_tokens: c,
                            total_tokens: p + c,
                        }),
                        model: self.model.clone(),
                        text: std::mem::take(&mut self.held),
                    })
                }
                Some(Event::Failed(err)) => {
                    self.finished = true;
                    return Some(Err(status(&err)));
                }
                None => {
                    self.finished = true;
                    return Some(Err(Status::internal(
                        "the model worker stopped before the sequence ended",
                    )));
                }
            };
            return Some(Ok(GenerateResponse {
                event: Some(message),
            }));
        }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Generation for Services {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<ResponseStream>, Status> {
        let deadline = grpc_timeout(request.metadata()).map(|d| tokio::time::Instant::now() + d);
        let (body, chat) = generate_body(request.get_ref())?;
        let (handle, model, prompt_tokens) =
            crate::ws::queue_generation(&self.state, &body, chat).map_err(|e| status(&e))?;
        let stream = GenerateStream {
            handle,
            model,
            prompt_tokens,
            index: 0,
            held: String::new(),
            deadline,
            finished: false,
        };
        let stream = futures::stream::unfold(stream, |mut s| async move {
            let message = s.next_message().await?;
            Some((message, s))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_bytes_elements_split_and_truncation_is_refused() {
        let mut raw = Vec::new();
        for s in ["ab", "", "xyz"] {
            raw.extend((s.len() as u32).to_le_bytes());
            raw.extend(s.as_bytes());
        }
        assert_eq!(
            split_raw_bytes(&raw).unwrap(),
            vec![b"ab".to_vec(), vec![], b"xyz".to_vec()]
        );
        let err = split_raw_bytes(&raw[..raw.len() - 1]).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn grpc_timeouts_parse() {
        let mut m = tonic::metadata::MetadataMap::new();
        assert_eq!(grpc_timeout(&m), None);
        for (text, want) in [
            ("250m", Duration::from_millis(250)),
            ("3S", Duration::from_secs(3)),
            ("2M", Duration::from_secs(120)),
            ("7u", Duration::from_micros(7)),
        ] {
            m.insert("grpc-timeout", text.parse().unwrap());
            assert_eq!(grpc_timeout(&m), Some(want), "{text}");
        }
        m.insert("grpc-timeout", "12x".parse().unwrap());
        assert_eq!(grpc_timeout(&m), None);
    }

    #[test]
    fn infer_inputs_are_checked_by_name_type_and_shape() {
        let input = |name: &str, datatype: &str, shape: Vec<i64>, n: usize| ModelInferRequest {
            inputs: vec![model_infer_request::InferInputTensor {
                name: name.into(),
                datatype: datatype.into(),
                shape,
                parameters: Default::default(),
                contents: Some(InferTensorContents {
                    bytes_contents: vec![b"hi".to_vec(); n],
                    ..Default::default()
                }),
            }],
            ..Default::default()
        };
        assert_eq!(
            infer_texts(&input("text", "BYTES", vec![2], 2)).unwrap(),
            ["hi", "hi"]
        );
        assert_eq!(
            infer_texts(&input("text", "BYTES", vec![2, 1], 2))
                .unwrap()
                .len(),
            2
        );
        for (bad, needle) in [
            (input("txt", "BYTES", vec![1], 1), "txt"),
            (input("text", "FP32", vec![1], 1), "FP32"),
            (input("text", "BYTES", vec![3], 2), "shape"),
            (input("text", "BYTES", vec![1, 2], 2), "shape"),
        ] {
            let err = infer_texts(&bad).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
            assert!(err.message().contains(needle), "{}", err.message());
        }
    }

    #[test]
    fn generate_requests_become_rest_bodies() {
        let request = GenerateRequest {
            prompt: "hi".into(),
            max_tokens: Some(4),
            temperature: Some(0.0),
            stop: vec!["\n".into()],
            ..Default::default()
        };
        let (body, chat) = generate_body(&request).unwrap();
        assert!(!chat);
        assert_eq!(
            body,
            json!({"prompt": "hi", "max_tokens": 4, "temperature": 0.0, "stop": ["\n"]})
        );
        let both = GenerateRequest {
            prompt: "hi".into(),
            messages: vec![gdsllm_v1::ChatMessage {
                role: "user".into(),
                content: "x".into(),
            }],
            ..Default::default()
        };
        assert_eq!(
            generate_body(&both).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        let err = status(&ApiError::invalid_param("max_tokens", "must be positive"));
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("max_tokens"), "{}", err.message());
        assert_eq!(
            status(&ApiError::busy("full")).code(),
            tonic::Code::ResourceExhausted
        );
    }
}
