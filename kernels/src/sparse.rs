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
pub mod reference {
    /// Attention of each query head `h` over the rows `idx[h]` of its KV head `h / (heads /
    /// kv_heads)`, logits `q·k·scale + bias`. Returns `out [heads, d]` and `lse [heads]`
    /// (`-inf` and zeros for an empty selection).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        idx: &[u32],
        bias: Option<&[f32]>,
        (heads, kv_heads, n, d): (usize, usize, usize, usize),
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let sel = idx.len().checked_div(heads).unwrap_or(0);
        let group = heads / kv_heads;
        let (mut out, mut lse) = (vec![0f32; heads * d], vec![f32::NEG_INFINITY; heads]);
        for h in 0..heads {
            let base = (h / group) * n * d;
            let logits: Vec<f64> = (0..sel)
                .map(|j| {
                    let row = base + idx[h * sel + j] as usize * d;
                    let dot: f64 = (0..d).map(|i| q[h * d + i] as f64 * k[row + i] as f64).sum();
                    dot * scale as f64 + bias.map_or(0.0, |b| b[h * sel + j] as f64)
                })
                .collect();
            if logits.is_empty() {
                continue;
            }
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = logits.iter().map(|z| (z - max).exp()).sum();
            for (j, z) in logits.iter().enumerate() {
                let p = (z - max).exp() / total;
                let row = base + idx[h * sel + j] as usize * d;
                for i in 0..d {
                    out[h * d + i] += (p * v[row + i] as f64) as f32;
                }
            }
            lse[h] = (max + total.ln()) as f32;
        }
        (out, lse)
    }

    /// Label score of every token for each query head: `ql [heads, r]` against the dequantized
    /// labels `code · range / (2^bits − 1) + offset` of its KV head, `codes [kv_heads, n, r]`,
    /// `scale [kv_heads, n, 2]` (offset, range). Returns `[heads, n]`.
    pub fn label_scores(
        ql: &[f32],
        codes: &[u8],
        scale: &[f32],
        (heads, kv_heads, n, r): (usize, usize, usize, usize),
        bits: usize,
    ) -> Vec<f32> {
        let max_q = ((1u32 << bits) - 1) as f64;
        let group = heads / kv_heads;
        let mut out = Vec::with_capacity(heads * n);
        for h in 0..heads {
            let g = h / group;
            for p in 0..n {
                let (lo, range) = (scale[(g * n + p) * 2] as f64, scale[(g * n + p) * 2 + 1] as f64);
                let score: f64 = (0..r)
                    .map(|i| ql[h * r + i] as f64 * (codes[(g * n + p) * r + i] as f64 * range / max_q + lo))
                    .sum();
                out.push(score as f32);
            }
        }
        out
    }

    /// HiP's block scores: for each query head and block start, the largest q·k over the keys
    /// `start..min(start + block, end)` of its KV head (`-inf` when empty). `starts [heads, m]`.
    pub fn block_scores(
        q: &[f32],
        k: &[f32],
        starts: &[u32],
        (heads, kv_heads, n, d): (usize, usize, usize, usize),
        block: usize,
        end: usize,
    ) -> Vec<f32> {
        let m = starts.len().checked_div(heads).unwrap_or(0);
        let group = heads / kv_heads;
        let mut out = Vec::with_capacity(heads * m);
        for h in 0..heads {
            let base = (h / group) * n * d;
            for &start in &starts[h * m..(h + 1) * m] {
                let first = start as usize;
                let last = (first + block).min(end.min(n));
                let best = (first..last)
                    .map(|p| (0..d).map(|i| q[h * d + i] as f64 * k[base + p * d + i] as f64).sum::<f64>())
                    .fold(f64::NEG_INFINITY, f64::max);
                out.push(best as f32);
            }
        }
        out
    }

    /// Code of each row of `x [rows, d]` in each of `tables` tables: bit `b` of table `l` is
    /// `x · w[:, l·bits + b] > 0`, `w [d, bits·tables]`. Each projection is an f32 sum over the
    /// channels in order, one rounded multiply and one rounded add per channel: the definition
    /// every device computes bit for bit (no f64 here, unlike the other references), so a key
    /// hashed on the GPU lands in the bucket the CPU would give it and an index built on either
    /// samples the same keys. The loop runs over all planes per channel, which vectorizes
    /// without changing any plane's order of additions.
    pub fn simhash_codes(x: &[f32], w: &[f32], d: usize, bits: usize, tables: usize) -> Vec<u32> {
        let planes = bits * tables;
        let rows = x.len() / d.max(1);
        let mut codes = Vec::with_capacity(rows * tables);
        let mut proj = vec![0f32; planes];
        for r in 0..rows {
            proj.fill(0.0);
            for (i, &xi) in x[r * d..(r + 1) * d].iter().enumerate() {
                for (p, &wv) in proj.iter_mut().zip(&w[i * planes..(i + 1) * planes]) {
                    *p += xi * wv;
                }
            }
            codes.extend(
                proj.chunks(bits).map(|t| t.iter().enumerate().fold(0u32, |c, (b, &p)| c | (u32::from(p > 0.0) << b))),
            );
        }
        codes
    }
}

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

