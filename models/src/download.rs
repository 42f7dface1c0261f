//! Downloading a model from the Hugging Face hub into the standard HF cache, file by file, with
//! progress, cancel and resume: what a person sees when a repo id is not cached yet.
//!
//! The layout is huggingface_hub's, so every tool that reads the cache (transformers, the
//! `huggingface-cli`, Folio's own loader) finds the files: `models--OWNER--NAME/blobs/ETAG`,
//! `snapshots/COMMIT/FILE` a relative link to its blob, `refs/REVISION` holding the commit. A
//! file is written to `blobs/ETAG.incomplete` and renamed when whole; an interrupted download
//! (a dropped connection, a cancel, a killed process) keeps what it had, and the next attempt
//! asks for the rest (an HTTP Range request) — a dropped connection is retried at once from
//! where it broke, a few times.
//!
//! Why not hf-hub's own download: it reports progress to a terminal bar only, cannot be
//! cancelled, and starts a file over after an interruption; a 15 GiB model on a home line
//! needs all three. hf-hub still gives the cache's path and reads it (`crate::loader`, which
//! also says which files a model needs: this module knows repos, not models).
//!
//! Before anything large moves, [`Plan`] says what the model is (its config, read first: a few
//! KiB) and what the download will take (each file's size, what the cache holds already, the
//! free space where it goes); a download that would not fit is refused before it starts.

use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{human_bytes, Error, Result};

/// The hub's address unless `HF_ENDPOINT` says otherwise.
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// A dropped connection is retried from where it broke this many times per file.
const RETRIES: usize = 5;
/// Bytes read from the network per write.
const PIECE: usize = 1 << 20;
/// How often progress is reported while a file arrives.
const REPORT_EVERY: Duration = Duration::from_millis(200);
/// How long connecting, and then the first answer to a request, may take (a body has no
/// limit: a large file takes what it takes, and a person can stop it).
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// A git commit hash in hex: what names a snapshot folder.
const COMMIT_HEX: usize = 40;
/// Room kept free on the cache's disk beyond the download.
const DISK_MARGIN: u64 = 256 << 20;

/// The files of a repo a download takes (the loader says which: `loader::MODEL_FILES`).
pub struct Wanted {
    /// Fetched first, before anything large: what a person decides on.
    pub config: &'static str,
    /// Without any of these the repo is refused before a byte of weights moves.
    pub required: &'static [&'static str],
    /// Taken when the repo has them.
    pub optional: &'static [&'static str],
    /// The weights: one file, or an index naming shards (read by `shards`).
    pub weights: &'static str,
    pub index: &'static str,
    pub shards: fn(&Path) -> Result<Vec<String>>,
}

/// One file of a download.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct PlannedFile {
    pub name: String,
    pub bytes: u64,
    /// Already whole in the cache.
    pub cached: bool,
    /// Bytes an interrupted download left (resumed, not fetched again).
    pub partial: u64,
}

/// What downloading a repo will take, known before its weights move.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Plan {
    pub repo: String,
    pub revision: String,
    /// The commit the revision names now.
    pub commit: String,
    pub files: Vec<PlannedFile>,
    /// Bytes still to fetch (the cached and partial bytes left out).
    pub to_fetch: u64,
    /// Free bytes on the cache's disk, when known.
    pub free: Option<u64>,
    /// The cache folder the files go to.
    pub cache: PathBuf,
    /// The model's config.json (fetched first: the facts a person decides on).
    #[serde(skip)]
    pub config: PathBuf,
}

/// How a download goes: what arrived, and what is left.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct DownloadProgress {
    pub repo: String,
    pub file: String,
    /// Bytes of the whole download so far (resumed bytes included), and its total.
    pub done: u64,
    pub total: u64,
    /// Bytes per second since this run started (resumed bytes left out).
    pub rate: f64,
    /// Seconds left at that rate.
    pub eta_s: Option<f64>,
}

