//! Filling a decode run's K/V tier with random rows (speed depends on where rows lie and how
//! they are stored, not on their values): page-locked in the compute dtype, laid out as a
//! context file of a K/V dtype stores them in host memory, or in a file read on the file tier.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use folio_models::config::ModelConfig;
use folio_models::context::KvDtype;
use folio_models::error::Result;
use folio_models::kv_cache::OffloadKv;

use super::{file, DecodeBench};

/// Rows per KV head written into the host tier at once while filling it.
const FILL_CHUNK: usize = 1 << 16;

/// The K/V tier of the run with its rows, the seconds the fill took, and on the file tier
/// (`--kv-on-disk`) the rows file (removed when dropped) and the disk's read rate.
pub(super) fn fill_tier(
    a: &DecodeBench,
    cfg: &ModelConfig,
    (kv_dtype, dtype): (Option<KvDtype>, DType),
    device: &Device,
    cache: u64,
) -> Result<(OffloadKv, f64, Option<file::RowsFile>, Option<f64>)> {
    match (&a.kv_on_disk, kv_dtype) {
        (Some(dir), Some(stored)) => {
            let (kv, rows_file, secs) = file::fill(dir, cfg, a.context, (stored, dtype), device, cache)?;
            let rate = file::disk_rate(rows_file.path())?;
            Ok((kv, secs, Some(rows_file), Some(rate)))
        }
        _ => {
            let (kv, secs) = fill_kv(cfg, a.context, kv_dtype, dtype, device)?;
            Ok((kv, secs, None, None))
        }
    }
}

/// The offloaded tier filled with random rows for every layer (as a context file of
/// `kv_dtype` stores them when one is given, read in place), and the seconds the fill took.
fn fill_kv(
    cfg: &ModelConfig,
    context: usize,
    kv_dtype: Option<KvDtype>,
    dtype: DType,
    device: &Device,
) -> Result<(OffloadKv, f64)> {
    let fill_start = Instant::now();
    let random_rows = |t: usize| -> candle_core::Result<(Tensor, Tensor)> {
        let shape = (cfg.num_kv_heads, t, cfg.head_dim);
        let k = Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?;
        Ok((k, Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?))
    };
    let kv = match kv_dtype {
        // Stored as a context file of that dtype stores it, read in place (the reopened file's tier).
        Some(kv_dtype) => {
            let shape = (cfg.num_layers, cfg.num_kv_heads, context, cfg.head_dim);
            OffloadKv::stored(shape, kv_dtype, dtype, device, |_, _, t| Ok(random_rows(t)?))?
        }
        None => {
            let mut kv = OffloadKv::new(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context, dtype, device)?;
            for layer in 0..cfg.num_layers {
                for start in (0..context).step_by(FILL_CHUNK) {
                    let (k, v) = random_rows(FILL_CHUNK.min(context - start))?;
                    kv.fill(layer, start, &k, &v)?;
                }
            }
            kv
        }
    };
    device.synchronize()?;
    Ok((kv, fill_start.elapsed().as_secs_f64()))
}
