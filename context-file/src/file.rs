//! Reading a context file: memory-mapped, checked before anything is trusted.
//!
//! Opening reads the preamble, the header and the two small sections (token ids, document
//! spans), verifying their checksums; it does not read the K/V sections, so opening a
//! million-token context costs milliseconds, not a pass over tens of gigabytes. A K/V section
//! is verified when it is first read ([`ContextFile::layer_kv`]) and by [`ContextFile::verify`].
//! Every failure is an [`Error::Context`] naming the file and the damaged part, never a panic.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use memmap2::Mmap;
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

use crate::atomic::{check_replaceable, sync_dir};
use crate::error::{Error, Result};
use crate::format::{
    checksum, DocumentSpan, Header, Section, SectionKind, FORMAT_VERSION, MAGIC, OLDEST_READABLE_VERSION, PAGE,
    PREAMBLE_BYTES,
};

pub struct ContextFile {
    path: PathBuf,
    /// Which file was opened (the path may later name another: an index stored renames a new
    /// file over it); a reopen by path is checked against it.
    identity: Identity,
    map: Mmap,
    header: Header,
    tokens: Vec<u32>,
    documents: Vec<DocumentSpan>,
    /// Per section: its checksum matched once, so a layer decoded again (after the resident
    /// tier dropped it) is not hashed again.
    verified: Vec<AtomicBool>,
}

/// What tells one file from another at the same path: the device and inode on Unix; elsewhere
/// the length and the last write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity(u64, u64);

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            Self(meta.dev(), meta.ino())
        }
        #[cfg(not(unix))]
        {
            let written = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            Self(meta.len(), written.map_or(0, |d| d.as_nanos() as u64))
        }
    }
}

/// Result of [`ContextFile::verify`].
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub sections: usize,
    pub bytes: u64,
    pub seconds: f64,
}

