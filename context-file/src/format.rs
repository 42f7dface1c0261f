//! The context file's bytes: a fixed preamble, a JSON header, and page-aligned sections.
//! docs/context-file.md is the full specification; this module is its single implementation.
//!
//! ```text
//! 0      magic "FOLIOCTX" | format version u32 | reserved u32 | header length u64 | header xxh3 u64
//! 32     header (UTF-8 JSON): model fingerprint, KV shape and dtype, prompt, section table
//! page   section 0 (token ids, u32 LE) | section 1 (document spans, JSON) | keys/values per layer | …
//! ```
//!
//! Why JSON for the header: it is a few kilobytes read once per open, it stays readable with
//! `head -c`, and serde gives versioned, validated parsing for free; everything large is a
//! binary section addressed by the header. Every section carries its own xxh3-64 checksum so a
//! damaged byte is reported as *which* section is damaged, and so a reader that only touches a
//! few sections (opening a context reads the tokens and spans, not gigabytes of K/V) verifies
//! just those.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::codec::Codec;
use crate::error::{Error, Result};

pub const MAGIC: [u8; 8] = *b"FOLIOCTX";
pub const FORMAT_VERSION: u32 = 3;
/// The oldest version this Folio opens. Version 2 added document parts (pages, chapters,
/// sections) to the document table; a version 1 file is a version 2 file without them.
/// Version 3 added the record of which prefill computed which tokens ([`Header::prefill`]);
/// every earlier file was prefilled densely.
pub const OLDEST_READABLE_VERSION: u32 = 1;
/// Bytes before the header: magic, version, reserved, header length, header checksum.
pub const PREAMBLE_BYTES: u64 = 32;
/// Section alignment: sections start on page boundaries so each can be memory-mapped and
/// read without touching its neighbours.
pub const PAGE: u64 = 4096;
/// Width of a checksum in the header: fixed, so filling the checksums in at the end of a
/// prefill never changes the header's length (and so the layout chosen at its start).
const CHECKSUM_HEX: usize = 16;

/// Section checksum as it appears in the header.
pub fn checksum(bytes: &[u8]) -> String {
    checksum_hex(xxh3_64(bytes))
}

/// [`checksum`] of `len` bytes of `file` at `offset`, read a block at a time (a 7B model's layer
/// section is a GiB at 1M tokens).
pub fn file_checksum(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<String> {
    use crate::platform::PositionalIo;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; HASH_BLOCK_BYTES.min(len as usize)];
    let mut at = 0;
    while at < len {
        let n = buf.len().min((len - at) as usize);
        file.read_exact_at(&mut buf[..n], offset + at)?;
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(checksum_hex(h.digest()))
}

/// Bytes read at a time by [`file_checksum`]: a buffer per thread when the file tier verifies
/// every section at once, so small beside a budget the file tier exists for.
const HASH_BLOCK_BYTES: usize = 8 << 20;

/// [`checksum`]'s text of an xxh3-64 digest (of bytes hashed in pieces).
pub fn checksum_hex(digest: u64) -> String {
    format!("{digest:0width$x}", width = CHECKSUM_HEX)
}

/// What a model is, as far as the K/V it produces is concerned. Two models with equal
/// fingerprints produce the same K/V for the same tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub architecture: String,
    pub layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f64,
    pub rope_scaling: serde_json::Value,
    pub sliding_window: Option<usize>,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// xxh3-64 of tokenizer.json.
    pub tokenizer: String,
    /// xxh3-64 of the safetensors headers and sampled weight bytes (the engine's loader computes it).
    pub weights: String,
    /// A GGUF model's quantisation (`Q4_K_M`), so that a context made with other weights of the
    /// same model names both; absent for safetensors models and in files from before it existed
    /// (which therefore still match their model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
}

