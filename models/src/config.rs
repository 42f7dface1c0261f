//! `config.json` → one [`ModelConfig`] for the generic decoder.
//!
//! The four supported families differ only in flags (docs/architecture.md), so this module is where
//! their differences live: QKV bias (Qwen2 always, Llama/Mistral when `attention_bias`), q/k
//! RMSNorm (Qwen3), an explicit `head_dim` (Qwen3, newer Llama/Mistral), tied embeddings, a
//! sliding window (Mistral), and the RoPE frequency rule. Both config dialects are read: the
//! classic top-level `rope_theta` / `rope_scaling` of published checkpoints, and the
//! `rope_parameters` block that transformers 5 writes.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The `model_type` values this decoder implements.
pub const SUPPORTED_MODEL_TYPES: [&str; 4] = ["llama", "mistral", "qwen2", "qwen3"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// How RoPE inverse frequencies are derived from `rope_theta`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's rule: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
    /// Each frequency divided by its own factor: how GGUF files carry Llama 3's rule (a
    /// `rope_freqs.weight` tensor).
    Factors { factors: Vec<f64> },
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the checkpoint was saved in (`torch_dtype` / `dtype`), if stated.
    pub saved_dtype: Option<String>,
}

/// A token id field that Hugging Face configs write either as one int or as a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub(crate) fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct RawRope {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    hidden_act: Option<String>,
    bos_token_id: Option<TokenIds>,
    eos_token_id: Option<TokenIds>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
}

/// Defaults of transformers' config classes for keys a config.json may omit.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;

impl ModelConfig {
    /// The fingerprint of a model of this configuration with the given tokenizer and weight
    /// hashes: what a context file records of the model that made its K/V.
    pub fn fingerprint(
        &self,
        tokenizer: String,
        weights: String,
        quantization: Option<String>,
    ) -> Result<folio_context_file::Fingerprint> {
        Ok(folio_context_file::Fingerprint {
            architecture: self.arch.name().to_owned(),
            layers: self.num_layers,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            vocab_size: self.vocab_size,
            rope_theta: self.rope_theta,
            rope_scaling: serde_json::to_value(&self.rope_scaling).map_err(|e| Error::Invalid(e.to_string()))?,
            sliding_window: self.sliding_window,
            qkv_bias: self.qkv_bias,
            qk_norm: self.qk_norm,
            tokenizer,
            weights,
            quantization,
        })
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let invalid = |msg: String| Error::InvalidConfig { path: path.to_owned(), msg };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        let model_type = value.get("model_type").and_then(|v| v.as_str()).unwrap_or("").to_owned();
        let arch = match model_type.as_str() {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            _ => {
                return Err(Error::UnsupportedModelType {
                    found: model_type,
                    supported: SUPPORTED_MODEL_TYPES.to_vec(),
                })
            }
        };
        let raw: RawConfig = serde_json::from_value(value).map_err(|e| invalid(format!("{e}")))?;
        debug_assert!(raw.model_type.is_some());
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(invalid(format!("hidden_act \"{act}\" is not supported (only \"silu\")")));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        // 0 when there are no heads, which `check_shape` below refuses.
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size.checked_div(raw.num_attention_heads).unwrap_or(0));
        // transformers 5 folds rope_theta into rope_parameters; older configs keep them apart.
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        let rope_theta = raw
            .rope_theta
            .or_else(|| raw.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or(DEFAULT_ROPE_THETA);
        let rope_scaling = match rope {
            None => RopeScaling::Default,
            Some(r) => parse_rope(r).map_err(invalid)?,
        };
        let sliding_window = match arch {
            Arch::Mistral if raw.sliding_window == Some(0) => {
                return Err(invalid("sliding_window must be at least 1 token".into()))
            }
            Arch::Mistral => raw.sliding_window,
            Arch::Qwen2 | Arch::Qwen3 if raw.use_sliding_window == Some(true) => {
                return Err(invalid(
                    "use_sliding_window = true is not supported for Qwen models (per-layer windows)".into(),
                ))
            }
            _ => None,
        };
        let bos_token_id = match &raw.bos_token_id {
            Some(TokenIds::One(id)) => Some(*id),
            Some(TokenIds::Many(ids)) => ids.first().copied(),
            None => None,
        };
        let cfg = Self {
            arch,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: match arch {
                Arch::Qwen2 => true,
                _ => raw.attention_bias.unwrap_or(false),
            },
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
            bos_token_id,
            eos_token_ids: raw.eos_token_id.map(|e| e.to_vec()).unwrap_or_default(),
            saved_dtype: raw.torch_dtype.or(raw.dtype),
        };
        cfg.check_shape().map_err(invalid)?;
        Ok(cfg)
    }

