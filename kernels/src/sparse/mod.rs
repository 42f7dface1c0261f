//! Sparse-decode primitives: attention over selected key rows, and SimHash codes.
//!
//! Each has a [`reference`] over plain slices (f64 sums, straight from the definition) and a
//! fast path over candle tensors: the reference itself on the CPU (the sparse methods' CPU
//! work is already per-row loops), hand-written kernels (kernels/cuda/sparse.cu, compiled to
//! PTX by build.rs) on CUDA. The attention kernel gathers the selected rows itself, so a decode
//! step reads only the K and V rows it attends; it splits each head's selection over about a
//! thousand blocks (at least 128 rows each, in tiles of 128 rows scored one per thread) and
//! merges their partials by LSE in a second kernel. SimHash sums each projection in
//! f32 in channel order, as its reference does, so codes agree bit for bit across devices (a
//! GEMM would round differently and flip the sign of near-zero projections: an index built on
//! the GPU would sample other keys than the CPU's).
//!
//! Costs, for the benchmarks' ratio to the hardware limit (per call; `h` query heads, `s`
//! selected rows per head, `d` head dim, `b` bytes per K/V element):
//! * decode attention: 4·h·s·d FLOPs, h·s·(2·d·b + 4) bytes read (+4 with a bias) — bandwidth-bound
//!   (≈ 0.5 FLOP/byte at bf16), so its limit is memory bandwidth;
//! * SimHash codes: 2·r·d·K·L FLOPs, r·d·4 + d·K·L·4 + r·L·4 bytes — compute-bound for the
//!   paper's K·L = 1500.

use candle_core::{DType, Device, Result, Tensor};

use rayon::prelude::*;

use crate::Positions;

/// Most hash bits per table a code may hold (a cap of this API, well above MagicPIG's K ≤ 12;
/// a u32 code holds 32).
pub const MAX_SIMHASH_BITS: usize = 16;

/// The plain-slice definitions the fast paths are held to.
pub mod reference;

fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()
}

/// Attention of each query head over its selected rows: `q [heads, d]`, `k`, `v`
/// `[kv_heads, n, d]` (f32 or bf16), `idx [heads, sel]` u32 positions, `bias [heads, sel]`
/// f32 or none. Returns `(out [heads, d] f32, lse [heads] f32)` on `q`'s device.
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    idx: &Tensor,
    bias: Option<&Tensor>,
    scale: f32,
    positions: Positions,
) -> Result<(Tensor, Tensor)> {
    let (heads, d) = q.dims2()?;
    let (kv_heads, n, kd) = k.dims3()?;
    let ih = idx.dim(0)?;
    if idx.rank() != 2 || kd != d || v.dims() != k.dims() || ih != heads || kv_heads == 0 || heads % kv_heads != 0 {
        candle_core::bail!(
            "decode_attention: shapes q {:?} k {:?} v {:?} idx {:?}",
            q.dims(),
            k.dims(),
            v.dims(),
            idx.dims()
        );
    }
    if let Some(b) = bias {
        if b.dims() != idx.dims() {
            candle_core::bail!("decode_attention: bias {:?} does not match idx {:?}", b.dims(), idx.dims());
        }
    }
    match q.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            cuda::decode_attention(q, k, v, idx, bias, (heads, kv_heads, n, d, idx.dim(1)?), scale, positions)
        }
        device => {
            let _ = positions; // the CPU checks every position: it costs nothing there
            let idx_v: Vec<u32> = idx.flatten_all()?.to_vec1()?;
            if let Some(&bad) = idx_v.iter().find(|&&p| p as usize >= n) {
                candle_core::bail!("decode_attention: position {bad} is past the {n} stored rows");
            }
            let bias_v = bias.map(f32s).transpose()?;
            let (out, lse) = reference::decode_attention(
                &f32s(q)?,
                &f32s(k)?,
                &f32s(v)?,
                &idx_v,
                bias_v.as_deref(),
                (heads, kv_heads, n, d),
                scale,
            );
            Ok((Tensor::from_vec(out, (heads, d), device)?, Tensor::from_vec(lse, heads, device)?))
        }
    }
}

/// Label scores `[heads, n]` (see [`reference::label_scores`]): `ql [heads, r]` f32, `codes
/// [kv_heads, n, r]` u8, `scale [kv_heads, n, 2]` f32.
pub fn label_scores(ql: &Tensor, codes: &Tensor, scale: &Tensor, bits: usize) -> Result<Tensor> {
    let (heads, r) = ql.dims2()?;
    let (kv_heads, n, cr) = codes.dims3()?;
    if cr != r || scale.dims() != [kv_heads, n, 2] || kv_heads == 0 || heads % kv_heads != 0 || !(1..=8).contains(&bits)
    {
        candle_core::bail!(
            "label_scores: ql {:?}, codes {:?}, scale {:?}, {bits} bits",
            ql.dims(),
            codes.dims(),
            scale.dims()
        );
    }
    match ql.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::label_scores(ql, codes, scale, (heads, kv_heads, n, r), bits),
        device => {
            let codes_v: Vec<u8> = codes.flatten_all()?.to_vec1()?;
            let out = reference::label_scores(&f32s(ql)?, &codes_v, &f32s(scale)?, (heads, kv_heads, n, r), bits);
            Tensor::from_vec(out, (heads, n), device)
        }
    }
}

/// Rows per task of the CPU SimHash: enough to amortise the task, few enough to spread an
/// index build's chunk over every core.
const SIMHASH_ROWS_PER_TASK: usize = 256;

/// SimHash codes `[rows, tables]` u32 of `x [rows, d]` against `w [d, bits·tables]` (f32), bit
/// for bit [`reference::simhash_codes`] on every device: on the CPU the reference over the
/// cores, on CUDA a kernel summing in the same order without fused multiply-adds.
pub fn simhash_codes(x: &Tensor, w: &Tensor, bits: usize, tables: usize) -> Result<Tensor> {
    let (rows, d) = x.dims2()?;
    if w.dims() != [d, bits * tables] || bits == 0 || bits > MAX_SIMHASH_BITS || tables == 0 {
        candle_core::bail!("simhash_codes: x {:?}, w {:?}, {bits} bits x {tables} tables", x.dims(), w.dims());
    }
    if rows == 0 {
        return Tensor::zeros((0, tables), DType::U32, x.device());
    }
    match x.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::simhash_codes(x, w, (rows, d, bits, tables)),
        device => {
            let (x, w) = (f32s(x)?, f32s(w)?);
            let codes: Vec<u32> = x
                .par_chunks(SIMHASH_ROWS_PER_TASK * d.max(1))
                .flat_map_iter(|rows| reference::simhash_codes(rows, &w, d, bits, tables))
                .collect();
            Tensor::from_vec(codes, (rows, tables), device)
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda;