impl Fingerprint {
    /// Names and values of the fields where `self` and `other` differ (a field only one of them
    /// has differs too).
    pub fn differences(&self, other: &Self) -> Vec<String> {
        let (a, b) = (serde_json::to_value(self).unwrap_or_default(), serde_json::to_value(other).unwrap_or_default());
        let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else { return vec!["unreadable".into()] };
        // Both sides' keys: a field one side omits (`quantization` of plain weights) differs too.
        let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        let none = serde_json::Value::Null;
        keys.into_iter()
            .map(|k| (k, a.get(k).unwrap_or(&none), b.get(k).unwrap_or(&none)))
            .filter(|(_, x, y)| x != y)
            .map(|(k, x, y)| format!("{k} {x} vs {y}"))
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelStamp {
    /// Display name of the model that made the file (a folder name or repo id).
    pub name: String,
    /// How it was loaded (`--model` as given), so `folio chat --context` can find it again.
    pub source: String,
    pub fingerprint: Fingerprint,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptKind {
    /// Documents inside the first user message of the model's chat template.
    Chat,
    /// No template: BOS (per the model) and the documents.
    Raw,
}

/// How the saved tokens were laid out, so a question can be appended consistently.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptStamp {
    pub kind: PromptKind,
    /// Rendered template text before the documents (chat), or "" (raw).
    pub head: String,
    pub system: Option<String>,
    /// `date_string` the template was rendered with (templates that print today's date).
    pub date: String,
    /// Template each document was wrapped with (`{title}`, `{path}`, `{text}`).
    pub document_template: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SectionKind {
    /// Token ids, u32 little-endian.
    Tokens,
    /// Document span table, JSON.
    Documents,
    /// Post-RoPE keys of one layer: `[kv_heads, tokens, head_dim]` in the KV dtype.
    Keys,
    /// Values of one layer, same layout.
    Values,
    /// An attention method's index of one layer (`folio context index`); readers skip names
    /// they do not know.
    Index,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub kind: SectionKind,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub layer: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub name: Option<String>,
    pub offset: u64,
    pub bytes: u64,
    pub xxh3: String,
}

impl Section {
    /// Human name used in messages: "tokens", "keys of layer 3".
    pub fn label(&self) -> String {
        match (self.kind, self.layer, &self.name) {
            (SectionKind::Keys, Some(l), _) => format!("keys of layer {l}"),
            (SectionKind::Values, Some(l), _) => format!("values of layer {l}"),
            (SectionKind::Index, Some(l), Some(n)) => format!("index {n} of layer {l}"),
            (SectionKind::Index, None, Some(n)) => format!("index {n}"),
            (kind, _, _) => format!("{kind:?}").to_lowercase(),
        }
    }
}

/// One document's place in the context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DocumentSpan {
    pub title: String,
    pub path: String,
    /// Token range `start..end` of the wrapped document in the context.
    pub start: usize,
    pub end: usize,
    /// Size and xxh3-64 of the source text, to tell later whether the file changed.
    pub bytes: u64,
    pub xxh3: String,
    /// What the reader took it for ("PDF", "Markdown", "text"…), as staging named it; empty in
    /// files made before it was kept (the library then names it by its extension).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kind: String,
    /// Where the document's pages, chapters or sections start, in order (none for plain
    /// text, and in files of format version 1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<SpanPart>,
}

/// A part of a document in the context: "p. 12", a chapter's or a section's title.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpanPart {
    pub label: String,
    /// Context position of its first token.
    pub start: usize,
}

impl DocumentSpan {
    /// The label of the part holding context position `position`, if the document has parts.
    pub fn part_at(&self, position: usize) -> Option<&str> {
        self.parts.iter().rev().find(|p| p.start <= position).map(|p| p.label.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub model: ModelStamp,
    pub kv_dtype: KvDtype,
    pub tokens: usize,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub prompt: PromptStamp,
    /// Which prefill computed which tokens, in order, covering them all (a grown context can
    /// mix); empty in files before version 3, which were prefilled densely ([`Header::prefill_runs`]).
    #[serde(default)]
    pub prefill: Vec<PrefillRun>,
    pub file_bytes: u64,
    pub sections: Vec<Section>,
}

/// How the prefill attended for context positions `from..to` ([`Header::prefill`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillRun {
    pub from: usize,
    pub to: usize,
    /// `dense`, or `sparse:` and its knobs (docs/engine.md, "Sparse prefill").
    pub mode: String,
}

/// [`PrefillRun::mode`] of a prefill that attended to every earlier key.
pub const DENSE_PREFILL: &str = "dense";

impl Header {
    /// A header with its section table laid out: tokens, documents, then keys and values of
    /// each layer, page-aligned after a header region large enough for the JSON. Checksums are
    /// placeholders until the sections are written.
    pub fn new(
        model: ModelStamp,
        kv_dtype: KvDtype,
        tokens: usize,
        documents_bytes: u64,
        (layers, kv_heads, head_dim): (usize, usize, usize),
        prompt: PromptStamp,
    ) -> Self {
        let blank = "0".repeat(CHECKSUM_HEX);
        let mut sections = vec![
            Section {
                kind: SectionKind::Tokens,
                layer: None,
                name: None,
                offset: 0,
                bytes: tokens as u64 * 4,
                xxh3: blank.clone(),
            },
            Section {
                kind: SectionKind::Documents,
                layer: None,
                name: None,
                offset: 0,
                bytes: documents_bytes,
                xxh3: blank.clone(),
            },
        ];
        for layer in 0..layers {
            for kind in [SectionKind::Keys, SectionKind::Values] {
                sections.push(Section {
                    kind,
                    layer: Some(layer),
                    name: None,
                    offset: 0,
                    bytes: kv_dtype.section_bytes(kind, kv_heads * tokens, head_dim),
                    xxh3: blank.clone(),
                });
            }
        }
        let prefill = vec![PrefillRun { from: 0, to: tokens, mode: DENSE_PREFILL.into() }];
        let mut header =
            Self { model, kv_dtype, tokens, layers, kv_heads, head_dim, prompt, prefill, file_bytes: 0, sections };
        header.lay_out();
        header
    }

