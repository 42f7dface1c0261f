//! One generic decoder for Llama 3.x, Mistral, Qwen2/2.5 and Qwen3.
//!
//! The families differ only by flags of [`ModelConfig`] (QKV bias, q/k RMSNorm, explicit
//! head_dim, tied embeddings, sliding window, RoPE rule), so there is one forward pass, not
//! one copy per family. Attention goes through the [`Attention`] seam over a [`KvStore`]; the
//! decoder never touches K/V after writing it.
//!
//! Batch size is one: Folio serves one conversation over one long context at a time.

use std::path::Path;

mod embedding;
mod proj;
mod quantize;
mod sources;

use candle_core::{DType, Device, Tensor, D};

use crate::attention::{Attention, AttnCall};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::{DenseKv, KvStore};
use crate::profile::span;
use crate::rope;
pub use embedding::{embedding_on_host, Embedding};
use proj::{Proj, Qkv};
pub use quantize::Quantize;
use quantize::Quantizing;
use sources::{GgufWeights, RandomWeights, SafetensorsWeights, WeightSource};

struct Layer {
    input_norm: Tensor,
    post_attn_norm: Tensor,
    /// The q, k and v projections as one product, their rows stacked in that order (one
    /// matrix-vector product and one read of `h` a decode step instead of three; the pieces are
    /// column ranges of its output).
    qkv: Qkv,
    o: Proj,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    gate: Proj,
    up: Proj,
    down: Proj,
}

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (prefill and decode): the LM head runs once.
    Last,
    /// Every position (perplexity, parity tests).
    All,
}

/// Values, bytes and tensor types of a model's weights as they sit in memory.
#[derive(Debug, Clone, Default)]
pub struct WeightCensus {
    pub values: usize,
    pub bytes: u64,
    /// Of `bytes`, those held in host memory rather than on the model's GPU (the embedding
    /// table, see [`embedding_on_host`]); zero on the CPU.
    pub host_bytes: u64,
    /// Tensors of each type (`BF16`, `Q4_K`, …).
    pub types: std::collections::BTreeMap<String, usize>,
}

impl WeightCensus {
    fn add_tensor(&mut self, t: &Tensor) {
        self.add_values(t.elem_count(), t.dtype());
    }

    /// A tensor of `values` values of `dtype`.
    fn add_values(&mut self, values: usize, dtype: DType) {
        self.values += values;
        self.bytes += (values * dtype.size_in_bytes()) as u64;
        *self.types.entry(format!("{dtype:?}").to_uppercase()).or_insert(0) += 1;
    }

    fn add(&mut self, p: &Proj) {
        match p {
            Proj::Dense(l) => self.add_tensor(l.weight()),
            Proj::Quant { weight, .. } => {
                let ((rows, cols), bytes, name) = weight.facts();
                self.values += rows * cols;
                self.bytes += bytes as u64;
                *self.types.entry(name.to_owned()).or_insert(0) += 1;
            }
        }
        if let Some(b) = p.bias() {
            self.add_tensor(b);
        }
    }

    /// A stack of `parts` projections (q, k and v in one matrix): its values and bytes, and a
    /// tensor of its weight's type (and of its bias's) for each part, as three products count.
    fn add_stacked(&mut self, p: &Proj, parts: usize) {
        let before = self.types.clone();
        self.add(p);
        for (name, n) in self.types.iter_mut() {
            *n += (*n - before.get(name).copied().unwrap_or(0)) * (parts - 1);
        }
    }

    /// Bytes the weights take in the model device's memory.
    pub fn device_bytes(&self) -> u64 {
        self.bytes - self.host_bytes
    }

    /// Bits per weight over all of them.
    pub fn bits_per_weight(&self) -> f64 {
        if self.values == 0 {
            0.0
        } else {
            8.0 * self.bytes as f64 / self.values as f64
        }
    }
}

pub struct Model {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Proj,
    inv_freq: Vec<f32>,
    device: Device,
    dtype: DType,
    params: usize,
}

