//! Double Sparsity (the paper is named in [`SPEC`]): token sparsity chosen through
//! channel sparsity. A few calibrated "outlier" channels of q·k ([`Channels`], from
//! `folio calibrate`) rank tokens almost as well as the full product; their key values form a
//! compact label cache (4-bit, asymmetric min–max per token and head, §3.2), scanned each step
//! to pick the top-k tokens, over which attention runs exactly (Algorithm 1).
//!
//! GQA: one channel set and label row per *KV* head (policy B: label memory stays at the
//! paper's 1/16 of K), top-k per *query* head with its own query restricted to those
//! channels, as SGLang does. No sinks, no forced window, no dense layers: the paper has none
//! (`window` is offered, 0 by default). Labels of the stored context are the index; those of
//! the question and answer tokens are made as they arrive (the paper appends each new token's
//! label before scoring, so the current token is a candidate, not forced in).
//! `bits=16` keeps labels unquantized: with every channel that is exactly top-k.

use std::collections::BTreeMap;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use serde::{Deserialize, Serialize};

use candle_core::{DType, Tensor};
use folio_kernels::sparse;

use super::cost::{CostInput, StepCost};
use super::fast;
use super::select::{
    index_base, query_rows, sparse_decode, top_positions, visible, HeadPick, IndexSource, Indexes, LayerRows,
    SectionReader, SectionWriter,
};
use super::{
    Attended, Attention, AttnCall, Budget, DefaultBudget, Knobs, MethodSpec, Needs, ParamSpec, Params, Read, Tiers,
};
use crate::error::{Error, Result};
use crate::kv_cache::DecodeTier;
use crate::kv_cache::KvStore;

/// Channel order per layer and KV head, most important first: what Double Sparsity uses
/// (measured by [`crate::calibrate`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Channels {
    /// `[layer][kv_head]`: every channel, most important first.
    pub order: Vec<Vec<Vec<u16>>>,
}

impl Channels {
    /// The order of a `[layer][kv_head][channel]` statistic, largest first (ties to the lower
    /// channel).
    pub fn from_statistic(stat: &[Vec<Vec<f64>>]) -> Self {
        let order = stat
            .iter()
            .map(|layer| {
                layer
                    .iter()
                    .map(|s| {
                        let mut idx: Vec<u16> = (0..s.len() as u16).collect();
                        idx.sort_by(|a, b| s[*b as usize].total_cmp(&s[*a as usize]).then(a.cmp(b)));
                        idx
                    })
                    .collect()
            })
            .collect();
        Self { order }
    }

    /// The `r` most important channels of `(layer, kv_head)`, ascending.
    pub fn top(&self, layer: usize, kv_head: usize, r: usize) -> Vec<usize> {
        let mut c: Vec<usize> = self.order[layer][kv_head].iter().take(r).map(|&x| x as usize).collect();
        c.sort_unstable();
        c
    }
}

pub(super) const SPEC: MethodSpec = MethodSpec {
    name: "double-sparsity",
    summary: "calibrated outlier channels give cheap approximate scores (a label cache); top-k by label",
    paper: "Yang et al., Post-Training Sparse Attention with Double Sparsity (2024)",
    default_budget: Some(DefaultBudget {
        budget: "6.25%",
        source: "the paper's token sparsity 1/16 (§6.1; perplexity rises sharply past it, Table 2)",
    }),
    params: &PARAMS,
    needs: Needs {
        calibration: true,
        index: Some("a label cache: the context's keys at the outlier channels, quantized"),
    },
    tiers: Tiers::FAST,
    cost,
    build: |budget, params, resources| {
        let channels = resources.channels.clone().ok_or_else(|| {
            Error::Invalid(
                "double-sparsity needs the model's outlier channels: run `folio calibrate --model <model> --docs <files>` once"
                    .into(),
            )
        })?;
        Ok(Box::new(DoubleSparsity::new(super::params::required(budget)?, params, channels)?))
    },
};

/// The label cache lives on the device (r one-byte codes and an f32 offset and range per key)
/// and is scanned whole each step; the picks bring their K and V per query head.
fn cost(input: &CostInput<'_>) -> StepCost {
    let d = input.shape.head_dim;
    let r = match input.params.usize("channels") {
        0 => (d / 4).max(1),
        r => r.min(d),
    };
    let labels = (input.shape.layers * input.shape.kv_heads * input.context * (r + 8)) as f64;
    let picked = input.budget + input.params.usize("window");
    StepCost {
        device_bytes: labels,
        link_bytes: input.layers() * input.rows(picked, input.shape.heads),
        host_bytes: 0.0,
        resident_bytes: labels as u64,
        ..StepCost::default()
    }
}

