//! A GGUF's `{arch}.*` metadata → the [`ModelConfig`] the decoder runs.
//!
//! llama.cpp's converter writes the hyper-parameters under the architecture's name and leaves
//! out what the tensors themselves say; so the flags config.json states are read off the
//! tensors here: q/k/v biases (`blk.0.attn_q.bias`), q/k norms (`blk.0.attn_q_norm.weight`),
//! tied embeddings (no `output.weight`), Llama 3's RoPE rule (a `rope_freqs.weight` tensor of
//! per-frequency divisors instead of its four numbers).

use candle_core::Device;

use super::GgufFile;
use crate::config::{Arch, ModelConfig, RopeScaling};
use crate::error::Result;

/// The `general.architecture` values Folio reads, and the decoder family of each. llama.cpp's
/// converter writes Mistral (7B, Nemo's decoder) as `llama`: the same tensors and RoPE, no
/// sliding window (llama.cpp does not apply one to it either).
pub const ARCHITECTURES: [(&str, Arch); 3] = [("llama", Arch::Llama), ("qwen2", Arch::Qwen2), ("qwen3", Arch::Qwen3)];

/// RoPE base when `{arch}.rope.freq_base` is absent (llama.cpp's default).
const DEFAULT_ROPE_BASE: f64 = 10_000.0;
/// RMSNorm epsilon when absent (llama.cpp's default for these architectures).
const DEFAULT_RMS_EPS: f64 = 1e-5;

impl GgufFile {
    /// The architecture's metadata prefix, checked to be one Folio reads.
    pub fn architecture(&self) -> Result<(&str, Arch)> {
        let name = self.string("general.architecture")?.ok_or_else(|| {
            self.error("no general.architecture in its metadata: not a model file llama.cpp's converter wrote".into())
        })?;
        ARCHITECTURES.iter().find(|(n, _)| *n == name).map(|(n, a)| (*n, *a)).ok_or_else(|| {
            self.error(format!(
                "architecture \"{name}\" is not one Folio runs; Folio reads GGUF files of {} (Llama, Mistral, Qwen2/2.5, \
                 Qwen3)",
                ARCHITECTURES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ))
        })
    }

    /// The decoder's configuration from the metadata and the tensors present.
    pub fn config(&self) -> Result<ModelConfig> {
        let (prefix, arch) = self.architecture()?;
        let need = |key: &str| -> Result<usize> {
            let full = format!("{prefix}.{key}");
            self.uint(&full)?.map(|n| n as usize).ok_or_else(|| self.error(format!("metadata {full} is missing")))
        };
        let hidden_size = need("embedding_length")?;
        let num_heads = need("attention.head_count")?;
        let num_kv_heads = self.uint(&format!("{prefix}.attention.head_count_kv"))?.map_or(num_heads, |n| n as usize);
        let head_dim = self
            .uint(&format!("{prefix}.attention.key_length"))?
            .map_or(hidden_size / num_heads.max(1), |n| n as usize);
        let vocab_size = match self.uint(&format!("{prefix}.vocab_size"))? {
            Some(n) => n as usize,
            None => self.token_embd_rows()?,
        };
        let rope_theta = self.float(&format!("{prefix}.rope.freq_base"))?.unwrap_or(DEFAULT_ROPE_BASE);
        let (bos, eos) = self.special_ids()?;
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: need("feed_forward_length")?,
            num_layers: need("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings: need("context_length")?,
            rms_norm_eps: self.float(&format!("{prefix}.attention.layer_norm_rms_epsilon"))?.unwrap_or(DEFAULT_RMS_EPS),
            rope_theta,
            rope_scaling: self.rope_scaling(prefix, head_dim)?,
            tie_word_embeddings: self.tensor("output.weight").is_none(),
            qkv_bias: self.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm: self.tensor("blk.0.attn_q_norm.weight").is_some(),
            sliding_window: None,
            bos_token_id: bos,
            eos_token_ids: eos,
            saved_dtype: Some(self.quantization().name),
        };
        cfg.check_shape().map_err(|msg| self.error(msg))?;
        Ok(cfg)
    }

    fn token_embd_rows(&self) -> Result<usize> {
        self.tensor("token_embd.weight")
            .and_then(|t| t.dims.first().copied())
            .ok_or_else(|| self.error("no token_embd.weight tensor and no vocab_size in its metadata".into()))
    }

    /// `{arch}.rope.scaling.*`, or a `rope_freqs.weight` tensor's divisors (Llama 3's rule).
    fn rope_scaling(&self, prefix: &str, head_dim: usize) -> Result<RopeScaling> {
        if let Some(place) = self.tensor("rope_freqs.weight") {
            if place.dims.iter().product::<usize>() != head_dim / 2 {
                return Err(self.error(format!(
                    "rope_freqs.weight has shape {:?}, the head size {head_dim} implies [{}]",
                    place.dims,
                    head_dim / 2
                )));
            }
            let t = self.read_tensor("rope_freqs.weight", &Device::Cpu)?.dequantize(&Device::Cpu)?;
            let factors = t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f64::from).collect();
            return Ok(RopeScaling::Factors { factors });
        }
        match self.string(&format!("{prefix}.rope.scaling.type"))? {
            None | Some("none") => Ok(RopeScaling::Default),
            Some("linear") => {
                let factor = self.float(&format!("{prefix}.rope.scaling.factor"))?.ok_or_else(|| {
                    self.error(format!("rope scaling is linear but {prefix}.rope.scaling.factor is missing"))
                })?;
                Ok(RopeScaling::Linear { factor })
            }
            Some(other) => Err(self.error(format!(
                "RoPE scaling \"{other}\" is not one Folio implements (it reads none, linear and Llama 3's)"
            ))),
        }
    }
}