impl Model {
    /// Loads weights from safetensors `files` (one file or all shards) onto `device` as `dtype`,
    /// the projections quantized when `quantize` says so.
    pub fn load(
        cfg: &ModelConfig,
        files: &[impl AsRef<Path>],
        device: &Device,
        dtype: DType,
        quantize: Option<Quantize>,
    ) -> Result<Self> {
        let source = SafetensorsWeights::open(files, device, dtype)?;
        let params = source.params;
        match quantize {
            Some(q) => Self::build(cfg, device, dtype, params, &Quantizing::new(&source, q)),
            None => Self::build(cfg, device, dtype, params, &source),
        }
    }

    /// Loads a GGUF file's weights onto `device`: quantized matrices stay quantized, the rest
    /// become `dtype`.
    pub fn load_gguf(cfg: &ModelConfig, file: &GgufFile, device: &Device, dtype: DType) -> Result<Self> {
        let params = file.tensor_names().filter_map(|n| file.tensor(n)).map(|t| t.dims.iter().product::<usize>()).sum();
        Self::build(cfg, device, dtype, params, &GgufWeights::new(file, cfg, device, dtype))
    }

    /// A model of `cfg`'s shape with random weights (normal, std `init_std`; norms at 1), made
    /// on `device`: what `folio bench --shape` runs, since speed and memory depend on shapes
    /// only. Seeded per tensor name, so two runs build the same model.
    /// With `quantize`, the projections are quantized, one draw per kind of projection copied
    /// into every layer (quantizing is the slow part of making the model).
    pub fn random(
        cfg: &ModelConfig,
        device: &Device,
        dtype: DType,
        init_std: f64,
        quantize: Option<Quantize>,
    ) -> Result<Self> {
        let source = RandomWeights::new(device, dtype, init_std);
        let mut model = match quantize {
            Some(q) => Self::build(cfg, device, dtype, 0, &Quantizing::sharing_draws(&source, q))?,
            None => Self::build(cfg, device, dtype, 0, &source)?,
        };
        // A quantized tied head is a copy of the embedding table, not parameters of its own.
        let head_copy = cfg.tie_word_embeddings && model.lm_head.dense().is_none();
        model.params = model.weights().values - if head_copy { cfg.vocab_size * cfg.hidden_size } else { 0 };
        Ok(model)
    }