const PARAMS: [ParamSpec; 3] = [
    ParamSpec {
        name: "channels",
        default: 0.0,
        min: 0.0,
        max: 1024.0,
        integer: true,
        doc: "r, outlier channels per KV head (0: head_dim/4, the paper's 1/16 label cache at 4 bits)",
    },
    ParamSpec {
        name: "bits",
        default: 4.0,
        min: 1.0,
        max: 16.0,
        integer: true,
        doc: "label bits (16: unquantized, the CPU reference)",
    },
    ParamSpec {
        name: "window",
        default: 0.0,
        min: 0.0,
        max: 1_048_576.0,
        integer: true,
        doc: "most recent tokens always attended (the paper: none)",
    },
];

/// Label bits at which labels are kept as they are; quantized codes take one byte at most.
const FULL_BITS: usize = 16;
const MAX_CODE_BITS: usize = 8;

/// Asymmetric min–max quantization of one token's label values: (offset, range, codes).
fn quantize(x: &[f32], bits: usize) -> (f32, f32, Vec<u8>) {
    let max_q = ((1u32 << bits) - 1) as f32;
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let range = if hi > lo { hi - lo } else { 1.0 };
    (lo, range, x.iter().map(|v| ((v - lo) * max_q / range).round().clamp(0.0, max_q) as u8).collect())
}

fn dequantize(lo: f32, range: f32, codes: &[u8], bits: usize) -> Vec<f32> {
    let max_q = ((1u32 << bits) - 1) as f32;
    codes.iter().map(|&c| c as f32 * range / max_q + lo).collect()
}

/// One token's label: the key at the chosen channels, min–max quantized (as the label cache
/// gives it back).
fn label(key: &[f32], channels: &[usize], bits: usize) -> Vec<f32> {
    let x: Vec<f32> = channels.iter().map(|&c| key[c]).collect();
    if bits >= FULL_BITS {
        return x;
    }
    let (lo, range, codes) = quantize(&x, bits);
    dequantize(lo, range, &codes, bits)
}

/// A layer's label cache over positions `0..end`, per KV head, dequantized for the reference
/// scan. Stored in a context file as one byte per code plus an f32 offset and range per row
/// (`bits` ≤ 8; the paper's 4-bit packing would halve the codes), or f32 values at 16 bits.
struct Labels {
    end: usize,
    channels: Vec<Vec<usize>>,
    rows: Vec<Vec<Vec<f32>>>,
}

/// The label cache on the compute device, for the offloaded path: codes `[kv_heads, end, r]`
/// u8 and (offset, range) `[kv_heads, end, 2]` f32, scanned by the label-score kernel, and the
/// channels `[kv_heads, r]` u32 that pick a query's (and a fresh key's) label values.
struct DeviceLabels {
    end: usize,
    codes: Tensor,
    scale: Tensor,
    channels: Tensor,
}

/// Min–max quantization of `x [kv_heads, t, r]` f32 per row, as [`quantize`] does one row:
/// (codes as f32, offset `[kv_heads, t, 1]`, range `[kv_heads, t, 1]`).
fn quantize_rows(x: &Tensor, bits: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let max_q = ((1u32 << bits) - 1) as f64;
    let lo = x.min_keepdim(2)?;
    let hi = x.max_keepdim(2)?;
    let range = hi.gt(&lo)?.where_cond(&(&hi - &lo)?, &lo.ones_like()?)?;
    let codes = x.broadcast_sub(&lo)?.affine(max_q, 0.0)?.broadcast_div(&range)?.round()?.clamp(0.0, max_q)?;
    Ok((codes, lo, range))
}

/// The label values `[kv_heads, t, r]` of keys `k [kv_heads, t, d]` at `channels [kv_heads, r]`.
fn label_values(k: &Tensor, channels: &Tensor) -> Result<Tensor> {
    let (kv, t, _) = k.dims3()?;
    let r = channels.dim(1)?;
    let idx = channels.unsqueeze(1)?.broadcast_as((kv, t, r))?.contiguous()?;
    Ok(k.to_dtype(DType::F32)?.contiguous()?.gather(&idx, 2)?)
}

