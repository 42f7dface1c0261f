//! Quantizing a model's matrices as it loads (`--quantize q8_0|q4k` for a safetensors model,
//! `folio bench --weights`): a 7B model's bf16 weights take 15 GiB of a 24 GiB card, the same
//! weights in Q4_K about 4.4 GiB, and a decode step reads every weight once, so the weights'
//! term of the decode floor shrinks by the same ratio.
//!
//! Only the projections are quantized (q/k/v/o, the MLP, the LM head), as llama.cpp's files
//! do; embeddings and norms stay in the model's dtype. A matrix whose rows are not whole
//! blocks of the type (Q4_K's 256 values) stays plain, and [`Model::weights`] says how many did.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;

use super::proj::Proj;
use super::sources::WeightSource;
use crate::error::{Error, Result};

/// The types Folio quantizes to on load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantize {
    Q8_0,
    Q4K,
}

impl Quantize {
    pub const NAMES: [&'static str; 2] = ["q8_0", "q4k"];

    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "q80" => Ok(Self::Q8_0),
            "q4k" => Ok(Self::Q4K),
            _ => Err(Error::Invalid(format!("quantisation \"{s}\": Folio quantizes to {}", Self::NAMES.join(" or ")))),
        }
    }

    /// The type from its ggml name (`Q8_0`, `Q4_K`), as [`Quantize::name`] writes it.
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Q8_0, Self::Q4K].into_iter().find(|q| q.name() == name)
    }

    /// As `--quantize` spells it.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Q8_0 => Self::NAMES[0],
            Self::Q4K => Self::NAMES[1],
        }
    }

    pub fn dtype(self) -> GgmlDType {
        match self {
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4K => GgmlDType::Q4K,
        }
    }

    /// As ggml names the type (`Q8_0`, `Q4_K`).
    pub fn name(self) -> &'static str {
        crate::gguf::dtype_name(self.dtype())
    }
}

/// Quantized blocks by (projection kind, rows, columns).
type Draws = Mutex<HashMap<(String, usize, usize), Vec<u8>>>;

/// `inner`'s weights with its projections quantized to `to`.
pub struct Quantizing<'a> {
    inner: &'a dyn WeightSource,
    to: GgmlDType,
    /// For random weights only: each projection's blocks quantized once per shape and copied
    /// for every layer (k-quant quantization runs on the CPU, about a minute for a 7B model's
    /// layers; random values' speed and memory are the same whichever they are).
    share: Option<Draws>,
}

impl<'a> Quantizing<'a> {
    pub fn new(inner: &'a dyn WeightSource, to: Quantize) -> Self {
        Self { inner, to: to.dtype(), share: None }
    }

    /// [`Quantizing::new`] for random weights: one draw per projection kind and shape.
    pub fn sharing_draws(inner: &'a dyn WeightSource, to: Quantize) -> Self {
        Self { inner, to: to.dtype(), share: Some(Mutex::new(HashMap::new())) }
    }

    fn quantized(&self, w: &Tensor, bias: Option<Tensor>) -> Result<Proj> {
        Proj::quantized(QTensor::quantize(w, self.to)?, bias, &self.inner.device())
    }

    /// Whether rows of `inp` values are whole blocks of the target type.
    fn fits(&self, inp: usize) -> bool {
        inp.is_multiple_of(self.to.block_size())
    }
}

/// The kind of projection a weight name is (`self_attn.q_proj`), for sharing draws.
fn kind(prefix: &str) -> String {
    prefix.rsplit('.').take(2).collect::<Vec<_>>().join(".")
}

impl WeightSource for Quantizing<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.inner.tensor(name, shape)
    }

    fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Proj> {
        if !self.fits(inp) {
            return self.inner.linear(prefix, out, inp, bias);
        }
        let Some(share) = &self.share else {
            return match self.inner.linear(prefix, out, inp, bias)? {
                Proj::Dense(l) => self.quantized(l.weight(), l.bias().cloned()),
                quant => Ok(quant),
            };
        };
        let key = (kind(prefix), out, inp);
        let drawn = share.lock().map_err(|_| Error::Invalid("a quantizing thread panicked".into()))?.get(&key).cloned();
        let b = if bias { Some(self.inner.tensor(&format!("{prefix}.bias"), &[out])?) } else { None };
        let bytes = match drawn {
            Some(bytes) => bytes,
            None => {
                let w = self.inner.tensor(&format!("{prefix}.weight"), &[out, inp])?;
                let q = QTensor::quantize(&w, self.to)?;
                let bytes = q.data()?.into_owned();
                share
                    .lock()
                    .map_err(|_| Error::Invalid("a quantizing thread panicked".into()))?
                    .insert(key, bytes.clone());
                bytes
            }
        };
        Proj::from_blocks(bytes, self.to, (out, inp), b, &self.inner.device())
    }

    fn tied_head(&self, embed: &Tensor, vocab: usize, hidden: usize) -> Result<Proj> {
        if !self.fits(hidden) {
            return self.inner.tied_head(embed, vocab, hidden);
        }
        self.quantized(embed, None)
    }

    fn device(&self) -> candle_core::Device {
        self.inner.device()
    }
}
