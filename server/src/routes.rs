//! The HTTP side: OpenAI's endpoints over the worker's queue. A model id is the loaded model's
//! name (or the spec it was loaded from), or `context:NAME` for a ready context of the library
//! made by this model; the method is the request's `folio.method`, else the context's default
//! (the window's "New chats over this context start with"), else dense.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::ReceiverStream;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ApiError;
use crate::openai::{self, ChatRequest, CompletionRequest, Sampling};
use crate::worker::{Event, Finished, Work};
use crate::{AppState, MAX_BODY_BYTES};
use folio_library::{context_method_key, ContextInfo, Status};
use folio_models::attention::MethodChoice;
use folio_models::session::GenerationSettings;

/// The names a Host header may give when the server listens on loopback.
const LOOPBACK_NAMES: [&str; 3] = ["127.0.0.1", "localhost", "[::1]"];
/// The prefix of a saved context's model id.
const CONTEXT_PREFIX: &str = "context:";
/// Tokens of a completion when the request does not say (OpenAI's default).
const COMPLETION_MAX_TOKENS: usize = 16;
/// Events a stream holds for a slow client before the answer waits for it.
const STREAM_BUFFER: usize = 64;
/// A comment sent on a quiet stream, so that proxies and clients keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

pub fn router(state: AppState, cors_origins: &[String]) -> Router {
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(|| async { ApiError::no_endpoint() })
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state);
    if cors_origins.is_empty() {
        return app;
    }
    let origins: Vec<HeaderValue> = cors_origins.iter().filter_map(|o| o.parse().ok()).collect();
    app.layer(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    )
}

/// Refuses what a web page could send behind the person's back: a Host that is not this
/// machine's when the server listens on loopback only (a DNS-rebinding page names its own),
/// and a POST body that is not JSON (a page may send `text/plain` across origins without asking
/// the browser); then a request without the server's key, when it has one.
async fn auth(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(refusal) = foreign(&state, &request) {
        return refusal.into_response();
    }
    if let Some(key) = &state.api_key {
        let given = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if given.and_then(|v| v.strip_prefix("Bearer ")) != Some(&**key) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// Why a request may come from a web page rather than a program of this machine, if so.
fn foreign(state: &AppState, request: &Request) -> Option<ApiError> {
    let value = |h: header::HeaderName| request.headers().get(h).and_then(|v| v.to_str().ok());
    if state.loopback {
        let host = value(header::HOST).unwrap_or("");
        let name =
            host.rsplit_once(':').map_or(host, |(name, port)| if port.parse::<u16>().is_ok() { name } else { host });
        if !LOOPBACK_NAMES.contains(&name) {
            return Some(ApiError::bad(format!("this server answers this machine only, not Host {host:?}"), ""));
        }
    }
    let json = value(header::CONTENT_TYPE).is_some_and(|t| t.trim_start().starts_with("application/json"));
    (request.method() == Method::POST && !json)
        .then(|| ApiError::bad("send the request as JSON (Content-Type: application/json)", ""))
}

/// Seconds since the epoch, as OpenAI's `created`.
fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A response id: unique within this server's run.
fn response_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!("{prefix}-{:x}{:04x}", now(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The library's ready contexts made by the loaded model.
async fn contexts(state: &AppState) -> Result<Vec<ContextInfo>, ApiError> {
    let Some(library) = &state.library else { return Ok(Vec::new()) };
    let all = library.contexts().await.map_err(|e| ApiError::internal(format!("reading the library: {e}")))?;
    let ours = state.engine.stamp()?.fingerprint.clone();
    let ours = serde_json::to_value(&ours).unwrap_or(Value::Null);
    Ok(all
        .into_iter()
        .filter(|c| c.status == Status::Ready)
        .filter(|c| serde_json::from_str::<Value>(&c.model.fingerprint).is_ok_and(|f| f == ours))
        .collect())
}

fn model_object(id: &str, extra: Value) -> Value {
    json!({ "id": id, "object": "model", "created": now(), "owned_by": "folio", "folio": extra })
}

/// Every model id this server answers to, with its facts.
async fn model_list(state: &AppState) -> Result<Vec<Value>, ApiError> {
    let cfg = state.engine.config();
    let mut list = vec![model_object(
        &state.engine.name,
        json!({ "kind": "model", "context_length": cfg.max_position_embeddings }),
    )];
    for c in contexts(state).await? {
        let extra = json!({ "kind": "context", "tokens": c.tokens, "documents": c.documents });
        list.push(model_object(&format!("{CONTEXT_PREFIX}{}", c.name), extra));
    }
    Ok(list)
}

async fn models(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({ "object": "list", "data": model_list(&state).await? })))
}

async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let list = model_list(&state).await?;
    match list.iter().find(|m| m["id"] == id.as_str()) {
        Some(m) => Ok(Json(m.clone())),
        None => Err(ApiError::no_model(&id, &ids(&list))),
    }
}

fn ids(list: &[Value]) -> Vec<String> {
    list.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect()
}

/// The context a model id names (`None` for the loaded model), and its library id.
async fn resolve(state: &AppState, model: &str) -> Result<Option<(PathBuf, i64)>, ApiError> {
    if model == state.engine.name || model == state.engine.source {
        return Ok(None);
    }
    if let Some(name) = model.strip_prefix(CONTEXT_PREFIX) {
        if let Some(c) = contexts(state).await?.into_iter().find(|c| c.name == name) {
            return Ok(Some((c.path, c.id)));
        }
    }
    Err(ApiError::no_model(model, &ids(&model_list(state).await?)))
}

/// The method a request asks for, else the context's default, else dense.
async fn method_for(state: &AppState, sampling: &Sampling, context: Option<i64>) -> Result<MethodChoice, ApiError> {
    if let Some(text) = sampling.folio.as_ref().and_then(|f| f.method.as_deref()) {
        return MethodChoice::parse(text).map_err(|e| ApiError::bad(format!("folio.method: {e}"), "folio"));
    }
    let (Some(library), Some(id)) = (&state.library, context) else { return Ok(MethodChoice::default()) };
    let saved = library.setting(&context_method_key(id)).await.ok().flatten();
    Ok(saved
        .and_then(|v| serde_json::from_value::<MethodChoice>(v).ok())
        .filter(|c| c.check().is_ok())
        .unwrap_or_default())
}

/// The engine's settings for a request's sampling arguments; `max_tokens` absent: `default`.
fn settings(
    state: &AppState,
    s: &mut Sampling,
    max_tokens: Option<u64>,
    default: usize,
) -> Result<GenerationSettings, ApiError> {
    let settings = GenerationSettings {
        max_tokens: max_tokens.map_or(default, |m| usize::try_from(m).unwrap_or(usize::MAX)),
        temperature: s.temperature,
        top_p: s.top_p,
        // No seed: another sample each time, as OpenAI's API gives.
        seed: s.seed.unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)),
        stop: s.stops()?,
        ..GenerationSettings::default()
    };
    settings.check(&state.engine).map_err(|e| ApiError::bad(e.to_string(), ""))?;
    Ok(settings)
}

