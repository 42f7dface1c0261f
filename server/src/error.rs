//! Every failure as OpenAI's error object (`{"error": {"message", "type", "param",
//! "code"}}`) with the status a client library maps to its own exception: 400 a bad request,
//! 401 a missing or wrong key, 404 an unknown model, 413 a prompt longer than the model reads,
//! 429 a full queue, 500 the engine failed. The message is the engine's, which says what to do.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use folio_models::error::Error;

/// Seconds a client is asked to wait after a 429 (`Retry-After`).
const RETRY_AFTER_S: &str = "1";

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`.
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>, kind: &'static str) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None }
    }

    /// 400: the request cannot be answered as written; `param` names the argument ("" for none).
    pub fn bad(message: impl Into<String>, param: &'static str) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, message, "invalid_request_error");
        e.param = Some(param).filter(|p| !p.is_empty());
        e
    }

    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "a missing or wrong API key: send the key `folio serve --api-key` was given, as \"Authorization: Bearer KEY\"",
            "invalid_request_error",
        );
        e.code = Some("invalid_api_key");
        e
    }

    pub fn no_model(model: &str, known: &[String]) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            format!("the model \"{model}\" does not exist here; this server has: {}", known.join(", ")),
            "invalid_request_error",
        );
        (e.param, e.code) = (Some("model"), Some("model_not_found"));
        e
    }

    pub fn no_endpoint() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "no such endpoint: Folio serves GET /v1/models, POST /v1/chat/completions and POST /v1/completions",
            "invalid_request_error",
        )
    }

    pub fn busy(queue: usize) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("the server is busy: one request runs and {queue} wait, the most it queues; retry shortly"),
            "requests",
        );
        e.code = Some("rate_limit_exceeded");
        e
    }

    /// 500: something on this machine failed (the library could not be read).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message, "server_error")
    }

    /// The server stopped while the request waited or ran.
    pub fn gone() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down", "server_error")
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let message = e.to_string();
        match e {
            Error::PromptTooLong { .. } => {
                let mut a = Self::new(StatusCode::PAYLOAD_TOO_LARGE, message, "invalid_request_error");
                (a.param, a.code) = (Some("messages"), Some("context_length_exceeded"));
                a
            }
            Error::Invalid(_)
            | Error::Template(_)
            | Error::NoChatTemplate
            | Error::WrongModel { .. }
            | Error::OtherWeights { .. } => Self::new(StatusCode::BAD_REQUEST, message, "invalid_request_error"),
            _ => Self::new(StatusCode::INTERNAL_SERVER_ERROR, message, "server_error"),
        }
    }
}

impl ApiError {
    /// The error object, as a response body or a stream's last event.
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static(RETRY_AFTER_S));
        }
        response
    }
}