impl ContextFile {
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |msg: String| Error::Context { path: path.to_owned(), msg };
        // Checked before opening: opening a named pipe waits for a writer forever.
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Err(bad("a folder, not a context file: name a context file (.folio) in it".into()));
        }
        if !meta.is_file() {
            return Err(bad("not a regular file: a context file is a file on disk".into()));
        }
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let opened = file.metadata().map_err(|e| Error::io(path, e))?;
        let (len, identity) = (opened.len(), Identity::of(&opened));
        if len < PREAMBLE_BYTES {
            return Err(bad(format!("not a Folio context file (only {len} bytes)")));
        }
        // SAFETY: mapped read-only. Folio never modifies a finished context file in place (saves
        // are temp file + rename), so the mapping only changes if another program truncates or
        // rewrites the file while it is open, which Folio cannot prevent for any mmap.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let word = |at: usize, n: usize| -> u64 {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(&map[at..at + n]);
            u64::from_le_bytes(b)
        };
        if map[..8] != MAGIC {
            return Err(bad("not a Folio context file (it does not start with FOLIOCTX)".into()));
        }
        let version = word(8, 4) as u32;
        if !(OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(bad(format!(
                "context format version {version}; this Folio reads versions {OLDEST_READABLE_VERSION} to {FORMAT_VERSION}{}",
                if version > FORMAT_VERSION { " (the file was written by a newer Folio)" } else { "" }
            )));
        }
        let header_len = word(16, 8);
        let header_end = PREAMBLE_BYTES.checked_add(header_len).filter(|&e| e <= len).ok_or_else(|| {
            bad(format!(
                "truncated or corrupted: the header claims {header_len} bytes but the file has {len}; \
                 prefill again or copy the file again"
            ))
        })?;
        let json = &map[PREAMBLE_BYTES as usize..header_end as usize];
        if xxh3_64(json) != word(24, 8) {
            return Err(bad("the header is corrupted (checksum mismatch); prefill the documents again".into()));
        }
        let header: Header = serde_json::from_slice(json).map_err(|e| bad(format!("the header is unreadable: {e}")))?;
        if len < header.file_bytes {
            return Err(bad(format!(
                "truncated: {len} of {} bytes (a copy or download did not finish); copy the file again or prefill again",
                header.file_bytes
            )));
        }
        check_shape(&header, len).map_err(bad)?;
        check_layout(&header).map_err(bad)?;
        let verified = header.sections.iter().map(|_| AtomicBool::new(false)).collect();
        let mut ctx =
            Self { path: path.to_owned(), identity, map, header, tokens: Vec::new(), documents: Vec::new(), verified };
        let tokens = ctx.section_bytes(SectionKind::Tokens, None)?;
        ctx.tokens = tokens.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let docs = ctx.section_bytes(SectionKind::Documents, None)?;
        ctx.documents =
            serde_json::from_slice(docs).map_err(|e| bad(format!("the document table is unreadable: {e}")))?;
        check_contents(&ctx.header, &ctx.tokens, &ctx.documents).map_err(bad)?;
        Ok(ctx)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Refuses `other` (the path opened again) when it is not the file this one opened.
    pub fn check_same(&self, other: &std::fs::File) -> Result<()> {
        let meta = other.metadata().map_err(|e| Error::io(&self.path, e))?;
        if Identity::of(&meta) != self.identity {
            return Err(Error::Context {
                path: self.path.clone(),
                msg: "the file was replaced since it was opened (an index stored, or a copy over it); open it again"
                    .into(),
            });
        }
        Ok(())
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn documents(&self) -> &[DocumentSpan] {
        &self.documents
    }

    /// Tokens before document `doc` starts (all of them when `doc` is past the last): what a
    /// context keeps when it is cut before that document.
    pub fn tokens_before(&self, doc: usize) -> usize {
        self.documents.get(doc).map_or(self.tokens.len(), |s| s.start)
    }

    /// The checksum of the token ids: identifies the saved prefix (what a conversation file
    /// records to refuse being continued on another context).
    pub fn context_id(&self) -> &str {
        self.header.section(SectionKind::Tokens, None).map_or("", |s| s.xxh3.as_str())
    }

    /// A section's bytes, checksum verified (once).
    fn section_bytes(&self, kind: SectionKind, layer: Option<usize>) -> Result<&[u8]> {
        self.checked(self.section_index(kind, layer)?, false)
    }

    /// Where the header lists the `kind` section of `layer`.
    fn section_index(&self, kind: SectionKind, layer: Option<usize>) -> Result<usize> {
        self.header.sections.iter().position(|s| s.kind == kind && s.layer == layer).ok_or_else(|| Error::Context {
            path: self.path.clone(),
            msg: format!(
                "the header has no {kind:?} section{}",
                layer.map_or(String::new(), |l| format!(" for layer {l}"))
            ),
        })
    }

    /// Section `i`'s bytes after comparing their checksum with the header's, unless that was
    /// done before and `again` is false.
    fn checked(&self, i: usize, again: bool) -> Result<&[u8]> {
        let s = &self.header.sections[i];
        let bytes = &self.map[s.offset as usize..(s.offset + s.bytes) as usize];
        if !again && self.verified[i].load(Ordering::Relaxed) {
            return Ok(bytes);
        }
        if checksum(bytes) != s.xxh3 {
            return Err(self.corrupted(i));
        }
        self.verified[i].store(true, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Section `i`'s checksum did not match.
    fn corrupted(&self, i: usize) -> Error {
        Error::Context {
            path: self.path.clone(),
            msg: format!(
                "section \"{}\" is corrupted (checksum mismatch): the file was damaged after it was saved; \
                 prefill the documents again",
                self.header.sections[i].label()
            ),
        }
    }

    /// Where each layer's K and V sections lie in [`Self::mapped`], `(offset, bytes)`, K then
    /// V of layer 0, then layer 1…, every one verified first — over the machine's cores, since
    /// a reopen on the offloaded tier reads them all at once (31 GB at a million tokens of a 7B
    /// model); those verified before are not hashed again.
    pub fn kv_sections(&self) -> Result<Vec<(usize, usize)>> {
        use rayon::prelude::*;
        let wanted = (0..self.header.layers)
            .flat_map(|l| [SectionKind::Keys, SectionKind::Values].map(|kind| self.section_index(kind, Some(l))))
            .collect::<Result<Vec<usize>>>()?;
        wanted.par_iter().try_for_each(|&i| self.checked(i, false).map(|_| ()))?;
        Ok(wanted
            .iter()
            .map(|&i| (self.header.sections[i].offset as usize, self.header.sections[i].bytes as usize))
            .collect())
    }

    /// [`Self::kv_sections`] with each section verified by reading the file (a bounded buffer
    /// at a time, sections over the machine's cores) rather than through the mapping: the
    /// file tier's way, which keeps the rows on disk — pages of the mapping once read stay in
    /// the process's resident set until the system reclaims them, more than a host budget
    /// smaller than the file can hold.
    pub fn kv_sections_read(&self) -> Result<Vec<(usize, usize)>> {
        use rayon::prelude::*;
        let wanted = (0..self.header.layers)
            .flat_map(|l| [SectionKind::Keys, SectionKind::Values].map(|kind| self.section_index(kind, Some(l))))
            .collect::<Result<Vec<usize>>>()?;
        let file = std::fs::File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        self.check_same(&file)?;
        wanted.par_iter().try_for_each(|&i| -> Result<()> {
            if self.verified[i].load(Ordering::Relaxed) {
                return Ok(());
            }
            let s = &self.header.sections[i];
            let sum = crate::format::file_checksum(&file, s.offset, s.bytes).map_err(|e| Error::io(&self.path, e))?;
            if sum != s.xxh3 {
                return Err(self.corrupted(i));
            }
            self.verified[i].store(true, Ordering::Relaxed);
            Ok(())
        })?;
        Ok(wanted
            .iter()
            .map(|&i| (self.header.sections[i].offset as usize, self.header.sections[i].bytes as usize))
            .collect())
    }

    /// The whole file as mapped: what the offloaded tier reads K/V sections from in place
    /// (a GPU registers it; see [`Self::kv_sections`]).
    pub fn mapped(&self) -> &[u8] {
        &self.map
    }

    /// The index section `name` of `layer`, checksum verified; `None` if the file has none.
    pub fn index(&self, name: &str, layer: usize) -> Result<Option<&[u8]>> {
        let found =
            self.header.sections.iter().position(|s| {
                s.kind == SectionKind::Index && s.layer == Some(layer) && s.name.as_deref() == Some(name)
            });
        found.map(|i| self.checked(i, false)).transpose()
    }

    /// Writes this context with `indexes` (name, layer, bytes) added — replacing sections of
    /// the same name and layer — to `out`, atomically (a temporary file renamed over `out`,
    /// which may be this file's own path). Every copied section is verified on the way.
    pub fn write_with_indexes(&self, out: &Path, indexes: Vec<(String, usize, Vec<u8>)>) -> Result<Header> {
        let replaced = |s: &Section| {
            s.kind == SectionKind::Index
                && indexes.iter().any(|(n, l, _)| s.layer == Some(*l) && s.name.as_deref() == Some(n))
        };
        let kept: Vec<usize> =
            (0..self.header.sections.len()).filter(|&i| !replaced(&self.header.sections[i])).collect();
        let mut header = self.header.clone();
        header.sections = kept.iter().map(|&i| self.header.sections[i].clone()).collect();
        for (name, layer, bytes) in &indexes {
            header.sections.push(Section {
                kind: SectionKind::Index,
                layer: Some(*layer),
                name: Some(name.clone()),
                offset: 0,
                bytes: bytes.len() as u64,
                xxh3: checksum(bytes),
            });
        }
        header.lay_out();
        // A name of this process's own, so two runs never write into one temporary file.
        let mut tmp_name = out.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(format!(".indexing-{}", std::process::id()));
        let tmp = out.with_file_name(tmp_name);
        let write = || -> Result<()> {
            use std::io::{Seek, SeekFrom, Write};
            let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
            let io = |e| Error::io(&tmp, e);
            f.write_all(&header.encode()).map_err(io)?;
            let mut put = |offset: u64, bytes: &[u8]| -> Result<()> {
                f.seek(SeekFrom::Start(offset)).map_err(io)?;
                f.write_all(bytes).map_err(io)
            };
            for (new, &old) in kept.iter().enumerate() {
                put(header.sections[new].offset, self.checked(old, false)?)?;
            }
            for (i, (_, _, bytes)) in indexes.iter().enumerate() {
                put(header.sections[kept.len() + i].offset, bytes)?;
            }
            f.set_len(header.file_bytes).map_err(io)?;
            f.sync_all().map_err(io)?;
            check_replaceable(out)?;
            std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))?;
            // The rename itself survives a crash once the folder is synced.
            sync_dir(out)
        };
        write().inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        Ok(header)
    }

    /// Keys and values of `layer` as f32, `[kv_heads, tokens, head_dim]` row-major each.
    pub fn layer_kv(&self, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let h = &self.header;
        let rows = h.kv_heads * h.tokens;
        let half = |kind| h.kv_dtype.codec(kind).decode(self.section_bytes(kind, Some(layer))?, rows, h.head_dim);
        let (k, v) = (half(SectionKind::Keys)?, half(SectionKind::Values)?);
        Ok((k, v))
    }

    /// Checks every section's checksum.
    pub fn verify(&self) -> Result<VerifyReport> {
        let start = Instant::now();
        let len = self.map.len() as u64;
        if len != self.header.file_bytes {
            return Err(Error::Context {
                path: self.path.clone(),
                msg: format!(
                    "{} bytes after the last section: the header records {} bytes, the file has {len} (something \
                     was appended to it); copy the file again or prefill again",
                    len - self.header.file_bytes,
                    self.header.file_bytes
                ),
            });
        }
        let mut bytes = 0;
        for (i, s) in self.header.sections.iter().enumerate() {
            self.checked(i, true)?;
            bytes += s.bytes;
        }
        Ok(VerifyReport { sections: self.header.sections.len(), bytes, seconds: start.elapsed().as_secs_f64() })
    }
}

