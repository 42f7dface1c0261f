//! Finding a model's files: a local folder, or a Hugging Face repo id through the HF cache and,
//! when allowed, the hub.
//!
//! The cache is always tried first, file by file, so a model that is already cached loads with
//! no network at all. `HF_HUB_OFFLINE=1` (the Hugging Face convention) forbids downloads; a
//! model that is then missing from the cache is a clear error, not a hang.
//!
//! Weights are checked before they are mapped: a safetensors file shorter than its own header
//! says (an interrupted download or copy) is reported as truncated, with both sizes, instead of
//! failing somewhere inside the mmap.

use std::collections::BTreeMap;
use std::io::Read;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::download::{DownloadProgress, Plan, Wanted};
use crate::error::{Error, Result};

pub const CONFIG: &str = "config.json";
pub const TOKENIZER: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const GENERATION_CONFIG: &str = "generation_config.json";
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";
pub const WEIGHTS: &str = "model.safetensors";
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// Where a model comes from, as the user named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Dir(PathBuf),
    /// A llama.cpp GGUF file: weights, tokenizer and chat template in one.
    Gguf(PathBuf),
    Hub {
        repo: String,
        revision: Option<String>,
    },
}

impl ModelSource {
    /// An existing folder is a folder, a path ending in `.gguf` a GGUF file (whether it exists
    /// is the loader's to say); `owner/name` or `owner/name@revision` is a hub repo id.
    pub fn parse(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.is_dir() {
            return Ok(Self::Dir(path.to_owned()));
        }
        if is_gguf(path) {
            return Ok(Self::Gguf(path.to_owned()));
        }
        let (repo, revision) = match spec.split_once('@') {
            Some((r, rev)) => (r, Some(rev.to_owned())),
            None => (spec, None),
        };
        let valid_part = |s: &str| {
            !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) && !s.starts_with('.')
        };
        match repo.split_once('/') {
            Some((owner, name)) if valid_part(owner) && valid_part(name) && !spec.starts_with('/') => {
                Ok(Self::Hub { repo: repo.to_owned(), revision })
            }
            _ => Err(Error::BadModelSpec(spec.to_owned())),
        }
    }

    /// A short display name (the folder name, the file name or the repo id).
    pub fn display_name(&self) -> String {
        match self {
            Self::Gguf(p) => {
                p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
            }
            Self::Dir(p) => p
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| p.display().to_string()),
            Self::Hub { repo, .. } => repo.clone(),
        }
    }
}

/// The files of a model, all local once resolved.
#[derive(Debug, Clone)]
pub enum ModelFiles {
    /// A Hugging Face folder (or a repo in the cache).
    Hf(HfFiles),
    /// One GGUF file.
    Gguf(PathBuf),
}

/// Paths of every file the engine reads from a Hugging Face model.
#[derive(Debug, Clone)]
pub struct HfFiles {
    pub config: PathBuf,
    pub tokenizer: PathBuf,
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub weights: Vec<PathBuf>,
}

impl ModelFiles {
    /// The folder the model lives in: where Folio keeps its files about it (a calibration).
    pub fn dir(&self) -> &Path {
        let file = match self {
            Self::Hf(f) => &f.config,
            Self::Gguf(p) => p,
        };
        file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
    }

    pub fn resolve(source: &ModelSource) -> Result<Self> {
        Self::resolve_with(source, &mut |_| ControlFlow::Continue(()))
    }

    /// [`ModelFiles::resolve`], a download's progress reported to `on_download` (`Break`
    /// stops it, keeping what arrived for the next attempt).
    pub fn resolve_with(
        source: &ModelSource,
        on_download: &mut dyn FnMut(&DownloadProgress) -> ControlFlow<()>,
    ) -> Result<Self> {
        match source {
            ModelSource::Dir(dir) => HfFiles::from_dir(dir).map(Self::Hf),
            ModelSource::Gguf(path) => Ok(Self::Gguf(path.clone())),
            ModelSource::Hub { repo, revision } => {
                HfFiles::from_hub(repo, revision.as_deref(), on_download).map(Self::Hf)
            }
        }
    }
}