    /// The checks every configuration passes, whatever file it came from (config.json or a
    /// GGUF's metadata), so that a hostile value is refused here and not divided by later.
    pub fn check_shape(&self) -> std::result::Result<(), String> {
        if self.num_heads == 0 || self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err("the attention heads, layers, hidden size and vocabulary must be > 0".into());
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "the attention heads ({}) must be a multiple of the key/value heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even (and > 0) for RoPE", self.head_dim));
        }
        if self.intermediate_size == 0 || self.max_position_embeddings == 0 {
            return Err("the MLP width and the context length must be > 0".into());
        }
        Ok(())
    }

    /// Refuses `tokens` that do not fit the model's context (never a silent cut).
    pub fn check_fits(&self, tokens: usize) -> Result<()> {
        if tokens > self.max_position_embeddings {
            return Err(Error::PromptTooLong { tokens, limit: self.max_position_embeddings });
        }
        Ok(())
    }

    /// Bytes of K and V one token occupies across all layers at `dtype_bytes` per element.
    pub fn kv_bytes_per_token(&self, dtype_bytes: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
    }
}

fn parse_rope(r: &RawRope) -> std::result::Result<RopeScaling, String> {
    let need = |v: Option<f64>, name: &str| v.ok_or_else(|| format!("rope scaling is missing {name}"));
    match r.rope_type.as_deref().unwrap_or("default") {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear { factor: need(r.factor, "factor")? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: need(r.factor, "factor")?,
            low_freq_factor: need(r.low_freq_factor, "low_freq_factor")?,
            high_freq_factor: need(r.high_freq_factor, "high_freq_factor")?,
            original_max_position_embeddings: r
                .original_max_position_embeddings
                .ok_or("rope scaling is missing original_max_position_embeddings")?,
        }),
        other => Err(format!("rope type \"{other}\" is not supported (supported: default, linear, llama3)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ModelConfig> {
        ModelConfig::from_json(json, Path::new("config.json"))
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 512, "rms_norm_eps": 1e-5"#;

    #[test]
    fn unknown_model_type_lists_supported() {
        let err = parse(&format!(r#"{{"model_type": "gpt2", {BASE}}}"#)).unwrap_err().to_string();
        assert!(err.contains("\"gpt2\"") && err.contains("llama, mistral, qwen2, qwen3"), "{err}");
    }

    #[test]
    fn both_rope_dialects() {
        let classic = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_theta": 5e5, "rope_scaling": {{"rope_type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        let v5 = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 5e5,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        assert_eq!(classic.rope_theta, 5e5);
        assert_eq!(classic.rope_scaling, v5.rope_scaling);
        assert_eq!(classic.rope_theta, v5.rope_theta);
        let yarn =
            parse(&format!(r#"{{"model_type": "qwen2", {BASE}, "rope_scaling": {{"type": "yarn", "factor": 4.0}}}}"#));
        assert!(yarn.unwrap_err().to_string().contains("\"yarn\" is not supported"));
    }

    #[test]
    fn family_flags() {
        let q2 = parse(&format!(r#"{{"model_type": "qwen2", {BASE}, "num_key_value_heads": 2}}"#)).unwrap();
        assert!(q2.qkv_bias && !q2.qk_norm && q2.head_dim == 16 && q2.num_kv_heads == 2);
        let q3 = parse(&format!(r#"{{"model_type": "qwen3", {BASE}, "head_dim": 32}}"#)).unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias && q3.head_dim == 32);
        let m = parse(&format!(r#"{{"model_type": "mistral", {BASE}, "sliding_window": 4096}}"#)).unwrap();
        assert_eq!(m.sliding_window, Some(4096));
        let bad = parse(&format!(r#"{{"model_type": "llama", {BASE}, "num_key_value_heads": 3}}"#));
        assert!(bad
            .unwrap_err()
            .to_string()
            .contains("attention heads (4) must be a multiple of the key/value heads (3)"));
    }
}
