//! GGUF model files (llama.cpp's format): what LM Studio, Jan, GPT4All and Ollama keep on disk.
//!
//! One `.gguf` holds everything a Hugging Face folder spreads over several files: the
//! hyper-parameters as `{arch}.*` metadata ([`config`]), the vocabulary, merges and chat
//! template as `tokenizer.*` metadata ([`vocab`]), and the tensors, quantized or not
//! ([`tensors`]). Folio reads the architectures its decoder implements (llama — which
//! llama.cpp's converter also uses for Mistral —, qwen2, qwen3) into the same [`ModelConfig`]
//! and the same decoder as safetensors; quantized matrices stay quantized and multiply through
//! folio-kernels' quantized kernels on CUDA ([`kernel_format`]) and candle's `QMatMul` on the CPU.
//!
//! Why parse with candle's `gguf_file` and check again here: candle bounds every length it
//! reads, but a person needs to hear *which* thing is wrong — a file cut short, a quantisation
//! type Folio cannot multiply (IQ4_XS, …), tensors that claim more bytes than the file holds —
//! so [`GgufFile::open`] turns its failures into [`Error::Gguf`] messages and checks every
//! tensor's extent before anything is mapped.

pub mod config;
pub mod scan;
mod spm;
pub mod tensors;
pub mod vocab;

pub use crate::loader::{is_gguf, GGUF_EXTENSION as EXTENSION};
pub use tensors::gguf_name;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;

use crate::error::{Error, Result};