async fn chat(State(state): State<AppState>, body: Bytes) -> Response {
    respond(chat_request(&state, &body).await)
}

async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    respond(completion_request(&state, &body).await)
}

fn respond(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_request(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let mut req: ChatRequest = openai::parse(body)?;
    req.sampling.check()?;
    let turns = req.turns()?;
    let context = resolve(state, &req.model).await?;
    let method = method_for(state, &req.sampling, context.as_ref().map(|c| c.1)).await?;
    let max_tokens = req.max_completion_tokens.or(req.sampling.max_tokens);
    // No limit asked for: up to the end of the model's context, as OpenAI's API answers.
    let settings = settings(state, &mut req.sampling, max_tokens, usize::MAX)?;
    let events = state.queue.submit(Work::Chat { context: context.map(|c| c.0), turns, method, settings })?;
    let shape = Shape { id: response_id("chatcmpl"), model: req.model, chat: true };
    answer(shape, &req.sampling, events).await
}

async fn completion_request(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let mut req: CompletionRequest = openai::parse(body)?;
    req.sampling.check()?;
    let prompt = req.prompt()?;
    if resolve(state, &req.model).await?.is_some() {
        return Err(ApiError::bad(
            "a saved context answers chat turns: use /v1/chat/completions with this model",
            "model",
        ));
    }
    if req.sampling.folio.as_ref().is_some_and(|f| f.method.is_some()) {
        return Err(ApiError::bad("folio.method: completions of the bare model attend densely", "folio"));
    }
    let max_tokens = req.sampling.max_tokens;
    let settings = settings(state, &mut req.sampling, max_tokens, COMPLETION_MAX_TOKENS)?;
    let events = state.queue.submit(Work::Complete { prompt, settings })?;
    let shape = Shape { id: response_id("cmpl"), model: req.model, chat: false };
    answer(shape, &req.sampling, events).await
}

/// How a response is written: chat completions or text completions.
struct Shape {
    id: String,
    model: String,
    chat: bool,
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    /// One choice: a chat message (or delta) or a completion's text.
    fn choice(&self, text: Option<&str>, finish: Option<&str>, chunk: bool) -> Value {
        match (self.chat, chunk) {
            (true, false) => {
                json!({ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": finish, "logprobs": null })
            }
            (true, true) => {
                let delta = text.map_or(json!({}), |t| json!({ "content": t }));
                json!({ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": null })
            }
            (false, _) => json!({ "index": 0, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": null }),
        }
    }

    fn body(&self, choices: Vec<Value>, chunk: bool) -> Value {
        json!({ "id": self.id, "object": self.object(chunk), "created": now(), "model": self.model, "choices": choices })
    }
}

/// What Folio adds to a response: the method's settings, over a context which prefill made
/// its tokens, and the answer's times.
fn provenance(f: &Finished) -> Value {
    json!({ "method": f.method, "prefill": f.prefill, "reused_tokens": f.reused_tokens,
            "first_token_s": f.first_token_s, "seconds": f.seconds, "queued_s": f.queued_s })
}

/// The answer as one JSON response, or as a stream of server-sent events. A stream starts
/// only once the first event is in, so that a request the engine refuses (a prompt too long)
/// gets its status rather than a 200 with an error inside.
async fn answer(shape: Shape, sampling: &Sampling, mut events: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let first = events.recv().await.ok_or_else(ApiError::gone)?;
    if let Event::Failed(e) = first {
        tracing::info!(request = shape.object(false), model = %shape.model, status = e.status.as_u16(), error = %e.message, "refused");
        return Err(e);
    }
    if sampling.stream {
        return Ok(stream(shape, sampling.include_usage(), first, events));
    }
    let mut text = String::new();
    let mut next = Some(first);
    loop {
        let event = match next.take() {
            Some(e) => e,
            None => events.recv().await.ok_or_else(ApiError::gone)?,
        };
        match event {
            Event::Text(t) => text.push_str(&t),
            Event::Failed(e) => return Err(e),
            Event::Done(f) => {
                log_done(&shape, &f);
                let choice = shape.choice(Some(&text), Some(openai::finish_reason(f.stop_reason)), false);
                let mut body = shape.body(vec![choice], false);
                body["usage"] = openai::usage(f.prompt_tokens, f.completion_tokens);
                body["folio"] = provenance(&f);
                return Ok((StatusCode::OK, Json(body)).into_response());
            }
        }
    }
}

fn log_done(shape: &Shape, f: &Finished) {
    tracing::info!(
        request = shape.object(false), model = %shape.model, prompt_tokens = f.prompt_tokens,
        held_tokens = f.reused_tokens, answer_tokens = f.completion_tokens, stop = ?f.stop_reason,
        seconds = f.seconds, first_token_s = f.first_token_s, queued_s = f.queued_s, "served"
    );
}

/// Server-sent events: a chunk per piece of text, the last with its finish reason, then the
/// usage when asked for, then `[DONE]`. A task forwards the worker's events; when the client
/// goes, the stream's end is dropped, the task's send fails, and the answer stops.
fn stream(shape: Shape, include_usage: bool, first: Event, mut events: UnboundedReceiver<Event>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Sse, Infallible>>(STREAM_BUFFER);
    tokio::spawn(async move {
        let data = |v: Value| Ok(Sse::default().data(v.to_string()));
        let opening = if shape.chat { json!({ "role": "assistant", "content": "" }) } else { json!({}) };
        if shape.chat {
            let choice = json!({ "index": 0, "delta": opening, "finish_reason": null, "logprobs": null });
            if tx.send(data(shape.body(vec![choice], true))).await.is_err() {
                return;
            }
        }
        let mut next = Some(first);
        loop {
            let event = match next.take() {
                Some(e) => e,
                // The worker stopped (the server is shutting down): the stream ends unfinished.
                None => match events.recv().await {
                    Some(e) => e,
                    None => return,
                },
            };
            let sent = match event {
                Event::Text(t) => tx.send(data(shape.body(vec![shape.choice(Some(&t), None, true)], true))).await,
                Event::Failed(e) => {
                    let _ = tx.send(data(e.body())).await;
                    return;
                }
                Event::Done(f) => {
                    log_done(&shape, &f);
                    let choice = shape.choice(None, Some(openai::finish_reason(f.stop_reason)), true);
                    let mut last = shape.body(vec![choice], true);
                    last["folio"] = provenance(&f);
                    let _ = tx.send(data(last)).await;
                    if include_usage {
                        let mut usage = shape.body(Vec::new(), true);
                        usage["usage"] = openai::usage(f.prompt_tokens, f.completion_tokens);
                        let _ = tx.send(data(usage)).await;
                    }
                    let _ = tx.send(Ok(Sse::default().data("[DONE]"))).await;
                    return;
                }
            };
            if sent.is_err() {
                // The client has gone: dropping `events` stops the answer.
                return;
            }
        }
    });
    axum::response::sse::Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}
