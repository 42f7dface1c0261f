//! Where the decoder's weights come from: memory-mapped safetensors, a GGUF file, or seeded
//! random numbers (`folio bench --shape`). The decoder asks each by Hugging Face name and
//! shape, so one `build` serves all three; a source checks the shape it was asked for.

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;

use super::proj::Proj;
use crate::config::{Arch, ModelConfig};
use crate::error::{Error, Result};
use crate::gguf::{gguf_name, GgufFile, TensorPlace};
use crate::loader::check_safetensors;

pub trait WeightSource {
    /// Tensor `name` of `shape`, in the model's dtype on its device.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor>;

    /// The projection `prefix.weight` (`[out, inp]`) with `prefix.bias` when `bias`.
    fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Proj> {
        let w = self.tensor(&format!("{prefix}.weight"), &[out, inp])?;
        let b = if bias { Some(self.tensor(&format!("{prefix}.bias"), &[out])?) } else { None };
        Ok(Proj::Dense(Linear::new(w, b)))
    }

    /// The LM head of a model whose embeddings are tied: the embedding matrix itself.
    fn tied_head(&self, embed: &Tensor, _vocab: usize, _hidden: usize) -> Result<Proj> {
        Ok(Proj::Dense(Linear::new(embed.clone(), None)))
    }

    /// The device the weights are made on.
    fn device(&self) -> Device;
}

fn check_shape(name: &str, t: Tensor, shape: &[usize], source: &str) -> Result<Tensor> {
    if t.dims() != shape {
        return Err(Error::Invalid(format!("tensor {name} has shape {:?}, {source} implies {shape:?}", t.dims())));
    }
    Ok(t)
}

/// A set of memory-mapped safetensors files, converted to one dtype.
pub struct SafetensorsWeights {
    st: candle_core::safetensors::MmapedSafetensors,
    names: BTreeSet<String>,
    device: Device,
    dtype: DType,
    /// Parameters stored in the checkpoint.
    pub params: usize,
}

impl SafetensorsWeights {
    pub fn open(files: &[impl AsRef<Path>], device: &Device, dtype: DType) -> Result<Self> {
        let mut names = BTreeSet::new();
        let mut params = 0;
        for f in files {
            for (name, n) in check_safetensors(f.as_ref())? {
                params += n;
                names.insert(name);
            }
        }
        // SAFETY: the files are opened read-only and checked above to be complete; Folio does
        // not write model files while they are mapped.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files)? };
        Ok(Self { st, names, device: device.clone(), dtype, params })
    }
}

impl WeightSource for SafetensorsWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if !self.names.contains(name) {
            return Err(Error::MissingTensor { name: name.to_owned() });
        }
        let t = self.st.load(name, &self.device)?.to_dtype(self.dtype)?;
        check_shape(name, t, shape, "config.json")
    }

    fn device(&self) -> Device {
        self.device.clone()
    }
}

/// Seeded normal weights (norms at 1).
pub struct RandomWeights {
    device: Device,
    dtype: DType,
    init_std: f64,
}

impl RandomWeights {
    pub fn new(device: &Device, dtype: DType, init_std: f64) -> Self {
        Self { device: device.clone(), dtype, init_std }
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if name.ends_with("norm.weight") {
            return Ok(Tensor::ones(shape, self.dtype, &self.device)?);
        }
        let seed = xxhash_rust::xxh3::xxh3_64(name.as_bytes());
        let t = if self.device.is_cpu() {
            // candle's CPU generator cannot be seeded: draw from a seeded one here.
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let n = shape.iter().product();
            let x: Vec<f32> = (0..n).map(|_| crate::random::normal(&mut rng) * self.init_std as f32).collect();
            Tensor::from_vec(x, shape, &self.device)?
        } else {
            self.device.set_seed(seed)?;
            Tensor::randn(0f32, self.init_std as f32, shape, &self.device)?
        };
        Ok(t.to_dtype(self.dtype)?)
    }