/// ggml's tensor type numbers (ggml.h) and names, for the types candle cannot multiply too, so
/// that a file holding one is refused by its name.
const GGML_TYPE_NAMES: [(u32, &str); 32] = [
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

/// `general.file_type` values (llama.cpp's `llama_ftype`): the quantisation a file was made
/// with, as people name it (a "Q4_K_M" file mixes Q4_K and Q6_K tensors).
const FILE_TYPE_NAMES: [(u32, &str); 19] = [
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (7, "Q8_0"),
    (8, "Q5_0"),
    (9, "Q5_1"),
    (10, "Q2_K"),
    (11, "Q3_K_S"),
    (12, "Q3_K_M"),
    (13, "Q3_K_L"),
    (14, "Q4_K_S"),
    (15, "Q4_K_M"),
    (16, "Q5_K_S"),
    (17, "Q5_K_M"),
    (18, "Q6_K"),
    (30, "IQ4_XS"),
    (32, "BF16"),
    (38, "MXFP4_MOE"),
];

/// What candle says when a tensor's type number is not one it reads.
const CANDLE_UNKNOWN_TYPE: &str = "unknown dtype for tensor ";

/// A type's name from its ggml number.
fn ggml_type_name(id: u32) -> String {
    GGML_TYPE_NAMES.iter().find(|(n, _)| *n == id).map_or_else(|| format!("type {id}"), |(_, s)| (*s).to_owned())
}

/// A candle type's name as ggml writes it.
pub fn dtype_name(dtype: GgmlDType) -> &'static str {
    match dtype {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

/// The format of folio-kernels' quantized kernels for a ggml type, when it has one: the types
/// GGUF files are made of (Q4_0, Q8_0, and the Q4_K, Q5_K, Q6_K of the K-quant mixes).
pub fn kernel_format(dtype: GgmlDType) -> Option<folio_kernels::quant::BlockFormat> {
    use folio_kernels::quant::BlockFormat;
    match dtype {
        GgmlDType::Q4_0 => Some(BlockFormat::Q4_0),
        GgmlDType::Q8_0 => Some(BlockFormat::Q8_0),
        GgmlDType::Q4K => Some(BlockFormat::Q4K),
        GgmlDType::Q5K => Some(BlockFormat::Q5K),
        GgmlDType::Q6K => Some(BlockFormat::Q6K),
        _ => None,
    }
}

/// What a person is told about a GGUF's weights (`folio info`, the window's model facts).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Quantization {
    /// The file's quantisation as people name it (`Q4_K_M`), from `general.file_type`, else
    /// the type holding most of the weights' bytes.
    pub name: String,
    /// Bits per weight over every tensor (block scales included).
    pub bits_per_weight: f64,
    /// The tensors' bytes: what the weights take in memory, quantized as they are.
    #[cfg_attr(feature = "ts", ts(type = "number"))]
    pub weight_bytes: u64,
    /// How many tensors of each type the file holds (`Q4_K: 96, Q6_K: 17, F32: 49`).
    pub tensor_types: BTreeMap<String, usize>,
}

/// One tensor's place in the file, checked to lie inside it.
#[derive(Debug, Clone)]
pub struct TensorPlace {
    pub dtype: GgmlDType,
    /// Row-major dims (`[rows, cols]` for a matrix), as candle reads them.
    pub dims: Vec<usize>,
    /// Absolute byte offset of the data and its length.
    pub start: u64,
    pub bytes: u64,
}

/// A parsed, checked GGUF file: metadata and the places of its tensors.
pub struct GgufFile {
    path: PathBuf,
    metadata: std::collections::HashMap<String, Value>,
    tensors: BTreeMap<String, TensorPlace>,
}

impl GgufFile {
    /// Reads and checks `path`'s header: a GGUF, not cut short, every tensor of a type Folio
    /// multiplies and inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut reader = std::io::BufReader::new(file);
        // candle divides by the header's alignment, which a damaged file may give as 0: a panic
        // in its reader is this file's error, not the app's end.
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut reader)));
        let content = match read {
            Ok(read) => read.map_err(|e| header_error(path, len, &e))?,
            Err(_) => return Err(gguf_error(path, "its header is damaged (a reader of it failed)".into())),
        };
        let mut tensors = BTreeMap::new();
        for (name, info) in &content.tensor_infos {
            let dims = info.shape.dims().to_vec();
            let too_big =
                || gguf_error(path, format!("tensor {name} claims {dims:?} values, more than any file holds"));
            let elems = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(too_big)?;
            let block = info.ggml_dtype.block_size();
            if !elems.is_multiple_of(block) {
                return Err(gguf_error(
                    path,
                    format!(
                        "tensor {name} has {elems} values, not a whole number of {} blocks of {block}",
                        dtype_name(info.ggml_dtype)
                    ),
                ));
            }
            let bytes = (elems / block).checked_mul(info.ggml_dtype.type_size()).ok_or_else(too_big)? as u64;
            let start = content.tensor_data_offset.saturating_add(info.offset);
            tensors.insert(name.clone(), TensorPlace { dtype: info.ggml_dtype, dims, start, bytes });
        }
        let needed = tensors.values().map(|t| t.start.saturating_add(t.bytes)).max().unwrap_or(0);
        if needed > len {
            let (name, _) = tensors.iter().max_by_key(|(_, t)| t.start.saturating_add(t.bytes)).expect("a tensor");
            return Err(gguf_error(
                path,
                format!(
                    "the file is {len} bytes but its tensors claim {needed} (tensor {name} ends past the end): it is \
                     truncated — an interrupted download or copy — or damaged; download or copy it again"
                ),
            ));
        }
        Ok(Self { path: path.to_owned(), metadata: content.metadata, tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorPlace> {
        self.tensors.get(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A string value, or `None` when absent; an error when present as another type.
    pub fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.error(format!("metadata {key} is {:?}, not a string", v.value_type()))),
        }
    }

    /// An integer value of any width, or `None` when absent.
    pub fn uint(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.metadata.get(key) else { return Ok(None) };
        let n = match v {
            Value::U8(x) => Some(*x as u64),
            Value::U16(x) => Some(*x as u64),
            Value::U32(x) => Some(*x as u64),
            Value::U64(x) => Some(*x),
            Value::I8(x) => u64::try_from(*x).ok(),
            Value::I16(x) => u64::try_from(*x).ok(),
            Value::I32(x) => u64::try_from(*x).ok(),
            Value::I64(x) => u64::try_from(*x).ok(),
            _ => None,
        };
        n.map(Some).ok_or_else(|| self.error(format!("metadata {key} is {v:?}, not a count")))
    }

    /// A float value (f32 or f64), or `None` when absent.
    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x as f64)),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(self.error(format!("metadata {key} is {v:?}, not a number"))),
        }
    }

    /// An error about this file.
    pub fn error(&self, msg: String) -> Error {
        gguf_error(&self.path, msg)
    }

    /// The weights' quantisation, their bits per weight and bytes.
    pub fn quantization(&self) -> Quantization {
        let mut tensor_types = BTreeMap::new();
        let mut bytes_by_type = BTreeMap::<&str, u64>::new();
        let (mut bytes, mut elems) = (0u64, 0u64);
        for t in self.tensors.values() {
            *tensor_types.entry(dtype_name(t.dtype).to_owned()).or_insert(0) += 1;
            *bytes_by_type.entry(dtype_name(t.dtype)).or_insert(0) += t.bytes;
            bytes += t.bytes;
            elems += t.dims.iter().product::<usize>() as u64;
        }
        let named = self
            .uint("general.file_type")
            .ok()
            .flatten()
            .and_then(|ft| FILE_TYPE_NAMES.iter().find(|(n, _)| u64::from(*n) == ft).map(|(_, s)| (*s).to_owned()));
        let most = bytes_by_type.iter().max_by_key(|(_, b)| **b).map(|(n, _)| (*n).to_owned());
        Quantization {
            name: named.or(most).unwrap_or_else(|| "none".into()),
            bits_per_weight: if elems == 0 { 0.0 } else { 8.0 * bytes as f64 / elems as f64 },
            weight_bytes: bytes,
            tensor_types,
        }
    }
}

