//! A mask searched a step ahead, and on a GPU its rows gathered beside the step too.
//!
//! Why: HiP's search runs on the GPU's side stream while the step goes on (its reads of the
//! representative keys cross the host link); the rows of the mask it finds were then gathered
//! at the next step, on the step's own stream — ~600 rows a query head over the same link, 0.54
//! ms a step of link time at 1M tokens on an H200 (three masks a step), slower still while the
//! next search shared the link. Queued on the side stream right after the search, that gather
//! overlaps the step as the search does, and the next step only waits for it and stacks the
//! rows it gathered. Where the tier reads rows from a file (the read-ahead's place), or the
//! search ran on the CPU or in the step's own order, the next step gathers as before.

use candle_core::{Device, Tensor};

use super::on_host::Searched;
use crate::error::Result;
use crate::kv_cache::{DecodeTier, ReadAhead};

#[cfg(feature = "cuda")]
type Gathered = folio_method_kernels::hip::Gathered;
#[cfg(not(feature = "cuda"))]
type Gathered = std::convert::Infallible;

/// A layer's next mask on the fast path, searched at its turn with that step's query (queued
/// ahead: on a GPU it runs beside the rest of the step) and taken up at the next step: the pick
/// ([`super::Hip`]'s), where its window starts, and the sinks, heads and step it was made for;
/// where the tier reads its rows from a slower medium, the read of the pick's rows begun as
/// the search ends ([`DecodeTier::read_ahead`]: the file tier reads a refresh's blocks from
/// disk while the step goes on, and the next step's gather finds them cached); where it keeps
/// them in host memory and the search is on the side stream, their gather queued after it
/// ([`gather_ahead`]).
pub(super) struct Ahead {
    pub picked: Option<Searched>,
    pub read: Option<ReadAhead>,
    pub gathered: Option<Gathered>,
    pub window_start: usize,
    pub lo: usize,
    pub heads: usize,
    pub built_hi: usize,
}

/// The picked rows of `picked` (a search on the side stream) and the window's rows
/// `window_start..hi`, gathered on the side stream after the search, for `heads` query heads of
/// `layer`: their K and V as `[picks K, picks V, window K, window V]` (the window's pair absent
/// when it is empty). `None` where nothing can be queued so.
#[cfg(feature = "cuda")]
pub(super) fn gather_ahead(
    kv: &dyn DecodeTier,
    layer: usize,
    picked: &Searched,
    (window_start, hi): (usize, usize),
    heads: usize,
) -> Result<Option<Gathered>> {
    let Searched::Device(found) = picked else { return Ok(None) };
    let wrap = candle_core::Error::wrap;
    Ok(found.gather_after(|idx, side| {
        let Some(mut work) = kv.gather_after(layer, idx, hi, side).map_err(wrap)? else { return Ok(None) };
        if hi > window_start {
            let all: Vec<u32> = (window_start as u32..hi as u32).collect();
            let window = Tensor::from_vec(all, (1, hi - window_start), kv.device())?.repeat((heads, 1))?;
            let rows = kv.gather_after(layer, &window, hi, side).map_err(wrap)?;
            let Some(rows) = rows else { candle_core::bail!("hip: the tier gathered the picks ahead, not the window") };
            work.written.extend(rows.written);
            work.read.extend(rows.read.into_iter().chain([window]));
        }
        Ok(Some(work))
    })?)
}

#[cfg(not(feature = "cuda"))]
pub(super) fn gather_ahead(
    _: &dyn DecodeTier,
    _: usize,
    _: &Searched,
    _: (usize, usize),
    _: usize,
) -> Result<Option<Gathered>> {
    Ok(None)
}

/// What [`gather_ahead`] gathered, for the step's own stream from now on: K and V of the
/// picks, then of the window, each `[heads, rows, d]`, followed by `room` rows to write into
/// (their values never read: a row is read once written).
#[cfg(feature = "cuda")]
pub(super) fn stacked(gathered: Gathered, room: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let rows = gathered.take()?;
    let (heads, _, d) = rows[0].dims3()?;
    let free = Tensor::zeros((heads, room, d), rows[0].dtype(), device)?;
    let side = |first: usize| -> Result<Tensor> {
        let parts: Vec<&Tensor> = rows.iter().skip(first).step_by(2).chain([&free]).collect();
        Ok(Tensor::cat(&parts, 1)?)
    };
    Ok((side(0)?, side(1)?))
}

#[cfg(not(feature = "cuda"))]
pub(super) fn stacked(gathered: Gathered, _: usize, _: &Device) -> Result<(Tensor, Tensor)> {
    match gathered {}
}