    fn device(&self) -> Device {
        self.device.clone()
    }
}

/// A GGUF file's tensors under their Hugging Face names.
pub struct GgufWeights<'a> {
    file: &'a GgufFile,
    /// Heads of q and of k, when the file's q/k rows are in llama.cpp's interleaved order.
    permuted: Option<(usize, usize)>,
    device: Device,
    dtype: DType,
}

impl<'a> GgufWeights<'a> {
    pub fn new(file: &'a GgufFile, cfg: &ModelConfig, device: &Device, dtype: DType) -> Self {
        let permuted = (cfg.arch == Arch::Llama).then_some((cfg.num_heads, cfg.num_kv_heads));
        Self { file, permuted, device: device.clone(), dtype }
    }

    /// The GGUF name of `hf`, and the heads to put its rows back in order for.
    fn locate(&self, hf: &str) -> Result<(String, Option<usize>)> {
        let name = gguf_name(hf).ok_or_else(|| Error::MissingTensor { name: hf.to_owned() })?;
        let heads = match self.permuted {
            Some((q, _)) if hf.contains("self_attn.q_proj.") => Some(q),
            Some((_, k)) if hf.contains("self_attn.k_proj.") => Some(k),
            _ => None,
        };
        Ok((name, heads))
    }

    /// Where tensor `gguf` is, checked against the shape the metadata implies.
    fn place(&self, gguf: &str, shape: &[usize]) -> Result<&TensorPlace> {
        let place = self.file.tensor(gguf).ok_or_else(|| Error::MissingTensor { name: gguf.to_owned() })?;
        if place.dims != shape {
            return Err(self
                .file
                .error(format!("tensor {gguf} has shape {:?}, the file's metadata implies {shape:?}", place.dims)));
        }
        Ok(place)
    }

    /// Tensor `gguf` read onto the device, checked against the shape the metadata implies.
    fn read(&self, gguf: &str, heads: Option<usize>, shape: &[usize]) -> Result<candle_core::quantized::QTensor> {
        self.place(gguf, shape)?;
        self.file.read_tensor_rows(gguf, heads, &self.device)
    }

    /// `gguf` as a projection: quantized types stay quantized, their bytes read once and placed
    /// where their kernel reads them ([`Proj::from_blocks`]).
    fn projection(&self, gguf: &str, heads: Option<usize>, shape: &[usize], bias: Option<Tensor>) -> Result<Proj> {
        if matches!(self.place(gguf, shape)?.dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            let w = self.read(gguf, heads, shape)?.dequantize(&self.device)?.to_dtype(self.dtype)?;
            return Ok(Proj::Dense(Linear::new(w, bias)));
        }
        let (bytes, place) = self.file.tensor_rows_bytes(gguf, heads)?;
        Proj::from_blocks(bytes, place.dtype, (shape[0], shape[1]), bias, &self.device)
    }
}

impl WeightSource for GgufWeights<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let (gguf, heads) = self.locate(name)?;
        Ok(self.read(&gguf, heads, shape)?.dequantize(&self.device)?.to_dtype(self.dtype)?)
    }

    fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Proj> {
        let (gguf, heads) = self.locate(&format!("{prefix}.weight"))?;
        let b = if bias { Some(self.tensor(&format!("{prefix}.bias"), &[out])?) } else { None };
        self.projection(&gguf, heads, &[out, inp], b)
    }

    /// A quantized embedding table multiplies the head as stored; a float one is the table
    /// already loaded (one copy, as for safetensors).
    fn tied_head(&self, embed: &Tensor, vocab: usize, hidden: usize) -> Result<Proj> {
        match self.file.tensor("token_embd.weight").map(|t| t.dtype) {
            Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => {
                Ok(Proj::Dense(Linear::new(embed.clone(), None)))
            }
            _ => self.projection("token_embd.weight", None, &[vocab, hidden], None),
        }
    }

    fn device(&self) -> Device {
        self.device.clone()
    }
}