/// HiP block scores `[heads, m]` (see [`reference::block_scores`]): `q [heads, d]`, `k
/// [kv_heads, n, d]` (f32 or bf16), `starts [heads, m]` u32.
pub fn block_scores(q: &Tensor, k: &Tensor, starts: &Tensor, block: usize, end: usize) -> Result<Tensor> {
    let (heads, d) = q.dims2()?;
    let (kv_heads, n, kd) = k.dims3()?;
    let (sh, m) = starts.dims2()?;
    if kd != d || sh != heads || kv_heads == 0 || heads % kv_heads != 0 || block == 0 {
        candle_core::bail!(
            "block_scores: q {:?}, k {:?}, starts {:?}, block {block}",
            q.dims(),
            k.dims(),
            starts.dims()
        );
    }
    match q.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::block_scores(q, k, starts, (heads, kv_heads, n, d, m), block, end),
        device => {
            let starts_v: Vec<u32> = starts.flatten_all()?.to_vec1()?;
            let out = reference::block_scores(&f32s(q)?, &f32s(k)?, &starts_v, (heads, kv_heads, n, d), block, end);
            Tensor::from_vec(out, (heads, m), device)
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
mod cuda {
    //! Launching the kernels of kernels/cuda/sparse.cu through candle's CUDA device: each is a
    //! `CustomOp` whose extra inputs ride in the op, so the output is an ordinary tensor.

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

    use crate::Positions;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sparse.ptx"));
    const MODULE: &str = "folio_sparse";
    /// Threads per block of the decode kernels (WARPS in the kernel) and of the kernels with a
    /// thread per item (`grid_for`).
    const DECODE_THREADS: u32 = 128;
    const HASH_THREADS: u32 = 256;
    /// Decode blocks aimed for (a few per SM of a large GPU, so the row loads in flight cover
    /// the memory latency), and the fewest selected rows a block takes (one tile: TILE in the
    /// kernel, a row per thread).
    const TARGET_BLOCKS: usize = 1024;
    const MIN_ROWS_PER_BLOCK: usize = 128;
    /// Largest head dim decode_attention holds in registers (MAX_D in the kernel).
    const MAX_D: usize = 256;

    fn cuda_storage<'a>(s: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
        match s {
            Storage::Cuda(c) => Ok(c),
            _ => candle_core::bail!("{what} must be on the CUDA device"),
        }
    }

    struct DecodeAttention {
        idx: Tensor,
        bias: Option<Tensor>,
        dims: (usize, usize, usize, usize, usize),
        scale: f32,
    }

    impl CustomOp3 for DecodeAttention {
        fn name(&self) -> &'static str {
            "folio-decode-attention"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("decode_attention runs the reference on the CPU, not this op")
        }

        fn cuda_fwd(
            &self,
            q: &CudaStorage,
            ql: &Layout,
            k: &CudaStorage,
            kl: &Layout,
            v: &CudaStorage,
            vl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (heads, kv_heads, n, d, sel) = self.dims;
            let chunks = sel.div_ceil(MIN_ROWS_PER_BLOCK).min(TARGET_BLOCKS.div_ceil(heads)).max(1);
            let rows_per_block = sel.div_ceil(chunks).max(1);
            let dev = q.device().clone();
            let (idx_s, il) = self.idx.storage_and_layout();
            let idx = cuda_storage(&idx_s, "idx")?.as_cuda_slice::<u32>()?.slice(il.start_offset()..);
            // Without a bias the kernel gets a null pointer and reads none.
            let bias_guard = self.bias.as_ref().map(|b| b.storage_and_layout());
            let bias = match &bias_guard {
                Some((s, l)) => Some(cuda_storage(s, "bias")?.as_cuda_slice::<f32>()?.slice(l.start_offset()..)),
                None => None,
            };
            let null: u64 = 0;
            let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
            // SAFETY: every block writes its chunk's partial (an empty chunk writes m = -inf).
            let part = unsafe { dev.alloc::<f32>(heads * chunks * (d + 2))? };
            let cfg = LaunchConfig {
                grid_dim: (heads as u32, chunks as u32, 1),
                block_dim: (DECODE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let ints = [heads as i32, kv_heads as i32, n as i32, d as i32, sel as i32, rows_per_block as i32];
            macro_rules! launch {
                ($t:ty, $name:literal) => {{
                    let ks = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
                    let vs = v.as_cuda_slice::<$t>()?.slice(vl.start_offset()..);
                    let func = dev.get_or_load_custom_func($name, MODULE, PTX)?;
                    let mut b = func.builder();
                    b.arg(&qs).arg(&ks).arg(&vs).arg(&idx);
                    match &bias {
                        Some(bias) => b.arg(bias),
                        None => b.arg(&null),
                    };
                    b.arg(&part);
                    for x in &ints {
                        b.arg(x);
                    }
                    b.arg(&self.scale);
                    // SAFETY: shapes checked by the caller; positions are < n (checked there).
                    unsafe { b.launch(cfg) }.w()?;
                }};
            }
            match k.dtype() {
                DType::F32 => launch!(f32, "decode_attention_partial_f32"),
                DType::BF16 => launch!(half::bf16, "decode_attention_partial_bf16"),
                other => candle_core::bail!("decode_attention: K/V must be f32 or bf16, not {other:?}"),
            }
            // SAFETY: the merge writes every output row and LSE.
            let out = unsafe { dev.alloc::<f32>(heads * d + heads)? };
            {
                let (out_o, out_l) = (out.slice(..heads * d), out.slice(heads * d..));
                let func = dev.get_or_load_custom_func("decode_attention_merge", MODULE, PTX)?;
                let mut b = func.builder();
                let (chunks, d) = (chunks as i32, d as i32);
                b.arg(&part).arg(&out_o).arg(&out_l).arg(&chunks).arg(&d);
                let cfg = LaunchConfig {
                    grid_dim: (heads as u32, 1, 1),
                    block_dim: (DECODE_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: part holds heads × chunks partials of d + 2 floats.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(heads * d + heads)))
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        idx: &Tensor,
        bias: Option<&Tensor>,
        dims: (usize, usize, usize, usize, usize),
        scale: f32,
        positions: Positions,
    ) -> Result<(Tensor, Tensor)> {
        let (heads, _, n, d, sel) = dims;
        if d > MAX_D {
            candle_core::bail!("decode_attention: head dim {d} > {MAX_D}");
        }
        // A position past the stored rows is refused, never silently replaced (the kernel also
        // clamps, so it cannot read out of bounds); the check is a reduction and a device sync.
        if sel > 0 && (n == 0 || (positions == Positions::Check && idx.max_all()?.to_scalar::<u32>()? as usize >= n)) {
            candle_core::bail!("decode_attention: a position is past the {n} stored rows");
        }
        let bias = bias.map(|b| b.to_dtype(DType::F32)?.contiguous()).transpose()?;
        let op = DecodeAttention { idx: idx.contiguous()?, bias, dims, scale };
        let both = q.to_dtype(DType::F32)?.contiguous()?.apply_op3_no_bwd(
            &crate::vector_aligned(k)?,
            &crate::vector_aligned(v)?,
            &op,
        )?;
        Ok((both.narrow(0, 0, heads * d)?.reshape((heads, d))?, both.narrow(0, heads * d, heads)?))
    }

    /// Threads of a SimHash block: rows × tables (SH_ROWS and SH_TABLES in the kernel).
    const SH_ROWS: usize = 32;
    const SH_TABLES: usize = 8;

    struct SimHash {
        dims: (usize, usize, usize, usize),
    }

    impl candle_core::CustomOp2 for SimHash {
        fn name(&self) -> &'static str {
            "folio-simhash"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("simhash_codes runs the reference on the CPU, not this op")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (rows, d, bits, tables) = self.dims;
            let dev = x.device().clone();
            let xs = x.as_cuda_slice::<f32>()?.slice(xl.start_offset()..);
            let ws = w.as_cuda_slice::<f32>()?.slice(wl.start_offset()..);
            // SAFETY: one thread writes each code.
            let codes = unsafe { dev.alloc::<u32>(rows * tables)? };
            let (Ok(gx), Ok(gy)) = (u32::try_from(rows.div_ceil(SH_ROWS)), u32::try_from(tables.div_ceil(SH_TABLES)))
            else {
                candle_core::bail!("simhash_codes: {rows} rows are more than one launch holds");
            };
            let cfg = LaunchConfig {
                grid_dim: (gx, gy, 1),
                block_dim: (SH_ROWS as u32, SH_TABLES as u32, 1),
                shared_mem_bytes: (SH_ROWS * (d + 1) * 4) as u32,
            };
            let func = dev.get_or_load_custom_func("simhash_codes", MODULE, PTX)?;
            let mut b = func.builder();
            let ints = [rows as i32, d as i32, bits as i32, tables as i32];
            b.arg(&xs).arg(&ws).arg(&codes);
            for i in &ints {
                b.arg(i);
            }
            // SAFETY: sizes from the checked shapes; the shared rows fit (d ≤ MAX_D).
            unsafe { b.launch(cfg) }.w()?;
            Ok((CudaStorage::wrap_cuda_slice(codes, dev), Shape::from((rows, tables))))
        }
    }

    pub fn simhash_codes(x: &Tensor, w: &Tensor, dims: (usize, usize, usize, usize)) -> Result<Tensor> {
        if dims.1 > MAX_D {
            candle_core::bail!("simhash_codes: head dim {} > {MAX_D}", dims.1);
        }
        let (x, w) = (x.to_dtype(DType::F32)?.contiguous()?, w.to_dtype(DType::F32)?.contiguous()?);
        x.apply_op2_no_bwd(&w, &SimHash { dims })
    }

    /// One thread per (query head, token) or one warp per (query head, block): the launch size.
    fn grid_for(threads: usize, what: &str) -> Result<LaunchConfig> {
        let Ok(total) = u32::try_from(threads) else {
            candle_core::bail!("{what}: {threads} threads are more than one launch holds");
        };
        Ok(LaunchConfig {
            grid_dim: (total.div_ceil(HASH_THREADS).max(1), 1, 1),
            block_dim: (HASH_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    struct LabelScores {
        dims: (usize, usize, usize, usize),
        bits: usize,
    }

    impl CustomOp3 for LabelScores {
        fn name(&self) -> &'static str {
            "folio-label-scores"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("label_scores runs the reference on the CPU, not this op")
        }

        fn cuda_fwd(
            &self,
            ql: &CudaStorage,
            qll: &Layout,
            codes: &CudaStorage,
            cl: &Layout,
            scale: &CudaStorage,
            sl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (heads, kv_heads, n, r) = self.dims;
            let dev = ql.device().clone();
            let qs = ql.as_cuda_slice::<f32>()?.slice(qll.start_offset()..);
            let cs = codes.as_cuda_slice::<u8>()?.slice(cl.start_offset()..);
            let ss = scale.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
            // SAFETY: one thread writes each score.
            let out = unsafe { dev.alloc::<f32>(heads * n)? };
            let cfg = grid_for(heads * n, "label_scores")?;
            let func = dev.get_or_load_custom_func("label_scores", MODULE, PTX)?;
            let mut b = func.builder();
            let ints = [heads as i32, kv_heads as i32, n as i32, r as i32];
            let max_q = ((1u32 << self.bits) - 1) as f32;
            b.arg(&qs).arg(&cs).arg(&ss).arg(&out);
            for i in &ints {
                b.arg(i);
            }
            b.arg(&max_q);
            // SAFETY: sizes from the checked shapes.
            unsafe { b.launch(cfg) }.w()?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((heads, n))))
        }
    }

    pub fn label_scores(
        ql: &Tensor,
        codes: &Tensor,
        scale: &Tensor,
        dims: (usize, usize, usize, usize),
        bits: usize,
    ) -> Result<Tensor> {
        let ql = ql.to_dtype(DType::F32)?.contiguous()?;
        let scale = scale.to_dtype(DType::F32)?.contiguous()?;
        // The kernel reads codes 16 at a time: a view starting mid-vector is copied first.
        let codes = if codes.layout().start_offset() % 16 == 0 { codes.contiguous()? } else { codes.copy()? };
        ql.apply_op3_no_bwd(&codes, &scale, &LabelScores { dims, bits })
    }

    struct BlockScores {
        starts: Tensor,
        dims: (usize, usize, usize, usize, usize),
        block: usize,
        end: usize,
    }

    impl candle_core::CustomOp2 for BlockScores {
        fn name(&self) -> &'static str {
            "folio-block-scores"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("block_scores runs the reference on the CPU, not this op")
        }

        fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout, k: &CudaStorage, kl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (heads, kv_heads, n, d, m) = self.dims;
            let dev = q.device().clone();
            let (st, stl) = self.starts.storage_and_layout();
            let starts = cuda_storage(&st, "starts")?.as_cuda_slice::<u32>()?.slice(stl.start_offset()..);
            let qs = q.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
            // SAFETY: one warp writes each block's score.
            let out = unsafe { dev.alloc::<f32>(heads * m)? };
            let cfg = grid_for(heads * m * 32, "block_scores")?;
            let ints =
                [heads as i32, kv_heads as i32, n as i32, d as i32, m as i32, self.block as i32, self.end as i32];
            macro_rules! launch {
                ($t:ty, $name:literal) => {{
                    let ks = k.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
                    let func = dev.get_or_load_custom_func($name, MODULE, PTX)?;
                    let mut b = func.builder();
                    b.arg(&qs).arg(&ks).arg(&starts).arg(&out);
                    for x in &ints {
                        b.arg(x);
                    }
                    // SAFETY: starts are checked against n by the caller; reads stop at min(end, n).
                    unsafe { b.launch(cfg) }.w()?;
                }};
            }
            match k.dtype() {
                DType::F32 => launch!(f32, "block_scores_f32"),
                DType::BF16 => launch!(half::bf16, "block_scores_bf16"),
                other => candle_core::bail!("block_scores: K must be f32 or bf16, not {other:?}"),
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((heads, m))))
        }
    }

    pub fn block_scores(
        q: &Tensor,
        k: &Tensor,
        starts: &Tensor,
        dims: (usize, usize, usize, usize, usize),
        block: usize,
        end: usize,
    ) -> Result<Tensor> {
        let (n, m) = (dims.2, dims.4);
        if m > 0 && starts.max_all()?.to_scalar::<u32>()? as usize >= n.max(1) {
            candle_core::bail!("block_scores: a block starts past the {n} stored rows");
        }
        let op = BlockScores { starts: starts.contiguous()?, dims, block, end: end.min(i32::MAX as usize) };
        q.to_dtype(DType::F32)?.contiguous()?.apply_op2_no_bwd(&k.contiguous()?, &op)
    }
}
