//! A prefill in flight: everything it has done lives in `<out>.partial/` beside its output —
//! the future file, the hidden states a resume starts from, `checkpoint.json` and a lock. This
//! module is that folder's format as every reader sees it: the engine's builder writes and
//! resumes it, the library lists a context as "prefilling" or "paused at layer N" from it.

use crate::platform::PositionalIo;
use std::fs::File;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::atomic::write_atomic;
use crate::error::{Error, Result};
use crate::format::{checksum, DocumentSpan, Header, SectionKind};

/// A running prefill's `checkpoint.json`: the job (the header with blank K/V checksums), the
/// chunk size, how many layers are done with their checksums, and where the hidden states the
/// next layer reads are. Written by the engine's builder, read by it to resume and by anyone
/// who lists the prefill ([`pending`]).
#[derive(Debug, Serialize, Deserialize)]
pub struct Checkpoint {
    pub format: String,
    pub version: u32,
    pub job: Header,
    pub compute: String,
    pub chunk: usize,
    pub layers_done: usize,
    /// Checksums of the sections written so far, in section-table order.
    pub checksums: Vec<String>,
    /// Checksum of the hidden states the next layer reads (empty at layer 0).
    pub hidden: String,
    /// Which hidden-state file holds them (0 or 1); version 3 checkpoints predate it and use
    /// the file of the last finished layer's parity.
    #[serde(default)]
    pub hidden_file: Option<usize>,
    /// Tokens taken from the saved context this prefill grows (0: a prefill of everything).
    /// Version 2 checkpoints predate growing and read as 0.
    #[serde(default)]
    pub base_tokens: usize,
}

pub const CHECKPOINT_FORMAT: &str = "folio-prefill-checkpoint";
pub const CHECKPOINT_VERSION: u32 = 4;
/// Checkpoint versions this Folio resumes.
pub const CHECKPOINT_VERSIONS: std::ops::RangeInclusive<u32> = 2..=CHECKPOINT_VERSION;

/// The hidden-state files a checkpoint can name.
pub const HIDDEN_FILES: usize = 2;

/// The folder holding an interrupted or running prefill of `out`.
pub fn partial_dir(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

/// The `date_string` of an interrupted prefill of `out`, so a resume renders the same prompt.
pub fn pending_date(out: &Path) -> Option<String> {
    Some(read_checkpoint(&partial_dir(out).join("checkpoint.json")).ok()??.job.prompt.date)
}

/// An interrupted or running prefill of an output, as its partial folder tells: what the
/// library lists as "prefilling" or "paused at layer N" (resumed by running the same prefill).
#[derive(Debug, Clone)]
pub struct Pending {
    /// The file the prefill writes (its K/V checksums blank until the end).
    pub header: Header,
    pub documents: Vec<DocumentSpan>,
    pub layers_done: usize,
    /// A process holds the folder's lock: the prefill is running now.
    pub running: bool,
    /// Tokens it takes from the saved context it grows (0: a prefill of everything).
    pub base_tokens: usize,
    /// When the checkpoint was last written.
    pub updated: std::time::SystemTime,
}

/// The prefill of `out` waiting in (or running in) its partial folder, if there is one with a
/// checkpoint this version reads. Reads the checkpoint and the spans already written to the
/// future file (a few kilobytes), never the K/V.
pub fn pending(out: &Path) -> Result<Option<Pending>> {
    let dir = partial_dir(out);
    let cp_path = dir.join("checkpoint.json");
    let Some(cp) = read_checkpoint(&cp_path)? else { return Ok(None) };
    let updated = std::fs::metadata(&cp_path).and_then(|m| m.modified()).map_err(|e| Error::io(&cp_path, e))?;
    let running = match File::open(dir.join("lock")) {
        Ok(lock) => {
            let free = <File as fs4::FileExt>::try_lock_shared(&lock).is_ok();
            if free {
                let _ = <File as fs4::FileExt>::unlock(&lock);
            }
            !free
        }
        Err(_) => false,
    };
    let tmp = dir.join("context.tmp");
    let spans = cp.job.section(SectionKind::Documents, None).zip(cp.checksums.get(1));
    let documents = match (spans, open_if_present(&tmp)?) {
        (Some((s, want)), Some(file)) => {
            let mut bytes = vec![0u8; s.bytes as usize];
            file.read_exact_at(&mut bytes, s.offset).map_err(|e| Error::io(&tmp, e))?;
            if &checksum(&bytes) != want {
                return Err(Error::Context { path: tmp, msg: "the document table is corrupted".into() });
            }
            serde_json::from_slice(&bytes)
                .map_err(|e| Error::Context { path: tmp, msg: format!("the document table is unreadable: {e}") })?
        }
        _ => Vec::new(),
    };
    Ok(Some(Pending {
        header: cp.job,
        documents,
        layers_done: cp.layers_done,
        running,
        updated,
        base_tokens: cp.base_tokens,
    }))
}

pub fn read_checkpoint(path: &Path) -> Result<Option<Checkpoint>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(serde_json::from_str::<Checkpoint>(&text)
            .ok()
            .filter(|cp| cp.format == CHECKPOINT_FORMAT && CHECKPOINT_VERSIONS.contains(&cp.version))
            .filter(|cp| cp.hidden_file.is_none_or(|f| f < HIDDEN_FILES))),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

pub fn write_checkpoint(path: &Path, cp: &Checkpoint) -> Result<()> {
    write_atomic(path, &serde_json::to_vec_pretty(cp).map_err(|e| Error::Invalid(e.to_string()))?)
}

pub fn open_if_present(path: &Path) -> Result<Option<File>> {
    match File::open(path) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}