    /// The decoder from a source of named weights of the shapes `cfg` implies.
    fn build(cfg: &ModelConfig, device: &Device, dtype: DType, params: usize, src: &dyn WeightSource) -> Result<Self> {
        let (h, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (nq, nkv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let embed = src.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        // The head and the table first: a table bound for host memory leaves the device before
        // the layers arrive, so loading never needs more device memory than the plan counts.
        let lm_head = if cfg.tie_word_embeddings {
            src.tied_head(&embed, cfg.vocab_size, h)?
        } else {
            src.linear("lm_head", cfg.vocab_size, h, false)?
        };
        let embed = Embedding::place(embed, device, cfg.tie_word_embeddings && lm_head.dense().is_some())?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let norm = |n: &str, size: usize| src.tensor(&format!("{p}.{n}.weight"), &[size]);
            let linear = |n: &str, out: usize, inp: usize, bias: bool| src.linear(&format!("{p}.{n}"), out, inp, bias);
            layers.push(Layer {
                input_norm: norm("input_layernorm", h)?,
                post_attn_norm: norm("post_attention_layernorm", h)?,
                qkv: Qkv::new([
                    linear("self_attn.q_proj", nq, h, cfg.qkv_bias)?,
                    linear("self_attn.k_proj", nkv, h, cfg.qkv_bias)?,
                    linear("self_attn.v_proj", nkv, h, cfg.qkv_bias)?,
                ])?,
                o: linear("self_attn.o_proj", h, nq, false)?,
                q_norm: if cfg.qk_norm { Some(norm("self_attn.q_norm", hd)?) } else { None },
                k_norm: if cfg.qk_norm { Some(norm("self_attn.k_norm", hd)?) } else { None },
                gate: linear("mlp.gate_proj", inter, h, false)?,
                up: linear("mlp.up_proj", inter, h, false)?,
                down: linear("mlp.down_proj", h, inter, false)?,
            });
        }
        let norm = src.tensor("model.norm.weight", &[h])?;
        Ok(Self {
            inv_freq: rope::inv_freq(hd, cfg.rope_theta, &cfg.rope_scaling),
            cfg: cfg.clone(),
            embed,
            layers,
            norm,
            lm_head,
            device: device.clone(),
            dtype,
            params,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Parameters stored in the checkpoint.
    pub fn parameters(&self) -> usize {
        self.params
    }

    /// Bytes of the weights a decode step reads: all but the embedding table (one row of it),
    /// unless the LM head is that table.
    pub fn weight_bytes_per_step(&self) -> u64 {
        let head_is_embed = self.cfg.tie_word_embeddings && self.lm_head.dense().is_some();
        self.weights().bytes - if head_is_embed { 0 } else { self.embed.bytes() }
    }

    /// What the weights hold in memory: values, bytes, and tensors of each type.
    pub fn weights(&self) -> WeightCensus {
        let mut census = WeightCensus::default();
        census.add_values(self.embed.values(), self.embed.dtype());
        if self.embed.on_host() {
            census.host_bytes += self.embed.bytes();
        }
        census.add_tensor(&self.norm);
        for l in &self.layers {
            for t in [Some(&l.input_norm), Some(&l.post_attn_norm), l.q_norm.as_ref(), l.k_norm.as_ref()]
                .into_iter()
                .flatten()
            {
                census.add_tensor(t);
            }
            match &l.qkv {
                // Three tensors, as the file and the CPU hold them, whatever the device stacked.
                Qkv::Stacked(w) => census.add_stacked(w, 3),
                Qkv::Parts(parts) => parts.iter().for_each(|p| census.add(p)),
            }
            [&l.o, &l.gate, &l.up, &l.down].into_iter().for_each(|p| census.add(p));
        }
        // A tied head in the model's dtype is the embedding matrix itself.
        if !(self.cfg.tie_word_embeddings && self.lm_head.dense().is_some()) {
            census.add(&self.lm_head);
        }
        census
    }

    /// An empty dense KV store shaped for this model.
    pub fn new_kv(&self) -> DenseKv {
        DenseKv::new(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype, &self.device)
    }

    /// Runs `ids` at positions `kv.len()..`, appending their K/V to `kv`; returns f32 logits
    /// `[n, vocab]` for the last position (`n = 1`) or all of them.
    pub fn forward(&self, ids: &[u32], kv: &mut dyn KvStore, attn: &dyn Attention, logits: Logits) -> Result<Tensor> {
        let t = ids.len();
        let pos = kv.len();
        self.cfg.check_fits(pos + t)?;
        let mut x = self.embed(ids)?;
        let rope = self.rope(pos, t)?;
        // Each layer's MLP output is added by the next layer's first norm (`layer_parts`).
        let mut mlp = None;
        for i in 0..self.layers.len() {
            let (residual, out) = self.layer_parts(i, (&x, mlp.as_ref()), pos, &rope, kv, i, attn)?;
            (x, mlp) = (residual, Some(out));
        }
        if let Some(mlp) = mlp {
            x = (x + mlp)?;
        }
        kv.set_len(pos + t)?;
        let x = match logits {
            Logits::Last => x.narrow(0, t - 1, 1)?,
            Logits::All => x,
        };
        self.head(&x)
    }

    /// Token embeddings `[t, hidden]` of `ids`, checked against the vocabulary.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(Error::Invalid("forward pass over zero tokens".into()));
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(Error::Invalid(format!("token id {bad} is outside the vocabulary ({})", self.cfg.vocab_size)));
        }
        self.embed.rows(ids, &self.device)
    }

    /// RoPE cos/sin tables for positions `pos..pos + t`.
    pub fn rope(&self, pos: usize, t: usize) -> Result<(Tensor, Tensor)> {
        self.rope_on(pos, t, &self.device)
    }

    /// [`Model::rope`]'s tables made on `device` (the CPU, to be made in parallel and moved).
    pub fn rope_on(&self, pos: usize, t: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        Ok(rope::cos_sin(&self.inv_freq, pos, t, self.dtype, device)?)
    }

    /// Decoder layer `i` over hidden states `x` (`[t, hidden]`) at positions `pos..pos + t`
    /// (`rope` from [`Model::rope`] for those positions): writes their K/V into `kv` as layer
    /// `kv_layer`, attends with `attn`, and returns the layer's output hidden states.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_forward(
        &self,
        i: usize,
        x: &Tensor,
        pos: usize,
        rope: &(Tensor, Tensor),
        kv: &mut dyn KvStore,
        kv_layer: usize,
        attn: &dyn Attention,
    ) -> Result<Tensor> {
        let (x, mlp) = self.layer_parts(i, (x, None), pos, rope, kv, kv_layer, attn)?;
        Ok((x + mlp)?)
    }

    /// [`Model::layer_forward`] with the last layer's MLP output not yet added to `x`
    /// (`pending`): the residual add and this layer's first norm in one launch
    /// (`folio_kernels::norm::add_rms_norm`, the same bits as the two), and this layer's MLP
    /// output returned beside its residual for the next layer to add so — one launch fewer a
    /// layer of a decode step.
    #[allow(clippy::too_many_arguments)]
    fn layer_parts(
        &self,
        i: usize,
        (x, pending): (&Tensor, Option<&Tensor>),
        pos: usize,
        rope: &(Tensor, Tensor),
        kv: &mut dyn KvStore,
        kv_layer: usize,
        attn: &dyn Attention,
    ) -> Result<(Tensor, Tensor)> {
        let layer = &self.layers[i];
        let eps = self.cfg.rms_norm_eps as f32;
        let hd = self.cfg.head_dim;
        let (cos, sin) = rope;
        let dev = &self.device;
        let (x, h) = span(dev, "norms", || {
            Ok(match pending {
                Some(mlp) => folio_kernels::norm::add_rms_norm(x, mlp, &layer.input_norm, eps)?,
                None => (x.clone(), folio_kernels::norm::rms_norm(x, &layer.input_norm, eps)?),
            })
        })?;
        let x = &x;
        // [t, hidden] -> [heads, t, hd]: the product, then its bias and the move to heads in
        // one pass (folio_kernels::heads; candle's Linear would add the bias on its own).
        let (nq, nkv) = (self.cfg.num_heads, self.cfg.num_kv_heads);
        // Q and K are rotated as they are split into heads (folio_kernels::heads::split_rope),
        // unless the model normalises them first (q/k norms come between the two).
        let norms = layer.q_norm.as_ref().zip(layer.k_norm.as_ref());
        let roped = |heads: usize| if norms.is_none() { heads } else { 0 };
        let (q, k, v) = span(dev, "q/k/v projections, RoPE", || {
            // One token (a decode step): one product, whose Q, K and V heads one pass makes.
            // More (a prefill chunk): a product per projection over its rows of a plain stacked
            // weight, whose outputs the head split reads as they are, where columns of one
            // product would each be copied out first (a quantized stack: one product, whose
            // dequantized matrix is made once).
            let whole = match &layer.qkv {
                Qkv::Stacked(Proj::Dense(w)) if h.dim(0)? == 1 => Some(folio_kernels::gemv::product(&h, w.weight())?),
                Qkv::Stacked(w @ Proj::Quant { .. }) => Some(w.product(&h)?),
                _ => None,
            };
            if let (Some(y), Qkv::Stacked(w)) = (&whole, &layer.qkv) {
                let shape = (nq + 2 * nkv, roped(nq + nkv), hd);
                let all = folio_kernels::heads::split_rope(y, w.bias(), shape, cos, sin)?;
                return Ok((all.narrow(0, 0, nq)?, all.narrow(0, nq, nkv)?, all.narrow(0, nq + nkv, nkv)?));
            }
            let (at, widths) = ([0, nq, nq + nkv], [nq, nkv, nkv]);
            let heads = |part: usize| -> candle_core::Result<Tensor> {
                let (from, width) = (at[part] * hd, widths[part] * hd);
                let (y, bias) = match &layer.qkv {
                    Qkv::Stacked(w) => match w.dense() {
                        Some(w) => (
                            h.matmul(&w.weight().narrow(0, from, width)?.t()?)?,
                            w.bias().map(|b| b.narrow(0, from, width)).transpose()?,
                        ),
                        None => candle_core::bail!("a quantized q/k/v stack without its product"),
                    },
                    Qkv::Parts(parts) => (parts[part].product(&h)?, parts[part].bias().cloned()),
                };
                let rotated = if part < 2 { roped(widths[part]) } else { 0 };
                folio_kernels::heads::split_rope(&y, bias.as_ref(), (widths[part], rotated, hd), cos, sin)
            };
            Ok((heads(0)?, heads(1)?, heads(2)?))
        })?;
        let (q, k) = match norms {
            Some((qn, kn)) => {
                let (q, k) = span(dev, "norms", || {
                    Ok((folio_kernels::norm::rms_norm(&q, qn, eps)?, folio_kernels::norm::rms_norm(&k, kn, eps)?))
                })?;
                span(dev, "rope", || {
                    Ok((
                        candle_nn::rotary_emb::rope(&q.unsqueeze(0)?, cos, sin)?.squeeze(0)?,
                        candle_nn::rotary_emb::rope(&k.unsqueeze(0)?, cos, sin)?.squeeze(0)?,
                    ))
                })?
            }
            None => (q, k),
        };
        span(dev, "K/V into the cache", || kv.write(kv_layer, pos, &k, &v))?;
        let scale = 1.0 / (hd as f32).sqrt();
        let call = AttnCall {
            layer: i,
            layers: self.cfg.num_layers,
            kv_layer,
            q: &q,
            q_start: pos,
            kv: &*kv,
            scale,
            window: self.cfg.sliding_window,
        };
        let a = span(dev, "attention", || attn.forward(&call))?; // [heads, t, hd]
        let (x, h) = span(dev, "o projection, residual, norm", || {
            // [heads, t, hd] -> [t, hidden] in one pass (folio_kernels::heads), then the residual
            // added and the sum normalised in one more (folio_kernels::norm).
            let o = layer.o.forward(&folio_kernels::heads::merge(&a)?)?;
            Ok(folio_kernels::norm::add_rms_norm(x, &o, &layer.post_attn_norm, eps)?)
        })?;
        let mlp = span(dev, "MLP", || {
            let gated = folio_kernels::mlp::swiglu(&layer.gate.forward(&h)?, &layer.up.forward(&h)?)?;
            Ok(layer.down.forward(&gated)?)
        })?;
        Ok((x, mlp))
    }

    /// Final norm and LM head over hidden rows `[n, hidden]`: f32 logits `[n, vocab]`.
    pub fn head(&self, x: &Tensor) -> Result<Tensor> {
        let x = folio_kernels::norm::rms_norm(x, &self.norm, self.cfg.rms_norm_eps as f32)?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    /// Log-probability of each next token: `result[i] = log p(ids[i + 1] | ids[..=i])`, computed
    /// in chunks of `chunk` tokens so the `[n, vocab]` logits never exist for all `n` at once.
    pub fn token_log_probs(&self, ids: &[u32], chunk: usize, attn: &dyn Attention) -> Result<Vec<f32>> {
        self.cfg.check_fits(ids.len())?;
        let mut kv = self.new_kv();
        kv.reserve(ids.len())?;
        let mut out = Vec::with_capacity(ids.len().saturating_sub(1));
        for start in (0..ids.len().saturating_sub(1)).step_by(chunk.max(1)) {
            let end = (start + chunk.max(1)).min(ids.len() - 1);
            let logits = self.forward(&ids[start..end], &mut kv, attn, Logits::All)?;
            let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
            let targets = Tensor::new(&ids[start + 1..end + 1], &self.device)?.unsqueeze(1)?;
            out.extend(logp.gather(&targets, 1)?.squeeze(1)?.to_vec1::<f32>()?);
        }
        Ok(out)
    }
}