/// A fingerprint of a GGUF's weights that costs milliseconds: the xxh3 of its length and 64
/// blocks of 4 KiB spread over it (the first holds the header). Two quantisations or two
/// fine-tunes of one model differ in it, as `loader::weights_hash` for safetensors.
pub fn file_hash(path: &Path) -> Result<String> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&len.to_le_bytes());
    crate::loader::hash_spread(&mut h, &file, path, 0, len)?;
    Ok(folio_context_file::format::checksum_hex(h.digest()))
}

fn gguf_error(path: &Path, msg: String) -> Error {
    Error::Gguf { path: path.to_owned(), msg }
}

/// candle's reading failure in a person's words.
fn header_error(path: &Path, len: u64, e: &candle_core::Error) -> Error {
    // The first line: candle appends a backtrace to some errors when RUST_BACKTRACE is set.
    let full = e.to_string();
    let text = full.lines().next().unwrap_or_default();
    if let Some(id) = text.strip_prefix(CANDLE_UNKNOWN_TYPE).and_then(|n| n.trim().parse::<u32>().ok()) {
        let supported: Vec<&str> = GGML_TYPE_NAMES
            .iter()
            .filter(|(n, _)| candle_reads(*n))
            .map(|(_, s)| *s)
            .filter(|s| !s.starts_with("Q8_K") && !s.starts_with("Q8_1"))
            .collect();
        return gguf_error(
            path,
            format!(
                "a tensor is quantized as {}, which Folio cannot read; Folio reads {} — use a file of one of those \
                 quantisations (Q4_K_M is the common choice)",
                ggml_type_name(id),
                supported.join(", ")
            ),
        );
    }
    if text.contains("unknown magic") || text.contains("unsupported magic") {
        return gguf_error(path, format!("not a GGUF model file (its first bytes are not GGUF's): {text}"));
    }
    let cut = matches!(e, candle_core::Error::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof)
        || text.contains("remaining");
    if cut {
        return gguf_error(
            path,
            format!(
                "the file ends inside its header ({len} bytes): it is truncated — an interrupted download or copy — \
                 download or copy it again"
            ),
        );
    }
    gguf_error(path, format!("not a readable GGUF file: {text}"))
}

/// Whether candle reads ggml type number `id`.
fn candle_reads(id: u32) -> bool {
    matches!(id, 0..=3 | 6..=15 | 30)
}
