//! Double Sparsity's offline calibration (the paper's outlier channels): which
//! channels of q·k carry the scores, per layer and KV head. Channel sparsity is static — the
//! same few "outlier" channels dominate q·k whatever the input — so it is measured once over a
//! few documents and reused for every context of that model.
//!
//! Statistic: the paper's qk outlier, `mean_t |q[t,h,i] · k[t,h/G,i]|` over post-RoPE queries
//! and keys of the same token, over every token of every 512-token block (the authors' script
//! overwrote it per block; we accumulate), and summed over the query heads of each KV group: one
//! channel set per KV head (the spec's policy B), so the label cache stays at its paper size
//! instead of G times it, while each query head still ranks tokens with its own query.
//!
//! The result is a small JSON file next to the model, stamped with the model's fingerprint so
//! a file calibrated on another model (or another tokenizer) is refused, not silently used.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::attention::{Attended, Attention, AttnCall, Channels, Dense, Knobs};
use crate::context::{write_atomic, ModelStamp};
use crate::error::{Error, Result};
use crate::model::Logits;
use crate::Engine;

/// The calibration file's name in the model folder.
pub const FILE: &str = "folio-channels.json";
/// Tokens per calibration forward (the authors' block length).
pub const BLOCK: usize = 512;
/// Blocks measured by default: the authors' 256 documents of ≤ 512 tokens.
pub const DEFAULT_BLOCKS: usize = 256;

/// A model's calibration file: the channels and what they were measured on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Calibration {
    pub model: ModelStamp,
    pub statistic: String,
    /// Tokens the statistic was measured over, and the documents they came from.
    pub tokens: usize,
    pub documents: Vec<String>,
    pub channels: Channels,
}

impl Calibration {
    pub fn path(model_dir: &Path) -> PathBuf {
        model_dir.join(FILE)
    }

    /// The model's calibration, refused if it was made for another model.
    pub fn load(model_dir: &Path, stamp: &ModelStamp) -> Result<Self> {
        let path = Self::path(model_dir);
        let bytes = std::fs::read(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::Invalid(format!(
                    "{} does not exist: run `folio calibrate --model {} --docs <files>` once for double-sparsity \
                     (in the window: Settings, Calibrate on this context's documents)",
                    path.display(),
                    stamp.source
                ))
            } else {
                Error::io(&path, e)
            }
        })?;
        let c: Self = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Invalid(format!("{} is not a Folio channel calibration: {e}", path.display())))?;
        if c.model.fingerprint != stamp.fingerprint {
            return Err(Error::Invalid(format!(
                "{} was calibrated for model {}, not this one: run `folio calibrate` again",
                path.display(),
                c.model.name
            )));
        }
        let fp = &stamp.fingerprint;
        let shape_ok = c.channels.order.len() == fp.layers
            && c.channels.order.iter().all(|l| {
                l.len() == fp.kv_heads
                    && l.iter().all(|h| {
                        let mut s = h.clone();
                        s.sort_unstable();
                        s.iter().enumerate().all(|(i, &x)| i == x as usize) && s.len() == fp.head_dim
                    })
            });
        if !shape_ok {
            return Err(Error::Invalid(format!("{} is damaged: channel lists do not match the model", path.display())));
        }
        Ok(c)
    }

    pub fn save(&self, model_dir: &Path) -> Result<PathBuf> {
        let path = Self::path(model_dir);
        std::fs::create_dir_all(model_dir).map_err(|e| Error::io(model_dir, e))?;
        let json = serde_json::to_vec_pretty(self).map_err(|e| Error::Invalid(e.to_string()))?;
        write_atomic(&path, &json)?;
        Ok(path)
    }
}

/// Dense attention that also accumulates the qk statistic of every call.
struct QkStatistic {
    /// `[layer][kv_head][channel]`.
    acc: Mutex<Vec<Vec<Vec<f64>>>>,
}

impl Attention for QkStatistic {
    fn knobs(&self) -> Knobs<'_> {
        Dense::KNOBS
    }

    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended> {
        let (q_heads, t, d) = call.q.dims3()?;
        let end = call.q_start + t;
        // The call's own keys: the last `t` rows of the store.
        let segs = call.kv.segments(call.kv_layer, end)?;
        let ks: Vec<_> = segs.iter().map(|s| s.k.clone()).collect();
        let k = candle_core::Tensor::cat(&ks, 1)?
            .narrow(1, call.q_start, t)?
            .to_dtype(candle_core::DType::F32)?
            .to_device(&candle_core::Device::Cpu)?
            .to_vec3::<f32>()?;
        let q = call.q.to_dtype(candle_core::DType::F32)?.to_device(&candle_core::Device::Cpu)?.to_vec3::<f32>()?;
        let groups = q_heads / k.len();
        {
            let mut acc = self.acc.lock().unwrap_or_else(|e| e.into_inner());
            let layer = &mut acc[call.layer];
            for (h, qh) in q.iter().enumerate() {
                let kvh = h / groups;
                for (qt, kt) in qh.iter().zip(&k[kvh]) {
                    for i in 0..d {
                        layer[kvh][i] += (qt[i] * kt[i]).abs() as f64;
                    }
                }
            }
        }
        Dense.attend(call)
    }
}

/// Measures the channel order over `documents` (name, token ids), in blocks of [`BLOCK`]
/// tokens, at most `max_blocks` of them. `progress(done, total)` after each block.
pub fn calibrate(
    engine: &Engine,
    documents: &[(String, Vec<u32>)],
    max_blocks: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<Calibration> {
    let cfg = engine.config();
    // The documents back to back, cut into blocks (the authors' recipe); a short last block
    // still counts, per token (the statistic is Σ|q_i k_i| over every token, divided once).
    let all: Vec<u32> = documents.iter().flat_map(|(_, ids)| ids.iter().copied()).collect();
    let blocks: Vec<&[u32]> = all.chunks(BLOCK).filter(|b| b.len() > 1).take(max_blocks).collect();
    if blocks.is_empty() {
        return Err(Error::Invalid("calibration needs at least one document with 2 or more tokens".into()));
    }
    let stat = QkStatistic { acc: Mutex::new(vec![vec![vec![0.0; cfg.head_dim]; cfg.num_kv_heads]; cfg.num_layers]) };
    for (i, block) in blocks.iter().enumerate() {
        let mut kv = engine.model.new_kv();
        engine.model.forward(block, &mut kv, &stat, Logits::Last)?;
        progress(i + 1, blocks.len());
    }
    let acc = stat.acc.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(Calibration {
        model: engine.stamp()?.clone(),
        statistic: "qk: mean |q_i k_i| over post-RoPE rows, summed over each KV group".into(),
        tokens: blocks.iter().map(|b| b.len()).sum(),
        documents: documents.iter().map(|(n, _)| n.clone()).collect(),
        channels: Channels::from_statistic(&acc),
    })
}
