//! `folio serve`: the local OpenAI-compatible API (folio-server) over the loaded model and the
//! library's saved contexts, until Ctrl-C. What it prints: one line on stdout once it listens
//! (the address), and a line per request on stderr and in the log (crate::logging; no document
//! or question text).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use folio_library::Library;
use folio_models::attention::Tier;
use folio_server::{ServerConfig, DEFAULT_PORT, DEFAULT_QUEUE};

use crate::cli::Common;

/// The key's environment variable (beside `--api-key`, which other users of the machine can
/// read in the process list).
const API_KEY_ENV: &str = "FOLIO_API_KEY";
/// Test hook (honoured only with FOLIO_TEST_HOOKS=1): each answer token waits this many ms.
const TOKEN_DELAY_ENV: &str = "FOLIO_TEST_TOKEN_DELAY_MS";

#[derive(Args)]
pub struct ServeArgs {
    /// The address to listen on. 127.0.0.1 (the default) is this machine only; another
    /// address lets other machines in — give them an --api-key.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    host: IpAddr,
    /// The port (0: any free one, printed when listening).
    #[arg(long, default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Requests must send "Authorization: Bearer KEY" (or set FOLIO_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// An origin whose web pages may call the API (CORS), e.g. http://localhost:3000; repeat
    /// for more. None by default: pages of other sites cannot read the answers.
    #[arg(long = "cors-origin")]
    cors_origins: Vec<String>,
    /// Requests that may wait while one runs; more get 429 (busy) at once.
    #[arg(long, default_value_t = DEFAULT_QUEUE)]
    queue: usize,
    /// Open saved contexts on the offloaded tier (the K/V stays in host memory; each step
    /// moves the rows the method picks), as `folio chat --offload`.
    #[arg(long)]
    offload: bool,
    /// Serve the model alone, without the library's contexts.
    #[arg(long)]
    no_library: bool,
}

/// The model `folio serve` loads: `--model`, else FOLIO_MODEL, else the bundled demo model.
fn model_spec(common: &Common, demo: Option<String>) -> Result<String> {
    if let Some(m) = common.model.clone().or_else(|| std::env::var("FOLIO_MODEL").ok().filter(|m| !m.is_empty())) {
        return Ok(m);
    }
    demo.context("--model is required: a model folder or a Hugging Face repo id (the bundled demo model is not here)")
}

pub fn serve(common: &Common, a: ServeArgs, demo: Option<String>) -> Result<()> {
    anyhow::ensure!(a.queue >= 1, "--queue must be at least 1");
    let api_key = a.api_key.or_else(|| std::env::var(API_KEY_ENV).ok()).filter(|k| !k.is_empty());
    if !a.host.is_loopback() && api_key.is_none() {
        eprintln!("warning: listening on {} lets other machines ask this model with no key: give --api-key", a.host);
    }
    let engine = Arc::new(common.load(&model_spec(common, demo)?)?);
    let token_delay = match std::env::var("FOLIO_TEST_HOOKS").as_deref() {
        Ok("1") => std::env::var(TOKEN_DELAY_ENV).ok().and_then(|v| v.parse().ok()).map(Duration::from_millis),
        _ => None,
    };
    let config = ServerConfig {
        addr: SocketAddr::new(a.host, a.port),
        api_key,
        cors_origins: a.cors_origins,
        queue: a.queue,
        tier: if a.offload { Tier::Offloaded } else { Tier::Resident },
        token_delay: token_delay.unwrap_or_default(),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the server's runtime")?;
    runtime.block_on(async move {
        let library = match a.no_library {
            true => None,
            false => Some(Library::open_default().await.context("opening the library (or pass --no-library)")?),
        };
        let name = engine.name.clone();
        let listening = move |addr: SocketAddr| {
            println!("Folio serves {name} at http://{addr}/v1 (OpenAI-compatible; Ctrl-C stops)");
        };
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        folio_server::serve(config, engine, library, listening, shutdown)
            .await
            .with_context(|| format!("serving on {}:{}", a.host, a.port))
    })
}
