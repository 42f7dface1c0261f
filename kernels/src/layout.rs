//! How the kernels take their inputs: whether gathered positions are checked, and the
//! alignment the GPU kernels' 16-byte loads need. Shared by every kernel family, so it sits
//! beside them rather than in the crate root that re-exports them.

/// Whether a gathering kernel checks its positions against the stored rows before it runs.
/// On a GPU the check is a reduction and a device synchronisation per call, which a decode
/// step cannot afford a hundred times over; positions the caller's own selection produced
/// (top-k over a score row, a window, an arange) are `Trusted`. The kernels clamp every
/// position either way, so a wrong one reads a wrong row, never memory outside the buffer.
/// On the CPU the check is free and always made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Positions {
    Check,
    Trusted,
}

/// `t` contiguous and starting on a 16-byte boundary of its buffer (for 2- and 4-byte dtypes):
/// the kernels read rows with 16-byte loads, so a view starting mid-vector is copied first,
/// into a buffer of its own (candle's `Tensor::copy` clones the whole buffer and keeps the
/// view's offset, which left such a view misaligned).
#[cfg(feature = "cuda")]
pub(crate) fn vector_aligned(t: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    let t = t.contiguous()?;
    if t.layout().start_offset() % 8 == 0 {
        return Ok(t);
    }
    let flat = t.flatten_all()?;
    let fresh = candle_core::Tensor::zeros(flat.elem_count(), t.dtype(), t.device())?;
    fresh.slice_set(&flat, 0, 0)?;
    fresh.reshape(t.shape())
}
