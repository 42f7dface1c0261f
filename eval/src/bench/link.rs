//! The host link as the offloaded tier reads it, under each emulated rate (`folio bench link`):
//! the check that `--link-gbps` delivers the rate it says.
//!
//! A decode step reads host memory with zero-copy kernels (the gather of picked rows), not with
//! copies, so that is what is timed: random rows of a host tier of `context` rows per KV head
//! gathered onto the device, `picks` rows per query head at a time, back to back, first as the
//! link is and then at each rate asked for ([`folio_kernels::link`]); each row gives the rate
//! achieved and its ratio to the rate asked for (±10% is the mark). The page-locked copy rate
//! (a copy engine's, not paced) is measured beside them, as the link's limit.

use candle_core::{DType, Device, Tensor};
use folio_kernels::select::HostRows;
use folio_kernels::Positions;
use folio_models::error::{Error, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use super::time_calls;

/// Query heads, KV heads, head dim (Qwen2.5-7B's): what a decode step's gather moves.
const SHAPE: (usize, usize, usize) = (28, 4, 128);
/// Rows a KV head's host tier is filled with at once.
const FILL_ROWS: usize = 1 << 16;
/// Bytes of the page-locked copy that measures the copy engine's rate.
const COPY_BYTES: usize = 1 << 30;

/// One gather size at one rate.
#[derive(Serialize)]
pub struct LinkRow {
    /// The emulated rate asked for, bytes/s; `None`: the link as it is.
    pub asked: Option<f64>,
    pub picks: usize,
    pub bytes: f64,
    pub seconds: f64,
    /// bytes ÷ seconds.
    pub rate: f64,
    /// rate ÷ asked (the mark: 0.9–1.1).
    pub of_asked: Option<f64>,
}

#[derive(Serialize)]
pub struct LinkReport {
    pub device: String,
    pub context: usize,
    /// The page-locked copy's rate (a copy engine; not paced).
    pub copy_rate: f64,
    pub rows: Vec<LinkRow>,
}

/// Times the gather of `picks` rows per query head at each of `rates` (bytes/s; `None`: the
/// link as it is) on `device`, a GPU; the emulated rate in force before is back afterwards.
pub fn run(device: &Device, context: usize, picks: &[usize], rates: &[Option<f64>]) -> Result<LinkReport> {
    if !device.is_cuda() {
        return Err(Error::Invalid("bench link measures the host link of a GPU: run it with --device cuda".into()));
    }
    let (heads, kv_heads, d) = SHAPE;
    let dtype = DType::BF16;
    let mut host = HostRows::new(device, dtype, kv_heads, context, d)?;
    for start in (0..context).step_by(FILL_ROWS) {
        let t = FILL_ROWS.min(context - start);
        host.write(start, &Tensor::randn(0f32, 1.0, (kv_heads, t, d), device)?.to_dtype(dtype)?)?;
    }
    let copy_rate = folio_runtime::device::host_to_device_rate(device, COPY_BYTES)?;
    let before = folio_kernels::link::rate();
    let mut rng = StdRng::seed_from_u64(0);
    let mut rows = Vec::new();
    let measured = (|| -> Result<()> {
        for &asked in rates {
            folio_kernels::link::set_rate(asked);
            for &sel in picks {
                let idx: Vec<u32> = (0..heads * sel).map(|_| rng.random_range(0..context as u32)).collect();
                let idx = Tensor::from_vec(idx, (heads, sel), device)?;
                let seconds = time_calls(device, || host.gather(&idx, heads / kv_heads, None, Positions::Trusted))?;
                let bytes = (heads * sel * d * dtype.size_in_bytes()) as f64;
                let rate = bytes / seconds;
                rows.push(LinkRow { asked, picks: sel, bytes, seconds, rate, of_asked: asked.map(|a| rate / a) });
            }
        }
        Ok(())
    })();
    folio_kernels::link::set_rate(before);
    measured?;
    Ok(LinkReport { device: folio_models::device_name(device), context, copy_rate, rows })
}