/// The hub's address (`HF_ENDPOINT`, as huggingface_hub reads it).
fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
        .trim_end_matches('/')
        .to_owned()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(READ_TIMEOUT))
        .timeout_recv_response(Some(READ_TIMEOUT))
        .build()
        .into()
}

/// `Authorization` for gated and private repos: `HF_TOKEN`, else the cache's token file.
fn token() -> Option<String> {
    std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()).or_else(|| {
        let home = hf_hub::Cache::from_env().path().parent()?.to_owned();
        std::fs::read_to_string(home.join("token")).ok().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty())
    })
}

/// A GET of `url`, with the token only when it goes to the hub itself (a redirect's CDN gets a
/// signed URL, never the person's token).
fn get(agent: &ureq::Agent, url: &str) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
    let request = agent.get(url);
    match token().filter(|_| url.starts_with(&format!("{}/", endpoint()))) {
        Some(t) => request.header("Authorization", format!("Bearer {t}")),
        None => request,
    }
}

/// The repo's folder in the cache: `models--OWNER--NAME`.
fn repo_dir(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

impl Plan {
    /// Asks the hub what `repo` at `revision` holds, fetches its config, and says what a
    /// download of the `wanted` files would take.
    pub fn fetch(repo: &str, revision: &str, wanted: &Wanted) -> Result<Plan> {
        let fail = |msg: String| Error::Download { repo: repo.into(), file: "(file list)".into(), msg };
        let agent = agent();
        let url = format!("{}/api/models/{repo}/revision/{revision}?blobs=true", endpoint());
        let unreachable = |e: ureq::Error| fail(format!("the hub at {} cannot be reached ({e})", endpoint()));
        let mut r = get(&agent, &url).call().map_err(unreachable)?;
        match r.status().as_u16() {
            200 => {}
            401 | 403 => {
                return Err(fail("the repo is gated or private: accept its terms on the hub and set HF_TOKEN".into()))
            }
            404 => return Err(fail(format!("no model {repo} at revision {revision} on {}", endpoint()))),
            s => return Err(fail(format!("the hub answered {s}"))),
        }
        let info: serde_json::Value = r.body_mut().read_json().map_err(|e| fail(e.to_string()))?;
        let commit = info["sha"].as_str().ok_or_else(|| fail("the hub's answer has no commit".into()))?.to_owned();
        // The commit names a folder of the cache: a hub (or HF_ENDPOINT) answering anything but
        // a git hash could write elsewhere.
        if commit.len() != COMMIT_HEX || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(fail(format!("the hub's commit {commit:?} is not a git hash")));
        }
        let siblings = info["siblings"].as_array().cloned().unwrap_or_default();
        let size_of = |name: &str| -> Option<u64> {
            let s = siblings.iter().find(|s| s["rfilename"] == name)?;
            s["lfs"]["size"].as_u64().or(s["size"].as_u64())
        };
        let cache = hf_hub::Cache::from_env().path().clone();
        let mut plan = Plan {
            repo: repo.into(),
            revision: revision.into(),
            commit,
            files: Vec::new(),
            to_fetch: 0,
            free: None,
            cache: cache.clone(),
            config: PathBuf::new(),
        };
        if let Some(missing) = wanted.required.iter().find(|f| size_of(f).is_none()) {
            return Err(fail(format!("the repo has no {missing}: Folio loads transformers models in safetensors")));
        }
        let listed = wanted.required.iter().chain(wanted.optional).chain([&wanted.weights, &wanted.index]);
        let mut names: Vec<String> = listed.filter(|n| size_of(n).is_some()).map(|n| n.to_string()).collect();
        // The shards an index names, fetched with the small files first.
        let size = |name: &str| size_of(name).unwrap_or(0);
        plan.config =
            plan.fetch_file(&agent, wanted.config, size(wanted.config), &mut |_| ControlFlow::Continue(()))?;
        if names.iter().any(|n| n == wanted.index) {
            let index =
                plan.fetch_file(&agent, wanted.index, size(wanted.index), &mut |_| ControlFlow::Continue(()))?;
            names.retain(|n| n != wanted.weights);
            names.extend((wanted.shards)(&index)?);
        }
        // A name is a path inside the snapshot: an index naming `../x` would write elsewhere.
        if let Some(bad) = names.iter().find(|n| !inside(n)) {
            return Err(fail(format!("the index names a file outside the repo: {bad}")));
        }
        if !names.iter().any(|n| *n == wanted.weights || *n != wanted.index && n.ends_with(".safetensors")) {
            return Err(fail(format!(
                "the repo has no safetensors weights (Folio loads {} or {} with its shards)",
                wanted.weights, wanted.index
            )));
        }
        for name in names {
            let bytes = size_of(&name).ok_or_else(|| fail(format!("the index names {name}, which the repo lacks")))?;
            let cached = plan.snapshot_file(&name).exists();
            let partial = if cached { 0 } else { plan.partial_bytes(&name).unwrap_or(0) };
            plan.files.push(PlannedFile { name, bytes, cached, partial });
        }
        plan.to_fetch = plan.files.iter().filter(|f| !f.cached).map(|f| f.bytes.saturating_sub(f.partial)).sum();
        let dir = repo_dir(&cache, repo);
        plan.free = fs4::available_space(if dir.exists() { &dir } else { &cache }).ok();
        Ok(plan)
    }

    fn snapshot_file(&self, name: &str) -> PathBuf {
        repo_dir(&self.cache, &self.repo).join("snapshots").join(&self.commit).join(name)
    }

    /// Bytes of `name` an interrupted download left in its blob's `.incomplete` file.
    fn partial_bytes(&self, name: &str) -> Option<u64> {
        let (etag, _) = self.head(name).ok()?;
        let path = repo_dir(&self.cache, &self.repo).join("blobs").join(format!("{etag}.incomplete"));
        std::fs::metadata(path).ok().map(|m| m.len())
    }

    fn resolve_url(&self, name: &str) -> String {
        format!("{}/{}/resolve/{}/{name}", endpoint(), self.repo, self.commit)
    }

    /// The file's etag (its blob's name) and its download URL, from the hub's answer to a HEAD
    /// request (redirects not followed: large files move to a CDN, named in `Location`).
    fn head(&self, name: &str) -> Result<(String, String)> {
        let fail = |msg: String| Error::Download { repo: self.repo.clone(), file: name.into(), msg };
        let url = self.resolve_url(name);
        let no_redirect: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_connect(Some(READ_TIMEOUT))
            .timeout_recv_response(Some(READ_TIMEOUT))
            .build()
            .into();
        let mut request = no_redirect.head(&url);
        if let Some(t) = token() {
            request = request.header("Authorization", format!("Bearer {t}"));
        }
        let r = request.call().map_err(|e| fail(e.to_string()))?;
        let header = |h: &str| r.headers().get(h).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let status = r.status().as_u16();
        if !(200..400).contains(&status) {
            return Err(fail(format!("the hub answered {status}")));
        }
        let etag = header("x-linked-etag").or_else(|| header("etag")).ok_or_else(|| fail("no etag".into()))?;
        let etag = etag.trim_start_matches("W/").trim_matches('"').to_owned();
        if etag.is_empty() || etag.contains(['/', '\\', '.']) {
            return Err(fail(format!("an etag that cannot name a file: {etag}")));
        }
        let location = match header("location") {
            Some(l) if l.starts_with("http") => l,
            Some(l) => format!("{}{l}", endpoint()),
            None => url,
        };
        Ok((etag, location))
    }

    /// Fetches `name` into the cache (resuming a partial blob), links it into the snapshot,
    /// records the revision's commit, and returns the snapshot's path.
    fn fetch_file(
        &self,
        agent: &ureq::Agent,
        name: &str,
        bytes: u64,
        on_piece: &mut dyn FnMut(u64) -> ControlFlow<()>,
    ) -> Result<PathBuf> {
        let snapshot = self.snapshot_file(name);
        if snapshot.exists() {
            return Ok(snapshot);
        }
        let fail = |msg: String| Error::Download { repo: self.repo.clone(), file: name.into(), msg };
        let (etag, url) = self.head(name)?;
        let dir = repo_dir(&self.cache, &self.repo);
        let blobs = dir.join("blobs");
        std::fs::create_dir_all(&blobs).map_err(|e| Error::io(&blobs, e))?;
        let blob = blobs.join(&etag);
        if !blob.exists() {
            let partial = blobs.join(format!("{etag}.incomplete"));
            let mut tries = 0;
            loop {
                match self.receive(agent, name, &url, &partial, on_piece) {
                    Ok(()) => break,
                    // A stop, or the disk (full, read-only): trying again would not help.
                    Err(e @ (Error::Cancelled(_) | Error::Io { .. } | Error::Download { .. })) => return Err(e),
                    Err(e) if tries < RETRIES => {
                        tries += 1;
                        tracing::info!(repo = %self.repo, file = name, %e, tries, "download interrupted; resuming");
                    }
                    Err(e) => {
                        return Err(fail(format!("{e} (after {RETRIES} resumed attempts; run it again to go on)")))
                    }
                }
            }
            // A blob is kept only whole: a file of another length (two downloads writing the
            // same partial file, a server that sent something else) is dropped, not trusted.
            let got = std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
            if got != bytes {
                let _ = std::fs::remove_file(&partial);
                return Err(fail(format!("{got} bytes arrived where the hub lists {bytes}; download it again")));
            }
            std::fs::rename(&partial, &blob).map_err(|e| Error::io(&blob, e))?;
        }
        let parent = snapshot.parent().expect("a snapshot file has a folder");
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        link(&blob, &snapshot, name)?;
        let refs = dir.join("refs");
        std::fs::create_dir_all(&refs).map_err(|e| Error::io(&refs, e))?;
        // hf-hub's reader (and huggingface_hub's) finds the snapshot through refs/REVISION.
        if inside(&self.revision) && !self.revision.contains('/') {
            let r = refs.join(&self.revision);
            std::fs::write(&r, &self.commit).map_err(|e| Error::io(&r, e))?;
        }
        Ok(snapshot)
    }

    /// Appends the rest of `url` to `partial` (a Range request from its length).
    fn receive(
        &self,
        agent: &ureq::Agent,
        name: &str,
        url: &str,
        partial: &Path,
        on_piece: &mut dyn FnMut(u64) -> ControlFlow<()>,
    ) -> Result<()> {
        let have = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
        let mut request = get(agent, url);
        if have > 0 {
            request = request.header("Range", format!("bytes={have}-"));
        }
        let r = request.call().map_err(|e| Error::Invalid(e.to_string()))?;
        let status = r.status().as_u16();
        let append = match status {
            206 => true,
            200 => false,
            416 => return Ok(()),
            s => return Err(Error::Invalid(format!("the hub answered {s}"))),
        };
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(partial)
            .map_err(|e| Error::io(partial, e))?;
        let mut body = r.into_body().into_reader();
        let mut buf = vec![0u8; PIECE];
        loop {
            let n = body.read(&mut buf).map_err(|e| Error::Invalid(format!("the connection broke: {e}")))?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n]).map_err(|e| self.write_error(name, partial, e))?;
            if on_piece(n as u64).is_break() {
                file.sync_all().map_err(|e| Error::io(partial, e))?;
                return Err(Error::Cancelled(format!(
                    "the download of {} was stopped; what arrived is kept and the next download goes on from it",
                    self.repo
                )));
            }
        }
        file.sync_all().map_err(|e| Error::io(partial, e))
    }

    /// A write that failed: a full disk (or a file-size limit) said in words, with what is kept.
    fn write_error(&self, name: &str, partial: &Path, e: std::io::Error) -> Error {
        match e.raw_os_error() {
            Some(code) if code == ENOSPC || code == EFBIG => Error::Download {
                repo: self.repo.clone(),
                file: name.to_owned(),
                msg: format!(
                    "the disk is full ({e}) in {}: what arrived is kept, and the download goes on from it once \
                     there is room",
                    self.cache.display()
                ),
            },
            _ => Error::io(partial, e),
        }
    }

    /// Refuses a download the disk cannot hold, naming both sizes.
    pub fn check_space(&self) -> Result<()> {
        match self.free {
            Some(free) if free < self.to_fetch + DISK_MARGIN => Err(Error::Download {
                repo: self.repo.clone(),
                file: "(all)".into(),
                msg: format!(
                    "it needs {} and {} has {} free; free space or set HF_HOME to another disk",
                    human_bytes(self.to_fetch),
                    self.cache.display(),
                    human_bytes(free)
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Downloads every file not cached yet, reporting progress; `Break` stops it, keeping what
    /// arrived for the next download.
    pub fn download(&self, on_progress: &mut dyn FnMut(&DownloadProgress) -> ControlFlow<()>) -> Result<()> {
        self.check_space()?;
        let agent = agent();
        let total: u64 = self.files.iter().map(|f| f.bytes).sum();
        let mut done: u64 = self.files.iter().map(|f| if f.cached { f.bytes } else { f.partial }).sum();
        let (started, resumed) = (Instant::now(), done);
        let mut last = Instant::now() - REPORT_EVERY;
        for f in self.files.iter().filter(|f| !f.cached) {
            let mut progress = |n: u64| {
                done += n;
                if last.elapsed() < REPORT_EVERY && done < total {
                    return ControlFlow::Continue(());
                }
                last = Instant::now();
                let rate = (done - resumed) as f64 / started.elapsed().as_secs_f64().max(1e-3);
                // A server that ignored a Range request sends a file again: never past the total.
                let shown = done.min(total);
                let eta_s = (rate > 0.0).then(|| (total - shown) as f64 / rate);
                let file = f.name.clone();
                on_progress(&DownloadProgress { repo: self.repo.clone(), file, done: shown, total, rate, eta_s })
            };
            self.fetch_file(&agent, &f.name, f.bytes, &mut progress)?;
        }
        tracing::info!(repo = %self.repo, bytes = total.saturating_sub(resumed), seconds = started.elapsed().as_secs_f64(), "model downloaded");
        Ok(())
    }
}

/// The OS's "no space left on device" and "file too large" (a file-size limit) error numbers
/// (Linux and the BSDs agree on both).
const ENOSPC: i32 = 28;
const EFBIG: i32 = 27;

/// Whether a repo file's name stays inside the snapshot: relative, no `..`.
fn inside(name: &str) -> bool {
    let path = Path::new(name);
    !name.is_empty() && path.components().all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// A snapshot's file `name`: a relative link to its blob, as huggingface_hub makes it
/// (`snapshots/COMMIT/NAME` → `../../blobs/ETAG`, one `..` more per folder in the name), or a
/// copy where links cannot be made.
#[cfg_attr(not(unix), allow(unused_variables))] // `name` places the link, which Unix alone makes
fn link(blob: &Path, snapshot: &Path, name: &str) -> Result<()> {
    let _ = std::fs::remove_file(snapshot);
    #[cfg(unix)]
    {
        let mut target = PathBuf::new();
        for _ in 0..Path::new(name).components().count() + 1 {
            target.push("..");
        }
        target.push("blobs");
        target.push(blob.file_name().unwrap_or_default());
        if std::os::unix::fs::symlink(&target, snapshot).is_ok() {
            return Ok(());
        }
    }
    std::fs::copy(blob, snapshot).map(|_| ()).map_err(|e| Error::io(snapshot, e))
}