pub struct DoubleSparsity {
    budget: Budget,
    params: Params,
    calibration: Arc<Channels>,
    labels: Indexes<Labels>,
    device_labels: Indexes<DeviceLabels>,
}

impl DoubleSparsity {
    pub fn new(budget: Budget, params: Params, calibration: Arc<Channels>) -> Result<Self> {
        let bits = params.usize("bits");
        if bits > MAX_CODE_BITS && bits != FULL_BITS {
            return Err(Error::Invalid(format!(
                "double-sparsity labels take bits=1..={MAX_CODE_BITS} (quantized) or bits={FULL_BITS} (unquantized), not {bits}"
            )));
        }
        Ok(Self { budget, params, calibration, labels: Indexes::new(), device_labels: Indexes::new() })
    }

    fn channel_count(&self, head_dim: usize) -> usize {
        match self.params.usize("channels") {
            0 => (head_dim / 4).max(1),
            r => r.min(head_dim),
        }
    }

    /// The layer's channels per KV head, checked against the calibration's shape.
    fn channels(&self, layer: usize, kv_heads: usize, head_dim: usize) -> Result<Vec<Vec<usize>>> {
        let order = &self.calibration.order;
        if layer >= order.len() || order[layer].len() != kv_heads {
            return Err(Error::Invalid(format!(
                "the channel calibration has {} layers x {} KV heads; this model has layer {layer} with {kv_heads} KV heads",
                order.len(),
                order.first().map_or(0, |l| l.len()),
            )));
        }
        let r = self.channel_count(head_dim);
        Ok((0..kv_heads).map(|g| self.calibration.top(layer, g, r)).collect())
    }

    /// The section name of labels over `0..end` at these settings; the hash of the whole
    /// calibration tells labels of another calibration apart.
    fn section_name(&self, head_dim: usize, end: usize) -> String {
        let flat: Vec<u8> = self.calibration.order.iter().flatten().flatten().flat_map(|c| c.to_le_bytes()).collect();
        format!(
            "double-sparsity v1 channels={}:{:016x} bits={} keys=0..{end}",
            self.channel_count(head_dim),
            xxh3_64(&flat),
            self.params.usize("bits")
        )
    }

    fn encode(rows: &LayerRows, channels: &[Vec<usize>], end: usize, bits: usize) -> Vec<u8> {
        let mut w = SectionWriter::default();
        for (g, ch) in channels.iter().enumerate() {
            for p in 0..end {
                let x: Vec<f32> = ch.iter().map(|&c| rows.key(g, p)[c]).collect();
                if bits >= FULL_BITS {
                    w.f32s(&x);
                } else {
                    let (lo, range, codes) = quantize(&x, bits);
                    w.f32s(&[lo, range]);
                    w.u8s(&codes);
                }
            }
        }
        w.0
    }

    fn decode(bytes: &[u8], name: &str, channels: Vec<Vec<usize>>, end: usize, bits: usize) -> Result<Labels> {
        let r = channels.first().map_or(0, |c| c.len());
        let rows = if bits >= FULL_BITS {
            let mut reader = SectionReader::new(bytes, name);
            let rows = (0..channels.len())
                .map(|_| (0..end).map(|_| reader.f32s(r)).collect::<Result<Vec<_>>>())
                .collect::<Result<Vec<_>>>()?;
            reader.finish()?;
            rows
        } else {
            let (codes, scale) = Self::decode_codes(bytes, name, channels.len(), end, r)?;
            let mut rows = codes.chunks(r.max(1)).zip(scale.chunks(2)).map(|(c, s)| dequantize(s[0], s[1], c, bits));
            (0..channels.len()).map(|_| rows.by_ref().take(end).collect()).collect()
        };
        Ok(Labels { end, channels, rows })
    }

    /// A quantized section's codes `[kv_heads][end][r]` and (offset, range) per row, as stored.
    fn decode_codes(bytes: &[u8], name: &str, kv_heads: usize, end: usize, r: usize) -> Result<(Vec<u8>, Vec<f32>)> {
        let mut reader = SectionReader::new(bytes, name);
        let (mut codes, mut scale) = (Vec::with_capacity(kv_heads * end * r), Vec::with_capacity(kv_heads * end * 2));
        for _ in 0..kv_heads * end {
            scale.extend(reader.f32s(2)?);
            codes.extend_from_slice(reader.u8s(r)?);
        }
        reader.finish()?;
        Ok((codes, scale))
    }