    /// Which prefill computed which tokens: the record, or for a file from before it (version
    /// 1 or 2) one dense run over every token.
    pub fn prefill_runs(&self) -> Vec<PrefillRun> {
        if self.prefill.is_empty() {
            return vec![PrefillRun { from: 0, to: self.tokens, mode: DENSE_PREFILL.into() }];
        }
        self.prefill.clone()
    }

    /// Records that positions `from..` (to the end) were computed by a prefill of `mode`,
    /// after the record's runs before `from` (a grown or changed context keeps its first
    /// `from` tokens as they were made); runs of one mode side by side are joined. Lays the
    /// sections out again (the header's length changed): before anything is written.
    pub fn record_prefill(&mut self, kept: &[PrefillRun], from: usize, mode: &str) {
        let mut runs: Vec<PrefillRun> =
            kept.iter().filter(|r| r.from < from).map(|r| PrefillRun { to: r.to.min(from), ..r.clone() }).collect();
        match runs.last_mut() {
            Some(last) if last.mode == mode => last.to = self.tokens,
            _ => runs.push(PrefillRun { from, to: self.tokens, mode: mode.into() }),
        }
        self.prefill = runs;
        self.lay_out();
    }

    /// Places the sections, in table order, page-aligned after the header. Offsets change the
    /// header's length (their digits), which can move the data start: lay out until the header
    /// fits in front of the first section.
    pub fn lay_out(&mut self) {
        let mut data_start = PAGE;
        loop {
            let mut at = data_start;
            for s in &mut self.sections {
                s.offset = at;
                at = (at + s.bytes).next_multiple_of(PAGE);
            }
            self.file_bytes = self.sections.last().map_or(at, |s| s.offset + s.bytes);
            let need = (PREAMBLE_BYTES + self.to_json().len() as u64).next_multiple_of(PAGE);
            if need <= data_start {
                return;
            }
            data_start = need;
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a header always serialises")
    }

    /// Preamble and header bytes, to be written at offset 0.
    pub fn encode(&self) -> Vec<u8> {
        let json = self.to_json();
        let mut out = Vec::with_capacity(PREAMBLE_BYTES as usize + json.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&xxh3_64(&json).to_le_bytes());
        out.extend_from_slice(&json);
        out
    }

    pub fn section(&self, kind: SectionKind, layer: Option<usize>) -> Option<&Section> {
        self.sections.iter().find(|s| s.kind == kind && s.layer == layer)
    }
}

/// A context file's K/V storage (its header's `kv_dtype`): a codec for the keys and one for the
/// values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvDtype {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "fp8")]
    Fp8,
    /// Keys in bf16, values in fp8.
    #[serde(rename = "bf16-fp8")]
    Bf16Fp8,
}

impl KvDtype {
    pub const NAMES: [&'static str; 4] = ["bf16", "bf16-fp8", "fp8", "f32"];

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "fp8" | "fp8-e4m3" => Ok(Self::Fp8),
            "bf16-fp8" => Ok(Self::Bf16Fp8),
            _ => Err(Error::Invalid(format!(
                "bad KV dtype \"{s}\": use bf16 (default), bf16-fp8 (bf16 keys, fp8 values: about 3/4 the \
                 size, nearly bf16's accuracy), fp8 (e4m3 with a scale per row: half the size) or f32"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
            Self::Bf16Fp8 => "bf16-fp8",
        }
    }

    /// The codec of a `Keys` or a `Values` section (the only kinds that hold K/V rows).
    pub fn codec(self, kind: SectionKind) -> Codec {
        debug_assert!(matches!(kind, SectionKind::Keys | SectionKind::Values), "{kind:?} holds no K/V rows");
        match (self, kind) {
            (Self::F32, _) => Codec::F32,
            (Self::Bf16, _) | (Self::Bf16Fp8, SectionKind::Keys) => Codec::Bf16,
            (Self::Fp8, _) | (Self::Bf16Fp8, _) => Codec::Fp8,
        }
    }

    /// Bytes of a `kind` section holding `rows` rows of `head_dim` values.
    pub fn section_bytes(self, kind: SectionKind, rows: usize, head_dim: usize) -> u64 {
        self.codec(kind).section_bytes(rows, head_dim)
    }

    /// Bytes of a layer's K and V sections together, `rows` rows each.
    pub fn kv_bytes(self, rows: usize, head_dim: usize) -> u64 {
        self.section_bytes(SectionKind::Keys, rows, head_dim) + self.section_bytes(SectionKind::Values, rows, head_dim)
    }

    /// The larger of a layer's K and V sections (what one section's buffer must hold).
    pub fn max_section_bytes(self, rows: usize, head_dim: usize) -> u64 {
        [SectionKind::Keys, SectionKind::Values]
            .map(|k| self.section_bytes(k, rows, head_dim))
            .into_iter()
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_dtypes_parse_and_name_their_codecs() {
        assert!(KvDtype::parse("int4").unwrap_err().to_string().contains("bf16-fp8"));
        // The mixed dtype: bf16 keys, fp8 values; every name parses back to itself.
        assert_eq!(KvDtype::Bf16Fp8.codec(SectionKind::Keys), Codec::Bf16);
        assert_eq!(KvDtype::Bf16Fp8.codec(SectionKind::Values), Codec::Fp8);
        assert!(KvDtype::NAMES.iter().all(|n| KvDtype::parse(n).unwrap().name() == *n));
    }

    /// A new header records a dense prefill of every token; a grown context keeps its runs
    /// before the kept tokens' end and adds its own, joining runs of one mode; a header
    /// without the record (versions 1 and 2) reads as dense; the layout follows the record.
    #[test]
    fn the_prefill_record_grows_and_old_headers_read_dense() {
        let fingerprint: Fingerprint = serde_json::from_value(serde_json::json!({
            "architecture": "llama", "layers": 2, "hidden_size": 64, "intermediate_size": 128, "heads": 4,
            "kv_heads": 2, "head_dim": 16, "vocab_size": 100, "rope_theta": 1e4, "rope_scaling": null,
            "sliding_window": null, "qkv_bias": false, "qk_norm": false, "tokenizer": "t", "weights": "w"
        }))
        .unwrap();
        let model = ModelStamp { name: "m".into(), source: "m".into(), fingerprint };
        let prompt = PromptStamp {
            kind: PromptKind::Raw,
            head: String::new(),
            system: None,
            date: String::new(),
            document_template: "{text}".into(),
        };
        let header = |tokens| Header::new(model.clone(), KvDtype::Bf16, tokens, 10, (2, 2, 16), prompt.clone());
        let run = |from, to, mode: &str| PrefillRun { from, to, mode: mode.into() };
        let first = header(100);
        assert_eq!(first.prefill_runs(), [run(0, 100, DENSE_PREFILL)]);
        let sparse = "sparse:block=64,keys=2048,sinks=64,window=1024";
        let mut grown = header(250);
        grown.record_prefill(&first.prefill_runs(), 100, sparse);
        assert_eq!(grown.prefill_runs(), [run(0, 100, DENSE_PREFILL), run(100, 250, sparse)]);
        let mut layout = grown.clone();
        layout.lay_out();
        assert_eq!(layout, grown, "the record is laid out");
        // A document taken out at 180 and the rest prefilled sparsely again: one sparse run.
        let mut changed = header(220);
        changed.record_prefill(&grown.prefill_runs(), 180, sparse);
        assert_eq!(changed.prefill_runs(), [run(0, 100, DENSE_PREFILL), run(100, 220, sparse)]);
        let mut old = serde_json::to_value(&first).unwrap();
        old.as_object_mut().unwrap().remove("prefill");
        let old: Header = serde_json::from_value(old).unwrap();
        assert!(old.prefill.is_empty());
        assert_eq!(old.prefill_runs(), [run(0, 100, DENSE_PREFILL)]);
    }

    /// A field one fingerprint has and the other lacks is a difference (an old file's model
    /// has no `quantization`; one loaded with `--quantize` has): nothing is appended across it.
    #[test]
    fn a_field_only_one_side_has_differs() {
        let plain = Fingerprint {
            architecture: "qwen2".into(),
            layers: 2,
            hidden_size: 64,
            intermediate_size: 128,
            heads: 4,
            kv_heads: 4,
            head_dim: 16,
            vocab_size: 593,
            rope_theta: 1e6,
            rope_scaling: serde_json::json!({"rope_type": "default"}),
            sliding_window: None,
            qkv_bias: true,
            qk_norm: false,
            tokenizer: "t".into(),
            weights: "w".into(),
            quantization: None,
        };
        let quantized = Fingerprint { quantization: Some("Q8_0 (quantized on load)".into()), ..plain.clone() };
        assert_eq!(plain.differences(&quantized), ["quantization null vs \"Q8_0 (quantized on load)\""]);
        assert_eq!(quantized.differences(&plain), ["quantization \"Q8_0 (quantized on load)\" vs null"]);
        assert!(plain.differences(&plain.clone()).is_empty());
        // An old file's header (no such key) reads as None.
        let old = serde_json::to_value(&plain).unwrap();
        assert!(old.get("quantization").is_none());
        assert_eq!(serde_json::from_value::<Fingerprint>(old).unwrap(), plain);
    }
}
