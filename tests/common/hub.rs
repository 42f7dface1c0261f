//! A Hugging Face hub on loopback, for the download tests: a folder served as the repo
//! `folio-test/NAME` at one commit, shaped as the hub answers (the revision's file list with
//! sizes; `resolve` URLs whose HEAD gives the etag, the commit and, for weights, a redirect to a
//! CDN-like `/blobs/ETAG` that honours Range requests). It can drop the connection once in the
//! middle of a weights file, or send weights slowly (for a download killed midway), and it
//! counts the Range requests it was sent (a resumed download).
#![allow(dead_code)] // each test file uses its own share of these

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;

pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

struct Repo {
    name: String,
    /// File name → (etag, bytes).
    files: BTreeMap<String, (String, Bytes)>,
    faults: Faults,
    dropped: AtomicBool,
    ranges: AtomicUsize,
}

/// What goes wrong on purpose.
#[derive(Default, Clone, Copy)]
pub struct Faults {
    /// Drop the connection after this many bytes of the first GET of a weights file.
    pub drop_once: Option<usize>,
    /// Send weights in small pieces with this pause between them (20 ms: about 1.5 s for the
    /// tiny Llama's).
    pub slow: Option<std::time::Duration>,
}

/// Bytes of each piece of a slow weights body.
const SLOW_PIECE: usize = 8 << 10;

/// The server, stopped when dropped (its runtime goes with it).
pub struct Hub {
    pub endpoint: String,
    repo: Arc<Repo>,
    _runtime: tokio::runtime::Runtime,
}

impl Hub {
    /// Serves the files of `dir` as `folio-test/NAME`, with `faults`.
    pub fn start(dir: &Path, name: &str, faults: Faults) -> Hub {
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            // Any content hash will do as an etag here (the hub's are git's and LFS's sha).
            let etag = format!("{:016x}{:016x}", fnv(&bytes), bytes.len());
            files.insert(path.file_name().unwrap().to_str().unwrap().to_owned(), (etag, Bytes::from(bytes)));
        }
        let repo = Arc::new(Repo {
            name: format!("folio-test/{name}"),
            files,
            faults,
            dropped: AtomicBool::new(false),
            ranges: AtomicUsize::new(0),
        });
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new()
            .route("/api/models/{owner}/{name}/revision/{rev}", get(info))
            .route("/{owner}/{name}/resolve/{rev}/{*file}", get(resolve).head(resolve))
            .route("/blobs/{etag}", get(blob))
            .with_state(repo.clone());
        runtime.spawn(async move { axum::serve(listener, app).await.unwrap() });
        Hub { endpoint, repo, _runtime: runtime }
    }

    /// Range requests received (a resumed file sends one).
    pub fn ranges(&self) -> usize {
        self.repo.ranges.load(Ordering::SeqCst)
    }

    pub fn dropped(&self) -> bool {
        self.repo.dropped.load(Ordering::SeqCst)
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

async fn info(
    State(repo): State<Arc<Repo>>,
    UrlPath((owner, name, _rev)): UrlPath<(String, String, String)>,
) -> Response {
    if format!("{owner}/{name}") != repo.name {
        return (StatusCode::NOT_FOUND, "{\"error\":\"Repository not found\"}").into_response();
    }
    let siblings: Vec<_> = repo
        .files
        .iter()
        .map(|(f, (etag, b))| match f.ends_with(".safetensors") {
            true => json!({ "rfilename": f, "size": b.len(), "lfs": { "sha256": etag, "size": b.len() } }),
            false => json!({ "rfilename": f, "size": b.len() }),
        })
        .collect();
    axum::Json(json!({ "id": repo.name, "sha": COMMIT, "siblings": siblings })).into_response()
}

async fn resolve(
    State(repo): State<Arc<Repo>>,
    method: Method,
    UrlPath((owner, name, _rev, file)): UrlPath<(String, String, String, String)>,
) -> Response {
    let Some((etag, bytes)) = repo.files.get(&file).filter(|_| format!("{owner}/{name}") == repo.name) else {
        return (StatusCode::NOT_FOUND, "Entry not found").into_response();
    };
    let mut headers = HeaderMap::new();
    headers.insert("x-repo-commit", COMMIT.parse().unwrap());
    if file.ends_with(".safetensors") {
        // Large files live elsewhere: the hub redirects, naming the blob in x-linked-etag.
        headers.insert("x-linked-etag", format!("\"{etag}\"").parse().unwrap());
        headers.insert("x-linked-size", bytes.len().into());
        headers.insert(header::LOCATION, format!("/blobs/{etag}").parse().unwrap());
        return (StatusCode::FOUND, headers).into_response();
    }
    headers.insert(header::ETAG, format!("\"{etag}\"").parse().unwrap());
    headers.insert(header::CONTENT_LENGTH, bytes.len().into());
    match method {
        Method::HEAD => (StatusCode::OK, headers).into_response(),
        _ => (StatusCode::OK, headers, bytes.clone()).into_response(),
    }
}

async fn blob(State(repo): State<Arc<Repo>>, UrlPath(etag): UrlPath<String>, headers: HeaderMap) -> Response {
    let Some((_, bytes)) = repo.files.values().find(|(e, _)| *e == etag) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let from = headers
        .get(header::RANGE)
        .and_then(|r| r.to_str().ok()?.strip_prefix("bytes=")?.strip_suffix('-')?.parse::<usize>().ok());
    if from.is_some() {
        repo.ranges.fetch_add(1, Ordering::SeqCst);
    }
    if let Some(pause) = repo.faults.slow {
        let (status, sent) = match from {
            Some(at) => (StatusCode::PARTIAL_CONTENT, bytes.slice(at..)),
            None => (StatusCode::OK, bytes.clone()),
        };
        return (status, [(header::CONTENT_LENGTH, sent.len().to_string())], slow_body(sent, pause)).into_response();
    }
    if let Some(from) = from {
        let range = format!("bytes {from}-{}/{}", bytes.len() - 1, bytes.len());
        return (StatusCode::PARTIAL_CONTENT, [(header::CONTENT_RANGE, range)], bytes.slice(from..)).into_response();
    }
    match repo.faults.drop_once {
        Some(at) if !repo.dropped.swap(true, Ordering::SeqCst) => {
            // Half a file, then the connection breaks (a body that fails mid-stream).
            let head = bytes.slice(..at.min(bytes.len()));
            (StatusCode::OK, [(header::CONTENT_LENGTH, bytes.len().to_string())], broken_body(head)).into_response()
        }
        _ => (StatusCode::OK, bytes.clone()).into_response(),
    }
}

/// A body of `head`, then (once it has gone out) an error: hyper closes the connection
/// mid-body, as a dropped line does.
fn broken_body(head: Bytes) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    std::thread::spawn(move || {
        let _ = tx.blocking_send(Ok(head));
        std::thread::sleep(std::time::Duration::from_millis(200));
        let _ = tx.blocking_send(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "dropped on purpose")));
    });
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// `bytes` in small pieces with pauses between them, from a thread of its own.
fn slow_body(bytes: Bytes, pause: std::time::Duration) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    std::thread::spawn(move || {
        for at in (0..bytes.len()).step_by(SLOW_PIECE) {
            std::thread::sleep(pause);
            if tx.blocking_send(Ok(bytes.slice(at..(at + SLOW_PIECE).min(bytes.len())))).is_err() {
                return;
            }
        }
    });
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}