/// What checksums cannot catch (a file whose checksums were recomputed after its content was
/// changed): the header's token count is the token section's, every token id is in the model's
/// vocabulary, and the document spans are in order, inside the tokens and not overlapping.
fn check_contents(header: &Header, tokens: &[u32], documents: &[DocumentSpan]) -> std::result::Result<(), String> {
    if header.tokens != tokens.len() {
        return Err(format!("the header says {} tokens but the file holds {}", header.tokens, tokens.len()));
    }
    let vocab = header.model.fingerprint.vocab_size;
    if let Some((at, id)) = tokens.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(format!("token {at} is id {id}, outside the model's vocabulary of {vocab}"));
    }
    let mut end = 0;
    for (i, d) in documents.iter().enumerate() {
        if d.start < end || d.start > d.end || d.end > tokens.len() {
            return Err(format!(
                "document {i} ({}) spans tokens {}..{}, which is not after the previous one and inside the {} tokens",
                d.title,
                d.start,
                d.end,
                tokens.len()
            ));
        }
        end = d.end;
    }
    Ok(())
}

/// The header's counts must fit the file before anything multiplies them: a hostile header
/// with 2^63 tokens or heads would overflow the section sizes computed from them (a panic, or a
/// wrapped size that passes), or ask for more layers than it has sections.
fn check_shape(h: &Header, len: u64) -> std::result::Result<(), String> {
    let impossible = || {
        format!(
            "its shape is impossible for a file of {len} bytes ({} tokens, {} layers, {} K/V heads of {} values)",
            h.tokens, h.layers, h.kv_heads, h.head_dim
        )
    };
    let rows = h.kv_heads.checked_mul(h.tokens).ok_or_else(impossible)?;
    let values = (rows as u64).checked_mul(h.head_dim as u64).ok_or_else(impossible)?;
    // The largest a K or V section of that shape can be (4-byte values, or fp8's scales).
    let scales = (rows as u64).checked_mul(4).ok_or_else(impossible)?;
    let section = values.checked_mul(4).and_then(|b| b.checked_add(scales)).ok_or_else(impossible)?;
    let tokens = (h.tokens as u64).checked_mul(4).ok_or_else(impossible)?;
    if tokens > len || (h.layers > 0 && values > len) || section > u64::MAX / 2 || h.layers > h.sections.len() {
        return Err(impossible());
    }
    // The K/V's shape is the model's (what `Header::new` writes): a crafted header whose shape
    // differs from its own fingerprint, or with rows of no values, reads nothing sensible.
    let f = &h.model.fingerprint;
    if h.head_dim == 0 || (h.layers, h.kv_heads, h.head_dim) != (f.layers, f.kv_heads, f.head_dim) {
        return Err(format!(
            "its K/V shape ({} layers, {} K/V heads of {} values) is not its model's ({} layers, {} K/V heads of {})",
            h.layers, h.kv_heads, h.head_dim, f.layers, f.kv_heads, f.head_dim
        ));
    }
    Ok(())
}