impl HfFiles {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let required = |file: &str| {
            let p = dir.join(file);
            if p.is_file() {
                Ok(p)
            } else {
                Err(Error::MissingFile { file: file.to_owned(), dir: dir.to_owned() })
            }
        };
        let optional = |file: &str| Some(dir.join(file)).filter(|p| p.is_file());
        let config = required(CONFIG)?;
        let tokenizer = required(TOKENIZER)?;
        let weights = if let Some(index) = optional(WEIGHTS_INDEX) {
            shard_names(&index)?.into_iter().map(|s| required(&s)).collect::<Result<Vec<_>>>()?
        } else {
            vec![required(WEIGHTS)?]
        };
        Ok(Self {
            config,
            tokenizer,
            tokenizer_config: optional(TOKENIZER_CONFIG),
            generation_config: optional(GENERATION_CONFIG),
            chat_template: optional(CHAT_TEMPLATE),
            weights,
        })
    }

    fn from_hub(
        repo_id: &str,
        revision: Option<&str>,
        on_download: &mut dyn FnMut(&DownloadProgress) -> ControlFlow<()>,
    ) -> Result<Self> {
        let repo = match revision {
            Some(rev) => Repo::with_revision(repo_id.to_owned(), RepoType::Model, rev.to_owned()),
            None => Repo::new(repo_id.to_owned(), RepoType::Model),
        };
        let hub = Hub { cache: Cache::from_env(), repo, repo_id };
        if !hub.complete() && !offline_from_env() {
            download_plan(repo_id, revision.unwrap_or(DEFAULT_REVISION))?.download(on_download)?;
        }
        let config = hub.required(CONFIG)?;
        let tokenizer = hub.required(TOKENIZER)?;
        let weights = match hub.cached(WEIGHTS_INDEX) {
            Some(index) => shard_names(&index)?.iter().map(|s| hub.required(s)).collect::<Result<Vec<_>>>()?,
            None => vec![hub.required(WEIGHTS)?],
        };
        Ok(Self {
            config,
            tokenizer,
            tokenizer_config: hub.cached(TOKENIZER_CONFIG),
            generation_config: hub.cached(GENERATION_CONFIG),
            chat_template: hub.cached(CHAT_TEMPLATE),
            weights,
        })
    }
}

/// The file name extension Folio takes as a GGUF model (`crate::gguf` reads the file).
pub const GGUF_EXTENSION: &str = "gguf";

/// Whether `path` names a GGUF file (by its extension; `GgufFile::open` checks the magic).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case(GGUF_EXTENSION))
}

/// The revision a repo id without `@REVISION` names.
pub const DEFAULT_REVISION: &str = "main";

/// The files of a model repo Folio loads: config and tokenizer required, the rest when there.
pub const MODEL_FILES: Wanted = Wanted {
    config: CONFIG,
    required: &[CONFIG, TOKENIZER],
    optional: &[TOKENIZER_CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE],
    weights: WEIGHTS,
    index: WEIGHTS_INDEX,
    shards: shard_names,
};

/// What downloading the model `repo` at `revision` would take (its config fetched already).
pub fn download_plan(repo: &str, revision: &str) -> Result<Plan> {
    Plan::fetch(repo, revision, &MODEL_FILES)
}

/// `HF_HUB_OFFLINE` as huggingface_hub reads it: 1, on, yes or true (any case) forbid downloads.
fn offline_from_env() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| ["1", "on", "yes", "true"].contains(&v.trim().to_lowercase().as_str()))
}

/// A repo in the Hugging Face cache (downloads are `crate::download`'s).
struct Hub<'a> {
    cache: Cache,
    repo: Repo,
    repo_id: &'a str,
}

/// Whether the cache holds `repo` at `revision` (default `main`) whole: it loads offline.
pub fn cached_whole(repo: &str, revision: Option<&str>) -> bool {
    let repo_id =
        Repo::with_revision(repo.to_owned(), RepoType::Model, revision.unwrap_or(DEFAULT_REVISION).to_owned());
    Hub { cache: Cache::from_env(), repo: repo_id, repo_id: repo }.complete()
}

impl Hub<'_> {
    /// A repo whose config, tokenizer and weights list are cached was downloaded whole before:
    /// its optional files are whatever the cache holds, and the network is not asked.
    fn complete(&self) -> bool {
        let cached = |f: &str| self.cached(f).is_some();
        // An index names shards: all of them must be here (a download stopped among the shards
        // leaves the index and some shards, and must go on, not count as whole).
        let weights = match self.cached(WEIGHTS_INDEX) {
            Some(index) => shard_names(&index).is_ok_and(|shards| shards.iter().all(|s| cached(s))),
            None => cached(WEIGHTS),
        };
        cached(CONFIG) && cached(TOKENIZER) && weights
    }

    fn cached(&self, file: &str) -> Option<PathBuf> {
        self.cache.repo(self.repo.clone()).get(file)
    }

    /// A file the model needs: from the cache (a download has put it there), or a clear error.
    fn required(&self, file: &str) -> Result<PathBuf> {
        self.cached(file).ok_or_else(|| Error::ModelNotCached {
            repo: self.repo_id.to_owned(),
            file: file.to_owned(),
            cache: self.cache.path().clone(),
        })
    }
}