    /// The layer's labels over the context (`base`: the saved prefix, else what is visible at
    /// the first decode): cached, else read from the context file, else computed.
    fn layer_labels(&self, call: &AttnCall<'_>, rows: &LayerRows, hi: usize) -> Result<Arc<Labels>> {
        if let Some(labels) = self.labels.cached(call.layer, |l| l.end <= hi) {
            return Ok(labels);
        }
        let channels = self.channels(call.layer, rows.kv_heads, rows.head_dim)?;
        let bits = self.params.usize("bits");
        let end = index_base(call.kv, hi);
        let name = self.section_name(rows.head_dim, end);
        self.labels.load(
            call,
            &name,
            |b| Self::decode(b, &name, channels.clone(), end, bits),
            || {
                let label_rows = channels
                    .iter()
                    .enumerate()
                    .map(|(g, c)| (0..end).map(|p| label(rows.key(g, p), c, bits)).collect())
                    .collect();
                Ok(Labels { end, channels: channels.clone(), rows: label_rows })
            },
        )
    }
}

impl DoubleSparsity {
    /// The layer's label cache on the device over the keys [`index_base`] names (the saved
    /// prefix, else what is visible at the first decode step `hi`): cached, else the context
    /// file's section, else built from the keys in chunks on the device.
    fn device_labels(
        &self,
        call: &AttnCall<'_>,
        kv: &dyn DecodeTier,
        bits: usize,
        hi: usize,
    ) -> Result<Arc<DeviceLabels>> {
        if let Some(labels) = self.device_labels.cached(call.layer, |l| l.end <= hi) {
            return Ok(labels);
        }
        let (kv_heads, d, end) = (kv.kv_heads(), kv.head_dim(), index_base(call.kv, hi));
        let channels = self.channels(call.layer, kv_heads, d)?;
        let r = channels[0].len();
        let flat: Vec<u32> = channels.iter().flatten().map(|&c| c as u32).collect();
        let dev = kv.device();
        let ch = Tensor::from_vec(flat, (kv_heads, r), dev)?;
        let name = self.section_name(d, end);
        self.device_labels.load(
            call,
            &name,
            |b| {
                let (codes, scale) = Self::decode_codes(b, &name, kv_heads, end, r)?;
                Ok(DeviceLabels {
                    end,
                    codes: Tensor::from_vec(codes, (kv_heads, end, r), dev)?,
                    scale: Tensor::from_vec(scale, (kv_heads, end, 2), dev)?,
                    channels: ch.clone(),
                })
            },
            || {
                let (mut codes, mut scale) = (Vec::new(), Vec::new());
                kv.for_each_key_chunk(call.kv_layer, end, &mut |k| {
                    let (c, lo, range) = quantize_rows(&label_values(k, &ch)?, bits)?;
                    codes.push(c.to_dtype(DType::U8)?);
                    scale.push(Tensor::cat(&[lo, range], 2)?);
                    Ok(())
                })?;
                Ok(DeviceLabels {
                    end,
                    codes: Tensor::cat(&codes, 1)?,
                    scale: Tensor::cat(&scale, 1)?,
                    channels: ch.clone(),
                })
            },
        )
    }

