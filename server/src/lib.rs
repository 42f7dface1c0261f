//! Folio's local HTTP API, shaped as OpenAI's: what editors, scripts and other apps use to
//! talk to a local model (LM Studio, Jan, Ollama and llama-server serve the same shape), with
//! one thing none of them has — every saved context of the library is a model of its own
//! (`context:NAME`), so a million tokens read once are asked about with no prefill.
//!
//! * [`openai`]: the wire types — requests parsed strictly (an argument Folio does not honour
//!   is refused by name, never ignored), responses and stream chunks as OpenAI writes them;
//! * [`worker`]: the device runs one request at a time; requests wait in a bounded queue
//!   (429 when it is full), a request whose client has gone is dropped before it starts and
//!   stopped between tokens when it is running;
//! * [`routes`]: `/v1/models`, `/v1/chat/completions` (streamed as server-sent events or
//!   not), `/v1/completions`, the API key and CORS;
//! * [`error`]: every failure as OpenAI's error object with the status a client expects (400,
//!   401, 404, 413, 429, 500) and the engine's message, which says what to do.
//!
//! Rules of this crate: it is a product layer over the engine's API (`folio_models::session`,
//! as the CLI's chat and the window are) and the library (which contexts exist, their default
//! method); it holds no decode logic and never prints — each request ends in a `tracing`
//! event (the model, the tokens, the times; never the text), which the caller's log writes.
//! It binds 127.0.0.1 unless told otherwise: a local model's server is for this machine.

pub mod error;
pub mod openai;
pub mod routes;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use folio_library::Library;
use folio_models::attention::Tier;
use folio_models::Engine;

pub use error::ApiError;

/// Requests that may wait for the device beside the one it runs (`--queue`).
pub const DEFAULT_QUEUE: usize = 8;
/// The port `folio serve` listens on when not told (`--port`).
pub const DEFAULT_PORT: u16 = 8642;
/// The largest request body read: a prompt of a million tokens is a few MiB of text.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// What a server is started with.
pub struct ServerConfig {
    pub addr: SocketAddr,
    /// Requests must carry `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Origins a browser page may call the API from (CORS); none by default.
    pub cors_origins: Vec<String>,
    /// Requests waiting beside the running one before new ones get 429.
    pub queue: usize,
    /// The tier saved contexts are opened on (offloaded: the K/V stays in host memory).
    pub tier: Tier,
    /// Test hook: each answer token waits this long before it is sent (FOLIO_TEST_HOOKS).
    pub token_delay: Duration,
}

/// What the handlers share: the engine, the library and the queue to the worker.
#[derive(Clone)]
pub struct AppState {
    engine: Arc<Engine>,
    library: Option<Library>,
    queue: worker::Queue,
    api_key: Option<Arc<str>>,
    /// Listening on a loopback address: only this machine's host names are answered.
    loopback: bool,
}

/// Serves `engine` (and the contexts of `library`, when there is one) on `config.addr` until
/// `shutdown` completes; `on_listening` gets the bound address (port 0 picks a free one).
pub async fn serve(
    config: ServerConfig,
    engine: Arc<Engine>,
    library: Option<Library>,
    on_listening: impl FnOnce(SocketAddr),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.addr).await?;
    on_listening(listener.local_addr()?);
    let stopping = Arc::new(AtomicBool::new(false));
    let queue = worker::start(engine.clone(), config.queue, config.tier, config.token_delay, stopping.clone());
    let loopback = config.addr.ip().is_loopback();
    let state = AppState { engine, library, queue, api_key: config.api_key.map(Into::into), loopback };
    let app = routes::router(state, &config.cors_origins);
    // Once asked to stop, the running answer ends at its next token and the waiting ones are
    // refused, so that the connections the graceful shutdown waits for close soon.
    let shutdown = async move {
        shutdown.await;
        stopping.store(true, Ordering::SeqCst);
    };
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