/// A model the Hugging Face cache holds whole: it loads with no network.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct CachedModel {
    /// The repo id, what `--model` takes.
    pub repo: String,
    /// Bytes of its weight files.
    pub weight_bytes: u64,
}

/// The models in the Hugging Face cache (`HF_HOME`, else ~/.cache/huggingface) whose `main`
/// snapshot has a config, a tokenizer and every weight file: what loads offline.
pub fn cached_models() -> Vec<CachedModel> {
    cached_models_in(Cache::from_env().path())
}

/// [`cached_models`] of the cache folder `hub` (the one holding `models--owner--name`
/// folders), sorted by repo id. Partial downloads and other repo types are left out.
pub fn cached_models_in(hub: &Path) -> Vec<CachedModel> {
    let Ok(entries) = std::fs::read_dir(hub) else { return Vec::new() };
    let cache = Cache::new(hub.to_owned());
    let mut found: Vec<CachedModel> = entries
        .flatten()
        .filter_map(|entry| {
            let folder = entry.file_name().to_str()?.strip_prefix("models--")?.to_owned();
            // `models--owner--name`: the first "--" separates the owner.
            let repo = folder.replacen("--", "/", 1);
            let cached = cache.repo(Repo::new(repo.clone(), RepoType::Model));
            cached.get(CONFIG)?;
            cached.get(TOKENIZER)?;
            let weights = match cached.get(WEIGHTS_INDEX) {
                Some(index) => shard_names(&index).ok()?.iter().map(|s| cached.get(s)).collect::<Option<Vec<_>>>()?,
                None => vec![cached.get(WEIGHTS)?],
            };
            let weight_bytes = weights.iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
            Some(CachedModel { repo, weight_bytes })
        })
        .collect();
    found.sort_by(|a, b| a.repo.cmp(&b.repo));
    found
}

/// The distinct shard files named by a `model.safetensors.index.json`, in order.
pub(crate) fn shard_names(index: &Path) -> Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let idx: Index =
        serde_json::from_str(&text).map_err(|e| Error::InvalidConfig { path: index.to_owned(), msg: e.to_string() })?;
    let mut shards: Vec<String> = idx.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// The safetensors format's own bound on the JSON header (100 MB): anything larger is corrupt.
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// The open file, its size and the JSON header bytes of a safetensors file, the header's length
/// checked against the format's bound and the file's size.
fn read_safetensors_header(path: &Path) -> Result<(std::fs::File, u64, Vec<u8>)> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let actual = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut len_bytes = [0u8; 8];
    if actual < 8 {
        return Err(Error::WeightsTruncated { path: path.to_owned(), expected: 8, actual });
    }
    file.read_exact(&mut len_bytes).map_err(|e| Error::io(path, e))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_SAFETENSORS_HEADER {
        return Err(Error::InvalidWeights {
            path: path.to_owned(),
            msg: format!("header length {header_len} is beyond the format's {MAX_SAFETENSORS_HEADER}-byte limit"),
        });
    }
    if header_len > actual - 8 {
        return Err(Error::WeightsTruncated { path: path.to_owned(), expected: 8 + header_len, actual });
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| Error::io(path, e))?;
    Ok((file, actual, header))
}

/// Tensor names and element counts from a safetensors header, after checking that the file
/// holds every byte the header promises.
pub fn check_safetensors(path: &Path) -> Result<BTreeMap<String, usize>> {
    let invalid = |msg: String| Error::InvalidWeights { path: path.to_owned(), msg };
    let (_, actual, header) = read_safetensors_header(path)?;
    let header_len = header.len() as u64;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| invalid(format!("header is not valid JSON: {e}")))?;
    let mut data_end = 0u64;
    let mut elems = BTreeMap::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let end =
            info["data_offsets"][1].as_u64().ok_or_else(|| invalid(format!("tensor {name} has no data_offsets")))?;
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone())
            .map_err(|e| invalid(format!("tensor {name} has a bad shape: {e}")))?;
        data_end = data_end.max(end);
        let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        elems.insert(
            name.clone(),
            count.ok_or_else(|| invalid(format!("tensor {name} has an impossible shape {shape:?}")))?,
        );
    }
    let expected = (8 + header_len).checked_add(data_end).ok_or_else(|| invalid("tensor offsets overflow".into()))?;
    if actual < expected {
        return Err(Error::WeightsTruncated { path: path.to_owned(), expected, actual });
    }
    Ok(elems)
}

/// Blocks sampled from each weights file for [`weights_hash`].
const WEIGHT_SAMPLES: u64 = 64;
const WEIGHT_SAMPLE_BYTES: usize = 4096;