    /// The fast path over a decode tier: label scores of the indexed keys by the kernel, fresh
    /// labels for the later ones, the top-k kernel, then attention over the gathered rows.
    fn attend_fast(&self, call: &AttnCall<'_>, kv: &dyn DecodeTier) -> Result<Attended> {
        let bits = self.params.usize("bits");
        let (lo, hi) = visible(call);
        let labels = self.device_labels(call, kv, bits, hi)?;
        let cut = hi - self.params.usize("window").min(hi - lo);
        let q = call.q.squeeze(1)?.to_dtype(DType::F32)?;
        let (heads, _) = q.dims2()?;
        let (kv_heads, r) = labels.channels.dims2()?;
        let group = heads / kv_heads;
        let q_channels = labels.channels.unsqueeze(1)?.broadcast_as((kv_heads, group, r))?.reshape((heads, r))?;
        let ql = q.gather(&q_channels.contiguous()?, 1)?;
        let mut parts = Vec::with_capacity(2);
        if labels.end > 0 {
            parts.push(sparse::label_scores(&ql, &labels.codes, &labels.scale, bits)?);
        }
        if cut > labels.end {
            // Keys past the label cache (the question, the answer so far): labelled as they come.
            let k = kv.keys(call.kv_layer, labels.end, cut)?;
            let (codes, lo_, range) = quantize_rows(&label_values(&k, &labels.channels)?, bits)?;
            let max_q = Tensor::new(((1u32 << bits) - 1) as f32, q.device())?;
            let values = codes.broadcast_mul(&range)?.broadcast_div(&max_q)?.broadcast_add(&lo_)?;
            let t = cut - labels.end;
            let values = values.unsqueeze(1)?.broadcast_as((kv_heads, group, t, r))?.reshape((heads, t, r))?;
            parts.push(values.matmul(&ql.unsqueeze(2)?)?.squeeze(2)?);
        }
        let scores = match cut > lo {
            true => Some(Tensor::cat(&parts, 1)?.narrow(1, lo, cut - lo)?),
            false => None,
        };
        let idx = fast::top_and_window(scores.as_ref(), self.budget.tokens(hi - lo), heads, lo, (cut, hi), q.device())?;
        let out = fast::attend_selected(call, kv, &idx, None)?;
        let row_bytes = (r * bits) as f64 / 8.0 + 4.0;
        Ok(Attended {
            out,
            read: Read::Picked(idx),
            searched: (cut - lo) as f64 * row_bytes / (2 * kv.head_dim()) as f64,
        })
    }
}

impl Attention for DoubleSparsity {
    fn knobs(&self) -> Knobs<'_> {
        Knobs::of(&SPEC, &self.budget, &self.params)
    }

    fn reset(&self) {
        self.labels.clear();
        self.device_labels.clear();
    }

    fn index_section(&self, kv: &dyn KvStore, layer: usize, _layers: usize) -> Result<Option<(String, Vec<u8>)>> {
        let end = kv.saved_len();
        if end == 0 {
            return Ok(None);
        }
        let rows = LayerRows::read_store(kv, layer, end)?;
        let channels = self.channels(layer, rows.kv_heads, rows.head_dim)?;
        let bytes = Self::encode(&rows, &channels, end, self.params.usize("bits"));
        Ok(Some((self.section_name(rows.head_dim, end), bytes)))
    }

    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        let mut sources = self.labels.sources();
        sources.extend(self.device_labels.sources());
        sources
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        // Unquantized labels (bits=16) are the reference's: the label kernel reads codes.
        if let (Some(kv), 1, true) = (call.kv.tier(), call.q.dim(1)?, self.params.usize("bits") <= MAX_CODE_BITS) {
            return self.attend_fast(call, &*kv);
        }
        sparse_decode(call, |rows, lo, hi| {
            let labels = self.layer_labels(call, rows, hi)?;
            let bits = self.params.usize("bits");
            let queries = query_rows(call)?;
            let groups = queries.len() / rows.kv_heads;
            let window = self.params.usize("window").min(hi - lo);
            let cut = hi - window;
            let picks = queries
                .iter()
                .enumerate()
                .map(|(h, q)| {
                    let g = h / groups;
                    let ch = &labels.channels[g];
                    let ql: Vec<f32> = ch.iter().map(|&c| q[0][c]).collect();
                    let score = |p: usize| -> f32 {
                        let fresh;
                        let row = if p < labels.end {
                            &labels.rows[g][p]
                        } else {
                            fresh = label(rows.key(g, p), ch, bits);
                            &fresh
                        };
                        ql.iter().zip(row).map(|(a, b)| a * b).sum()
                    };
                    let mut order = top_positions((lo..cut).collect(), self.budget.tokens(hi - lo), score);
                    order.extend(cut..hi);
                    HeadPick::plain(order)
                })
                .collect();
            let r = labels.channels[0].len();
            // The scan's cost model: 16-bit labels in the KV dtype (the reference file keeps f32).
            let row_bytes = if bits >= FULL_BITS { 2.0 * r as f64 } else { (r * bits) as f64 / 8.0 + 4.0 };
            Ok((picks, (cut - lo) as f64 * row_bytes / (2 * rows.head_dim) as f64))
        })
    }
}