/// The section table must describe what the rest of the header says, inside the file, on page
/// boundaries, without overlaps: a header that passed its checksum but was written by a buggy
/// or hostile program must not make a reader index out of bounds.
fn check_layout(h: &Header) -> std::result::Result<(), String> {
    let kv_bytes = |kind| Some(h.kv_dtype.section_bytes(kind, h.kv_heads * h.tokens, h.head_dim));
    let mut expected =
        vec![(SectionKind::Tokens, None, Some(h.tokens as u64 * 4)), (SectionKind::Documents, None, None)];
    for l in 0..h.layers {
        expected.push((SectionKind::Keys, Some(l), kv_bytes(SectionKind::Keys)));
        expected.push((SectionKind::Values, Some(l), kv_bytes(SectionKind::Values)));
    }
    for (kind, layer, bytes) in expected {
        let s = h.section(kind, layer).ok_or_else(|| format!("the header lacks the {kind:?} section {layer:?}"))?;
        if bytes.is_some_and(|b| b != s.bytes) {
            return Err(format!(
                "section \"{}\" has {} bytes, its shape needs {}",
                s.label(),
                s.bytes,
                bytes.unwrap_or(0)
            ));
        }
    }
    let mut end = PREAMBLE_BYTES;
    let mut sorted: Vec<&Section> = h.sections.iter().collect();
    sorted.sort_by_key(|s| s.offset);
    for s in sorted {
        if s.offset % PAGE != 0 || s.offset < end || s.offset.checked_add(s.bytes).is_none_or(|e| e > h.file_bytes) {
            return Err(format!("section \"{}\" lies outside the file or overlaps another", s.label()));
        }
        end = s.offset + s.bytes;
    }
    Ok(())
}