/// Feeds `h` [`WEIGHT_SAMPLES`] blocks of [`WEIGHT_SAMPLE_BYTES`] spread evenly over bytes
/// `from..len` of `file` (safetensors data here, a whole GGUF in `gguf::file_hash`).
pub(crate) fn hash_spread(
    h: &mut xxhash_rust::xxh3::Xxh3,
    file: &std::fs::File,
    path: &Path,
    from: u64,
    len: u64,
) -> Result<()> {
    use folio_context_file::platform::PositionalIo;
    let span = len - from;
    let mut block = vec![0u8; WEIGHT_SAMPLE_BYTES];
    for i in 0..WEIGHT_SAMPLES {
        let at = from + span * i / WEIGHT_SAMPLES;
        let n = (WEIGHT_SAMPLE_BYTES as u64).min(len - at) as usize;
        file.read_exact_at(&mut block[..n], at).map_err(|e| Error::io(path, e))?;
        h.update(&block[..n]);
    }
    Ok(())
}

/// A fingerprint of a model's weights that costs milliseconds, not a read of every byte: the
/// xxh3-64 of each file's length, its safetensors header (names, shapes, dtypes, offsets) and
/// 64 blocks of 4 KiB spread evenly over its data. Two checkpoints of the same architecture
/// (a fine-tune, a re-quantisation) differ in the sampled bytes; a single changed weight may
/// not, which is acceptable for its job: telling users they opened a context with another model.
pub fn weights_hash(files: &[PathBuf]) -> Result<String> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for path in files {
        let (file, len, header) = read_safetensors_header(path)?;
        h.update(&len.to_le_bytes());
        h.update(&header);
        hash_spread(&mut h, &file, path, 8 + header.len() as u64, len)?;
    }
    Ok(folio_context_file::format::checksum_hex(h.digest()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_specs() {
        assert_eq!(
            ModelSource::parse("Qwen/Qwen2.5-7B-Instruct-1M").unwrap(),
            ModelSource::Hub { repo: "Qwen/Qwen2.5-7B-Instruct-1M".into(), revision: None }
        );
        assert_eq!(
            ModelSource::parse("meta-llama/Llama-3.1-8B@main").unwrap(),
            ModelSource::Hub { repo: "meta-llama/Llama-3.1-8B".into(), revision: Some("main".into()) }
        );
        for bad in ["/no/such/dir", "just-a-name", "a/b/c", "./x/y"] {
            let err = ModelSource::parse(bad).unwrap_err().to_string();
            assert!(err.contains("neither a model folder nor"), "{bad}: {err}");
        }
    }

    /// A cache laid out as huggingface_hub writes it (refs/main → snapshots/<commit>/files):
    /// a whole model is listed with its weights' size, sharded or not; a partial download
    /// (no weights, or a shard missing) and a dataset are not.
    #[test]
    fn cached_models_are_the_whole_ones() {
        let hub = tempfile::tempdir().unwrap();
        let repo = |folder: &str, files: &[(&str, &str)]| {
            let dir = hub.path().join(folder);
            std::fs::create_dir_all(dir.join("refs")).unwrap();
            std::fs::write(dir.join("refs/main"), "abc123").unwrap();
            let snap = dir.join("snapshots/abc123");
            std::fs::create_dir_all(&snap).unwrap();
            for (name, text) in files {
                std::fs::write(snap.join(name), text).unwrap();
            }
        };
        let index = r#"{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}"#;
        repo("models--acme--tiny", &[(CONFIG, "{}"), (TOKENIZER, "{}"), (WEIGHTS, "12345")]);
        repo(
            "models--acme--sharded--v2",
            &[
                (CONFIG, "{}"),
                (TOKENIZER, "{}"),
                (WEIGHTS_INDEX, index),
                ("model-1.safetensors", "1"),
                ("model-2.safetensors", "22"),
            ],
        );
        repo("models--acme--partial", &[(CONFIG, "{}"), (TOKENIZER, "{}")]);
        repo(
            "models--acme--shard-missing",
            &[(CONFIG, "{}"), (TOKENIZER, "{}"), (WEIGHTS_INDEX, index), ("model-1.safetensors", "1")],
        );
        repo("datasets--acme--text", &[(CONFIG, "{}"), (TOKENIZER, "{}"), (WEIGHTS, "1")]);
        let found = cached_models_in(hub.path());
        assert_eq!(
            found,
            [
                CachedModel { repo: "acme/sharded--v2".into(), weight_bytes: 3 },
                CachedModel { repo: "acme/tiny".into(), weight_bytes: 5 },
            ]
        );
        assert!(cached_models_in(&hub.path().join("nothing here")).is_empty());
    }
}
