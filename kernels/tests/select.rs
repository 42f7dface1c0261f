//! Top-k and the row gather (kernels/cuda/select.cu) against their references, on fresh random
//! inputs, with one test body for every device.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

use folio_kernels::select::{self, reference, HostRows, SharedHost, Stored};
use folio_kernels::Positions;
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::random;

/// The selected scores are the k largest of each row (ties at the k-th may pick other
/// positions of the same score), positions are distinct and in range; rows with heavy ties,
/// -inf, k of 1, k = n - 1 and k ≥ n.
fn topk_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (rows, n, k, ties) in [
        (3, 1000, 10, false),
        (28, 70_000, 2048, false),
        (4, 5000, 4999, false),
        (2, 300, 1, false),
        (5, 20_000, 777, true),
        (2, 10, 50, false),
        (28, 512, 256, true),
        (4, 2048, 1000, false),
    ] {
        let mut scores = random(&mut rng, rows * n, 30.0);
        if ties {
            // Few distinct values: the k-th score is shared by hundreds of positions.
            scores.iter_mut().for_each(|s| *s = s.round() / 4.0);
        }
        scores[0] = f32::NEG_INFINITY;
        scores[n - 1] = -0.0;
        let want = reference::topk(&scores, n, k);
        let got = select::topk(&Tensor::from_vec(scores.clone(), (rows, n), device)?, k)?;
        let kk = k.min(n);
        assert_eq!(got.dims(), [rows, kk], "seed {seed}");
        let got: Vec<u32> = got.flatten_all()?.to_vec1()?;
        // A short row is sorted whole on every device: the reference's positions, in its order.
        if n <= 2048 {
            assert_eq!(got, want, "seed {seed}: rows {rows} n {n} k {k}");
        }
        for r in 0..rows {
            let row = &scores[r * n..(r + 1) * n];
            let mut g: Vec<u32> = got[r * kk..(r + 1) * kk].to_vec();
            g.sort_unstable();
            g.dedup();
            assert_eq!(g.len(), kk, "seed {seed}: repeated positions in row {r}");
            assert!(g.iter().all(|&p| (p as usize) < n), "seed {seed}");
            let values = |ps: &[u32]| {
                let mut v: Vec<f32> = ps.iter().map(|&p| row[p as usize]).collect();
                v.sort_by(f32::total_cmp);
                v
            };
            assert_eq!(values(&g), values(&want[r * kk..(r + 1) * kk]), "seed {seed}: rows {rows} n {n} k {k} row {r}");
        }
        println!("{device:?} topk rows {rows} n {n} k {k} ties {ties}: selected scores equal the reference's");
    }
    Ok(())
}

test_device!(topk_matches_reference, topk_cpu, topk_cuda);

/// Rows gathered from the host tier (and its device tail) equal the reference's, for
/// per-query-head (group > 1) and per-KV-head selections, f32 and bf16; a position past the
/// stored rows is refused; writes land where they were asked.
fn gather_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, n, tail_n, d, group, sel, dtype) in [
        (4, 1000, 20, 128, 7, 300, DType::BF16),
        (2, 77, 0, 32, 1, 77, DType::F32),
        (1, 5, 3, 64, 2, 0, DType::BF16),
        (2, 64, 64, 8, 2, 100, DType::BF16),
    ] {
        let all = random(&mut rng, heads * (n + tail_n) * d, 1.0);
        let data = Tensor::from_vec(all, (heads, n + tail_n, d), device)?.to_dtype(dtype)?;
        let mut host = HostRows::new(device, dtype, heads, n, d)?;
        // Written in two pieces, as a prefill writes chunks; the rest is the device tail.
        let cut = n / 3;
        host.write(0, &data.narrow(1, 0, cut)?)?;
        host.write(cut, &data.narrow(1, cut, n - cut)?)?;
        let tail = data.narrow(1, n, tail_n)?.contiguous()?;
        let idx: Vec<u32> = (0..heads * group * sel).map(|_| rng.random_range(0..(n + tail_n) as u32)).collect();
        let it = Tensor::from_vec(idx.clone(), (heads * group, sel), device)?;
        let flat = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let all = flat(&data)?;
        let want: Vec<f32> = (0..heads * group * sel)
            .flat_map(|i| {
                let row = ((i / sel / group) * (n + tail_n) + idx[i] as usize) * d;
                all[row..row + d].to_vec()
            })
            .collect();
        let got = host.gather(&it, group, (tail_n > 0).then_some(&tail), Positions::Check)?;
        assert_eq!(got.dims(), [heads * group, sel, d]);
        if sel == 0 {
            continue; // an empty tensor cannot be cast on the GPU (a zero-byte allocation)
        }
        assert_eq!(flat(&got)?, want, "seed {seed}: heads {heads} n {n} tail {tail_n} group {group}");
        println!("{device:?} gather heads {heads} n {n} tail {tail_n} d {d} group {group} sel {sel} {dtype:?}: equal");
    }
    let mut host = HostRows::new(device, DType::BF16, 1, 10, 64)?;
    // An empty write is a no-op; a gather from a store with no rows at all is refused.
    host.write(3, &Tensor::from_vec(Vec::<half::bf16>::new(), (1, 0, 64), device)?)?;
    let empty = HostRows::new(device, DType::BF16, 1, 0, 64)?;
    assert!(empty.gather(&Tensor::from_vec(vec![0u32], (1, 1), device)?, 1, None, Positions::Trusted).is_err());
    let past = Tensor::from_vec(vec![3u32, 10], (1, 2), device)?;
    assert!(host.gather(&past, 1, None, Positions::Check).is_err());
    let tail = Tensor::zeros((1, 2, 64), DType::BF16, device)?;
    assert!(host
        .gather(&Tensor::from_vec(vec![11u32, 12], (1, 2), device)?, 1, Some(&tail), Positions::Check)
        .is_err());
    Ok(())
}

test_device!(gather_matches_reference, gather_cpu, gather_cuda);

/// Page-aligned bytes (the alignment of a memory-mapped file, which a GPU registers in place).
struct PageAligned {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl PageAligned {
    const PAGE: usize = 4096;

    fn new(bytes: &[u8]) -> Self {
        let mut buf = vec![0u8; bytes.len().next_multiple_of(Self::PAGE) + Self::PAGE];
        let start = (Self::PAGE - buf.as_ptr() as usize % Self::PAGE) % Self::PAGE;
        buf[start..start + bytes.len()].copy_from_slice(bytes);
        Self { buf, start, len: bytes.len() }
    }
}

impl AsRef<[u8]> for PageAligned {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// A section of `rows` rows stored as fp8 (scales after the codes), bf16 or f32, and each
/// stored value as the context file decodes it.
fn stored_section(values: &[f32], d: usize, kind: DType) -> (Vec<u8>, Stored, Vec<f32>) {
    let rows = values.len() / d;
    match kind {
        DType::F8E4M3 => {
            let scales = (rows * d).next_multiple_of(8);
            let (mut bytes, mut decoded) = (vec![0u8; scales + 4 * rows], Vec::with_capacity(values.len()));
            for (r, row) in values.chunks_exact(d).enumerate() {
                let codes = &mut bytes[r * d..(r + 1) * d];
                let scale = folio_kernels::encode::fp8_row(row, codes).expect("finite rows");
                decoded.extend(codes.iter().map(|&c| float8::F8E4M3::from_bits(c).to_f32() * scale));
                bytes[scales + 4 * r..scales + 4 * r + 4].copy_from_slice(&scale.to_le_bytes());
            }
            (bytes, Stored::Fp8 { scales }, decoded)
        }
        DType::BF16 => {
            let b: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (b.iter().flat_map(|x| x.to_le_bytes()).collect(), Stored::Bf16, b.iter().map(|x| x.to_f32()).collect())
        }
        _ => (values.iter().flat_map(|x| x.to_le_bytes()).collect(), Stored::F32, values.to_vec()),
    }
}

/// Rows viewed in place in shared host memory, in their stored dtype (fp8 with a scale per
/// row, bf16, f32), and gathered as another dtype or their own equal the file's decode cast
/// to it, bit for bit, with positions past them in a tail; a view that does not fit its memory
/// (or, on a GPU, is misaligned) is refused, and a view is read-only.
fn view_gather_matches_decode(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, n, tail_n, d, group, sel, kind, dtype) in [
        (4, 1000, 20, 128, 7, 300, DType::F8E4M3, DType::BF16),
        (2, 77, 5, 32, 2, 50, DType::F8E4M3, DType::F32),
        (2, 300, 0, 64, 1, 300, DType::BF16, DType::F32),
        (3, 100, 10, 16, 2, 40, DType::F32, DType::BF16),
        (2, 64, 3, 32, 4, 33, DType::BF16, DType::BF16),
    ] {
        let mut values = random(&mut rng, heads * n * d, 4.0);
        // Rows of very different sizes (an fp8 row's scale follows its largest value), and zeros.
        values
            .chunks_exact_mut(d)
            .enumerate()
            .for_each(|(r, row)| row.iter_mut().for_each(|x| *x *= (r % 7) as f32 * 30.0));
        let (section, stored, decoded) = stored_section(&values, d, kind);
        let at = PageAligned::PAGE;
        let mut bytes = vec![0u8; at];
        bytes.extend(&section);
        let shared = SharedHost::new(device, Arc::new(PageAligned::new(&bytes)))?;
        let mut view = HostRows::view(device, &shared, at, stored, (heads, n, d), dtype)?;
        let tail =
            Tensor::from_vec(random(&mut rng, heads * tail_n * d, 4.0), (heads, tail_n, d), device)?.to_dtype(dtype)?;
        let tail_f: Vec<f32> = tail.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let idx: Vec<u32> = (0..heads * group * sel).map(|_| rng.random_range(0..(n + tail_n) as u32)).collect();
        let it = Tensor::from_vec(idx.clone(), (heads * group, sel), device)?;
        let want: Vec<f32> = (0..heads * group * sel)
            .flat_map(|i| {
                let (g, p) = (i / sel / group, idx[i] as usize);
                let (from, at) = if p < n { (&decoded, (g * n + p) * d) } else { (&tail_f, (g * tail_n + p - n) * d) };
                from[at..at + d].to_vec()
            })
            .collect();
        let want: Vec<f32> = Tensor::from_vec(want, heads * group * sel * d, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        let got = view.gather(&it, group, (tail_n > 0).then_some(&tail), Positions::Check)?;
        assert_eq!(got.dims(), [heads * group, sel, d]);
        let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        assert!(got == want, "seed {seed}: {kind:?} rows read as {dtype:?}, heads {heads} n {n} d {d} group {group}");
        assert!(view.write(0, &Tensor::zeros((heads, 1, d), dtype, device)?).is_err(), "a view is read-only");
        println!("{device:?} view of {kind:?} rows read as {dtype:?}, heads {heads} n {n} d {d}: equal");
        // Past the memory, and (on a GPU, whose kernel loads 16 bytes at a time) off alignment.
        assert!(HostRows::view(device, &shared, at + 16, stored, (heads, n, d), dtype).is_err());
        if device.is_cuda() {
            assert!(HostRows::view(device, &shared, at - 4, stored, (heads, 1, d), dtype).is_err());
        }
    }
    Ok(())
}

test_device!(view_gather_matches_decode, view_gather_cpu, view_gather_cuda);

/// Attention computed by the CPU over picked host rows (MagicPIG's side of a step) equals the
/// definition's: per-query-head picks of different lengths (empty, one row, most of the
/// context), each attended in parts of random sizes (empty parts among them) whose partials
/// are merged in a shuffled order; GQA, f32 and bf16 rows, a logit bias that depends on q·k.
/// A position past the stored rows, and a KV head or query that does not exist, are refused.
fn host_attention_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (kv_heads, group, n, d, dtype) in
        [(2, 4, 9000, 32, DType::BF16), (1, 3, 500, 128, DType::F32), (4, 1, 50, 80, DType::BF16)]
    {
        let heads = kv_heads * group;
        let round = |x: Vec<f32>| -> Result<Vec<f32>> {
            Tensor::from_vec(x, kv_heads * n * d, &Device::Cpu)?.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1()
        };
        let (k, v) = (round(random(&mut rng, kv_heads * n * d, 1.0))?, round(random(&mut rng, kv_heads * n * d, 1.0))?);
        let rows = |x: &[f32]| -> Result<HostRows> {
            let mut host = HostRows::new(device, dtype, kv_heads, n, d)?;
            host.write(0, &Tensor::from_slice(x, (kv_heads, n, d), device)?.to_dtype(dtype)?)?;
            Ok(host)
        };
        let (hk, hv) = (rows(&k)?, rows(&v)?);
        let (kh, vh) = (hk.host()?, hv.host()?);
        let q = random(&mut rng, heads * d, 1.0);
        // Pick lengths: empty, one row, and up to the whole context.
        let picks: Vec<Vec<u32>> = (0..heads)
            .map(|h| {
                let len = match h % 3 {
                    0 if h > 0 => 0,
                    1 => 1,
                    _ => rng.random_range(1..=n),
                };
                let mut p: Vec<u32> = (0..n as u32).collect();
                for i in 0..len {
                    p.swap(i, rng.random_range(i..n));
                }
                p.truncate(len);
                p
            })
            .collect();
        let bias = |h: usize, j: usize, qk: f32| 0.5 * qk.tanh() - 0.001 * ((h + j) % 7) as f32;
        let scale = 1.0 / (d as f32).sqrt();
        let mut partials = Vec::new();
        for (h, pick) in picks.iter().enumerate() {
            let (mut start, mut first) = (0, true);
            loop {
                // Odd heads start with an empty part (merged into whatever follows).
                let len = if first && h % 2 == 1 { 0 } else { rng.random_range(1..=pick.len() / 2 + 1) };
                first = false;
                let end = (start + len).min(pick.len());
                let part = &pick[start..end];
                let partial =
                    select::attend_partial(&q[h * d..(h + 1) * d], (&kh, &vh), h / group, part, scale, &|j, qk| {
                        bias(h, start + j, qk)
                    })?;
                partials.push((h, partial));
                if end == pick.len() {
                    break;
                }
                start = end;
            }
        }
        for i in (1..partials.len()).rev() {
            partials.swap(i, rng.random_range(0..=i));
        }
        let (out, lse) = select::merge_partials(heads, d, partials);
        for (h, pick) in picks.iter().enumerate() {
            // The reference for this head alone: its pick as a one-head selection.
            let g = h / group;
            let kg = &k[g * n * d..(g + 1) * n * d];
            let vg = &v[g * n * d..(g + 1) * n * d];
            let qh = &q[h * d..(h + 1) * d];
            let b: Vec<f32> = pick
                .iter()
                .enumerate()
                .map(|(j, &p)| {
                    let key = &kg[p as usize * d..(p as usize + 1) * d];
                    bias(h, j, qh.iter().zip(key).map(|(a, b)| a * b).sum())
                })
                .collect();
            let (want, want_lse) =
                folio_kernels::sparse::reference::decode_attention(qh, kg, vg, pick, Some(&b), (1, 1, n, d), scale);
            let diff = common::max_abs_diff(&out[h * d..(h + 1) * d], &want);
            assert!(diff < 1e-4, "seed {seed}: head {h} ({} rows) differs by {diff}", pick.len());
            if pick.is_empty() {
                assert_eq!(lse[h], f32::NEG_INFINITY, "seed {seed}");
            } else {
                assert!((lse[h] - want_lse[0]).abs() < 1e-3, "seed {seed}: lse {} vs {}", lse[h], want_lse[0]);
            }
        }
        println!("{device:?} host attention {heads}/{kv_heads} heads, n {n}, d {d}, {dtype:?}: within 1e-4");
        let no_bias = |_: usize, _: f32| 0.0;
        let attend = |q: &[f32], kv_head: usize, pick: &[u32]| {
            select::attend_partial(q, (&kh, &vh), kv_head, pick, scale, &no_bias).map(|_| ())
        };
        assert!(attend(&q[..d], 0, &[n as u32]).is_err(), "a position past the rows");
        assert!(attend(&q[..d], kv_heads, &[0]).is_err(), "a KV head past the heads");
        assert!(attend(&q[..d - 1], 0, &[0]).is_err(), "a short query");
        assert!(attend(&q[..d], 0, &[0, n as u32 - 1]).is_ok());
    }
    Ok(())
}

test_device!(host_attention_matches_reference, host_attention_cpu, host_attention_cuda);

/// HiP's whole block search over host rows (on a GPU one launch reading the keys where they
/// lie; round by round past its shared memory) gives the round-by-round search's positions
/// exactly: with small integer keys and queries (exact sums, ties everywhere) against that
/// search over the decoded keys on the CPU, its definition; with random keys on the same
/// device (the same f32 arithmetic), rows stored as fp8, bf16 and f32 and read as bf16 or f32
/// (a context file's section read in place) or held in the tier's own page-locked copy, regions
/// that run into the device tail, sinks, GQA, 2n at the kernel's limit and past it. Each search
/// also runs queued ahead while the device's stream does other work.
fn search_blocks_matches_rounds(device: &Device) -> Result<()> {
    use folio_kernels::blocks::{self, Search};
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    #[rustfmt::skip]
    let cases = [
        // (kv heads, group, rows, tail, d, stored, read as, integers, page-locked copy, plan)
        (4, 7, 6000, 0, 128, DType::BF16, DType::BF16, true, false, Search { n: 256, blocks: 2900, b: 2, first: 4, lo: 0 }),
        (2, 3, 1000, 50, 64, DType::F32, DType::F32, true, true, Search { n: 7, blocks: 255, b: 4, first: 20, lo: 3 }),
        (2, 2, 3000, 10, 32, DType::BF16, DType::BF16, false, true, Search { n: 1024, blocks: 3005, b: 1, first: 0, lo: 0 }),
        (1, 4, 5000, 0, 32, DType::F32, DType::BF16, false, false, Search { n: 300, blocks: 4000, b: 1, first: 8, lo: 2 }),
        (2, 3, 4000, 20, 64, DType::BF16, DType::F32, false, false, Search { n: 100, blocks: 2005, b: 2, first: 4, lo: 0 }),
        (4, 7, 4000, 30, 128, DType::F8E4M3, DType::BF16, false, false, Search { n: 256, blocks: 2010, b: 2, first: 4, lo: 0 }),
        (2, 2, 800, 5, 16, DType::F8E4M3, DType::F32, false, false, Search { n: 9, blocks: 800, b: 1, first: 2, lo: 1 }),
        // Past the kernel's 2048 candidates: round by round everywhere.
        (1, 4, 5000, 0, 32, DType::BF16, DType::BF16, false, false, Search { n: 1100, blocks: 4000, b: 1, first: 8, lo: 2 }),
    ];
    for (kv_heads, group, n, tail_n, d, kind, dtype, integers, pinned, plan) in cases {
        let heads = kv_heads * group;
        let draw = |rng: &mut StdRng, len: usize, spread: i32| -> Vec<f32> {
            if integers {
                (0..len).map(|_| rng.random_range(-spread..=spread) as f32).collect()
            } else {
                random(rng, len, spread as f32)
            }
        };
        let values = draw(&mut rng, kv_heads * n * d, 3);
        let (section, stored, decoded) = stored_section(&values, d, kind);
        let rows = if pinned {
            // The tier's own copy (page-locked on a GPU), in the dtype it is read in.
            let mut rows = HostRows::new(device, dtype, kv_heads, n, d)?;
            rows.write(0, &Tensor::from_vec(decoded.clone(), (kv_heads, n, d), device)?.to_dtype(dtype)?)?;
            rows
        } else {
            // A context file's section, read where it lies.
            let at = PageAligned::PAGE;
            let mut bytes = vec![0u8; at];
            bytes.extend(&section);
            let shared = SharedHost::new(device, Arc::new(PageAligned::new(&bytes)))?;
            HostRows::view(device, &shared, at, stored, (kv_heads, n, d), dtype)?
        };
        let tail_f = draw(&mut rng, kv_heads * tail_n * d, 3);
        // No tail tensor when it is empty: a zero-byte allocation is refused on the GPU.
        let tail = (tail_n > 0)
            .then(|| Tensor::from_vec(tail_f.clone(), (kv_heads, tail_n, d), device)?.to_dtype(dtype))
            .transpose()?;
        let tail = tail.as_ref();
        let q = Tensor::from_vec(draw(&mut rng, heads * d, 2), (heads, d), device)?;
        // Queued ahead (on a GPU's side stream), then the device's stream goes on with work
        // of its own before it asks for the positions; and in the stream's order.
        let ahead = rows.search_blocks(&q, group, tail, &plan, true)?;
        let busy = q.matmul(&q.t()?)?.exp()?.sum_all()?;
        let ahead = ahead.positions()?;
        busy.to_scalar::<f32>()?;
        let got = rows.search_blocks(&q, group, tail, &plan, false)?.positions()?;
        assert_eq!(got.dims(), [heads, plan.picks()]);
        // Past the one-launch kernel's 2048 candidates a GPU keeps each round's best with the
        // radix select, whose picks come in no set order: compare each head's picks as a set
        // there (random scores: no ties to break either way).
        let sets = device.is_cuda() && 2 * plan.n > 2048;
        let flat = |t: &Tensor| -> Result<Vec<u32>> {
            let mut v: Vec<u32> = t.flatten_all()?.to_vec1()?;
            if sets {
                v.chunks_mut(plan.picks()).for_each(|head| head.sort_unstable());
            }
            Ok(v)
        };
        let got = flat(&got)?;
        assert_eq!(flat(&ahead)?, got, "seed {seed}: queued ahead");
        let want = if integers {
            // The definition: the rounds on the CPU over the decoded keys, as the tier's dtype.
            let keys: Vec<f32> = (0..kv_heads)
                .flat_map(|g| [&decoded[g * n * d..(g + 1) * n * d], &tail_f[g * tail_n * d..(g + 1) * tail_n * d]])
                .flatten()
                .copied()
                .collect();
            let keys = Tensor::from_vec(keys, (kv_heads, n + tail_n, d), &Device::Cpu)?.to_dtype(dtype)?;
            let q = q.to_device(&Device::Cpu)?;
            let gather = |pos: &Tensor| -> Result<Tensor> {
                let per_head = (0..heads)
                    .map(|h| keys.get(h / group)?.index_select(&pos.get(h)?, 0))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::stack(&per_head, 0)
            };
            blocks::search_by_rounds(&q, &plan, gather)?
        } else {
            // The same device's rounds, through this store's gather.
            blocks::search_by_rounds(&q, &plan, |pos| rows.gather(pos, group, tail, Positions::Trusted))?
        };
        assert_eq!(got, flat(&want)?, "seed {seed}: {kind:?} as {dtype:?}, {plan:?}");
        let sinks = plan.first - plan.lo;
        for head in got.chunks(plan.picks()) {
            assert!(head[..sinks].iter().copied().eq(plan.lo as u32..plan.first as u32), "seed {seed}: sinks");
            let region = plan.first as u32..(plan.first + plan.blocks * plan.b) as u32;
            assert!(head[sinks..].iter().all(|p| region.contains(p)), "seed {seed}: a pick outside the region");
        }
        println!(
            "{device:?} block search {heads}/{kv_heads} heads, {kind:?} as {dtype:?} (copy: {pinned}), {plan:?}: equal"
        );
    }
    // Nothing to prune, and a query that does not match the rows, are refused.
    let rows = HostRows::new(device, DType::F32, 1, 100, 16)?;
    let q = Tensor::zeros((2, 16), DType::F32, device)?;
    let all = Search { n: 50, blocks: 50, b: 2, first: 0, lo: 0 };
    assert!(rows.search_blocks(&q, 2, None, &all, false).is_err(), "blocks ≤ n");
    let fine = Search { n: 5, blocks: 50, b: 2, first: 0, lo: 0 };
    assert!(rows.search_blocks(&q, 1, None, &fine, true).is_err(), "2 query heads for 1 KV head, group 1");
    assert!(rows.search_blocks(&q, 2, None, &fine, true)?.positions().is_ok());
    Ok(())
}

test_device!(search_blocks_matches_rounds, search_blocks_cpu, search_blocks_cuda);

/// Bucket lists laid out as MagicPIG's index lays them: per table, the keys sorted by (code, key)
/// as offsets within their segment (`members`, u16), and where each (code, segment) run starts
/// (`starts`, u32, at `code · segments + segment`), from each key's code in each table.
fn bucket_lists(codes: &[Vec<u32>], n: usize, bits: usize) -> (Vec<u8>, Vec<u8>) {
    let (seg, segs) = (select::lsh::SEGMENT_KEYS, select::lsh::segments(n));
    let (mut members, mut starts) = (Vec::new(), Vec::new());
    for table in codes {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (table[i], i));
        let mut at = vec![0u32; (1 << bits) * segs + 1];
        for i in 0..n {
            at[table[i] as usize * segs + i / seg + 1] += 1;
        }
        for r in 1..at.len() {
            at[r] += at[r - 1];
        }
        members.extend(order.iter().flat_map(|&i| ((i % seg) as u16).to_ne_bytes()));
        starts.extend(at.iter().flat_map(|x| x.to_ne_bytes()));
    }
    (members, starts)
}

/// MagicPIG's sample where the device runs it (`select::lsh`): the walk finds exactly the keys
/// whose code equals the query head's in two tables or more, from `skip` on, counted from each
/// key's own codes (three segments of keys, the last partial; some heads sharing a KV head's
/// lists); the attention over it equals the softmax of `scale·q·k + bias(cos)` in f64 over the
/// stored rows, read from a registered view (bf16) and from page-locked rows (f32); an empty
/// sample gives zeros and an LSE of −∞.
fn lsh_sample_matches_definition(device: &Device) -> Result<()> {
    use select::lsh;
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // Tables past one warp's 32 (the run scan's carry), a head dim past 128 (a lane's second
    // four values).
    let (kv_heads, group, d, bits, tables) = (2, 3, 192, 8, 75);
    let heads = kv_heads * group;
    let n = 2 * lsh::SEGMENT_KEYS + 1000;
    let (first, rows) = (5, 5 + n + 7);
    let mut key_codes = Vec::new();
    let mut lists = Vec::new();
    for _ in 0..kv_heads {
        let codes: Vec<Vec<u32>> =
            (0..tables).map(|_| (0..n).map(|_| rng.random_range(0..1u32 << bits)).collect()).collect();
        let (members, starts) = bucket_lists(&codes, n, bits);
        let share = |b: &[u8]| SharedHost::new(device, Arc::new(PageAligned::new(b)));
        lists.push((share(&members)?, share(&starts)?));
        key_codes.push(codes);
    }
    // Lists shorter than the tables say are refused.
    let short = lsh::Tables::new(device, lists.clone(), (n + 1, bits, tables)).err().expect("lists for n keys");
    assert!(short.to_string().contains("lists of"), "{short}");
    let index = lsh::Tables::new(device, lists, (n, bits, tables))?;
    let qc: Vec<u32> = (0..heads * tables).map(|_| rng.random_range(0..1u32 << bits)).collect();
    let codes = Tensor::from_vec(qc.clone(), (heads, tables), device)?;
    let every: Vec<Vec<u32>> = (0..heads)
        .map(|h| {
            let collide = |i: usize| (0..tables).filter(|&l| key_codes[h / group][l][i] == qc[h * tables + l]).count();
            (0..n).filter(|&i| collide(i) >= 2).map(|i| (first + i) as u32).collect()
        })
        .collect();
    let want = |skip: usize| -> Vec<Vec<u32>> {
        every.iter().map(|p| p.iter().copied().filter(|&x| x as usize >= first + skip).collect()).collect()
    };
    for skip in [0, 70_000, n] {
        let sample = index.walk(&codes, group, 0..heads, (first, skip))?;
        // On a GPU the first report of the process (this one: no other test here reports) holds
        // ~28k picks, past the 4,096 words of a first report buffer: it reports again into a
        // larger one, and the comparison covers that path too.
        assert!(sample.positions()? == want(skip), "seed {seed}: skip {skip}: the walk's sample differs");
        // The heads from the middle of the first KV head's on, with the codes; an empty range.
        let (rest, also) = sample.report(group - 1..heads, Some(&codes))?.wait()?;
        assert!(rest == want(skip)[group - 1..], "seed {seed}: skip {skip}: heads {}.. differ", group - 1);
        assert!(also == qc, "seed {seed}: the codes reported with the picks differ");
        let (none, also) = sample.report(heads..heads, Some(&codes))?.wait()?;
        assert!(none.is_empty() && also == qc, "seed {seed}: an empty range");
        // A walk of a range of the heads (from mid-KV-head on; the first heads) is the sample of
        // those heads alone.
        for range in [group - 1..heads, 0..group + 1] {
            let part = index.walk(&codes, group, range.clone(), (first, skip))?;
            assert!(part.positions()? == want(skip)[range.clone()], "seed {seed}: skip {skip}: a walk of {range:?}");
        }
    }
    // Empty, reversed and past-the-end ranges are refused.
    for range in [1..1, heads..heads + 1, 0..heads + 1] {
        assert!(index.walk(&codes, group, range.clone(), (first, 0)).is_err(), "seed {seed}: {range:?}");
    }
    // Heads past the sample's are refused.
    let sample = index.walk(&codes, group, 0..heads, (first, 0))?;
    assert!(sample.report(0..heads + 1, None).is_err() && sample.report(heads + 1..heads + 1, None).is_err());
    assert!(want(0).iter().all(|p| p.len() > 1000), "seed {seed}: samples this size exercise every warp");

    // The attention, over the walk's sample and an empty one.
    let (steps, scale) = (64, 0.125f32);
    let table: Vec<f32> = (0..=steps).map(|_| rng.random_range(-3f32..3.0)).collect();
    let norms: Vec<f32> =
        (0..kv_heads * n).map(|i| if i % 997 == 0 { 0.0 } else { rng.random_range(0.1f32..3.0) }).collect();
    let weights_t = Tensor::from_vec([table.clone(), norms.clone()].concat(), steps + 1 + kv_heads * n, device)?;
    let weights = lsh::Weights { table_and_norms: &weights_t, steps, first, n };
    for (dtype, view) in [(DType::BF16, true), (DType::F32, false)] {
        let draw = |rng: &mut StdRng| -> Result<Vec<f32>> {
            Tensor::from_vec(random(rng, kv_heads * rows * d, 1.0), kv_heads * rows * d, &Device::Cpu)?
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .to_vec1()
        };
        let (k, v) = (draw(&mut rng)?, draw(&mut rng)?);
        let host = |x: &[f32]| -> Result<HostRows> {
            if view {
                let (section, stored, _) = stored_section(x, d, dtype);
                let mut bytes = vec![0u8; PageAligned::PAGE];
                bytes.extend(&section);
                let shared = SharedHost::new(device, Arc::new(PageAligned::new(&bytes)))?;
                HostRows::view(device, &shared, PageAligned::PAGE, stored, (kv_heads, rows, d), dtype)
            } else {
                let mut host = HostRows::new(device, dtype, kv_heads, rows, d)?;
                host.write(0, &Tensor::from_slice(x, (kv_heads, rows, d), device)?.to_dtype(dtype)?)?;
                Ok(host)
            }
        };
        let (hk, hv) = (host(&k)?, host(&v)?);
        let q = random(&mut rng, heads * d, 1.0);
        let means = random(&mut rng, heads, 2.0);
        let query: Vec<f32> = (0..heads)
            .flat_map(|h| {
                let q = &q[h * d..(h + 1) * d];
                let norm = q.iter().map(|x| x * x).sum::<f32>().sqrt();
                q.iter().copied().chain([norm, means[h]]).collect::<Vec<_>>()
            })
            .collect();
        let query_t = Tensor::from_vec(query.clone(), (heads, d + 2), device)?;
        // A sample walked over other keys than the weights cover is refused, not misread.
        let shifted = index.walk(&codes, group, 0..heads, (first + 1, 0))?;
        let err = lsh::attend(&query_t, &shifted, (&hk, &hv), &weights, scale).expect_err("keys 6.. against 5..");
        assert!(err.to_string().contains("sampled from keys 6.."), "seed {seed}: {err}");
        for skip in [0, n] {
            let sample = index.walk(&codes, group, 0..heads, (first, skip))?;
            let (out, lse) = lsh::attend(&query_t, &sample, (&hk, &hv), &weights, scale)?;
            let (out, lse): (Vec<f32>, Vec<f32>) = (out.flatten_all()?.to_vec1()?, lse.to_vec1()?);
            // The first heads attended alone (part of a KV head's too) give what they gave
            // among all; more query heads than sampled are refused.
            for first_heads in [group, group + 1] {
                let query_first = query_t.narrow(0, 0, first_heads)?;
                let (part_out, part_lse) = lsh::attend(&query_first, &sample, (&hk, &hv), &weights, scale)?;
                let (part_out, part_lse): (Vec<f32>, Vec<f32>) =
                    (part_out.flatten_all()?.to_vec1()?, part_lse.to_vec1()?);
                assert!(
                    part_out == out[..first_heads * d] && part_lse == lse[..first_heads],
                    "seed {seed}: {dtype:?}: the first {first_heads} heads attended alone differ"
                );
            }
            let more = Tensor::cat(&[&query_t, &query_t.narrow(0, 0, 1)?], 0)?;
            assert!(lsh::attend(&more, &sample, (&hk, &hv), &weights, scale).is_err(), "seed {seed}: {dtype:?}");
            // A walk of the first heads attends as the whole walk does; one of later heads is
            // refused (the kernel reads KV head h / group for its head h).
            let first_walk = index.walk(&codes, group, 0..group + 1, (first, skip))?;
            let query_first = query_t.narrow(0, 0, group + 1)?;
            let (part_out, part_lse) = lsh::attend(&query_first, &first_walk, (&hk, &hv), &weights, scale)?;
            let (part_out, part_lse): (Vec<f32>, Vec<f32>) = (part_out.flatten_all()?.to_vec1()?, part_lse.to_vec1()?);
            assert!(
                part_out == out[..(group + 1) * d] && part_lse == lse[..group + 1],
                "seed {seed}: {dtype:?}: a walk of the first heads attended differs"
            );
            let later = index.walk(&codes, group, 1..heads, (first, skip))?;
            let err =
                lsh::attend(&query_t.narrow(0, 1, 1)?, &later, (&hk, &hv), &weights, scale).expect_err("head 1 on");
            assert!(err.to_string().contains(" from head 1 on "), "seed {seed}: {err}");
            for (h, pick) in want(skip).iter().enumerate() {
                let kvh = h / group;
                let row = |p: u32| (kvh * rows + p as usize) * d;
                let qh = &query[h * (d + 2)..(h + 1) * (d + 2)];
                let logits: Vec<f64> = pick
                    .iter()
                    .map(|&p| {
                        let at = row(p);
                        let qk: f64 = (0..d).map(|c| qh[c] as f64 * k[at + c] as f64).sum();
                        let kn = norms[kvh * n + p as usize - first].max(f32::MIN_POSITIVE) as f64;
                        let cos = (qk - qh[d + 1] as f64) / (qh[d] as f64 * kn);
                        scale as f64 * qk + lsh::interpolate(&table, cos as f32) as f64
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let got = &out[h * d..(h + 1) * d];
                if pick.is_empty() {
                    assert!(
                        got.iter().all(|&x| x == 0.0) && lse[h] == f32::NEG_INFINITY,
                        "seed {seed}: empty head {h}"
                    );
                    continue;
                }
                let sum: f64 = logits.iter().map(|z| (z - max).exp()).sum();
                for c in 0..d {
                    let o: f64 =
                        pick.iter().zip(&logits).map(|(&p, z)| (z - max).exp() * v[row(p) + c] as f64).sum::<f64>()
                            / sum;
                    assert!(
                        (got[c] as f64 - o).abs() < 1e-4,
                        "seed {seed}: {dtype:?} head {h} channel {c}: {} vs {o}",
                        got[c]
                    );
                }
                let l = max + sum.ln();
                assert!(
                    (lse[h] as f64 - l).abs() < 1e-4 * l.abs().max(1.0),
                    "seed {seed}: {dtype:?} head {h}: lse {} vs {l}",
                    lse[h]
                );
            }
        }
    }
    // The bias's interpolation: the table at its sample points, halfway between two in between.
    let (a, b) = (lsh::interpolate(&table, -1.0), lsh::interpolate(&table, 1.0));
    assert!(a == table[0] && (b - table[steps]).abs() < 1e-6, "the ends");
    let mid = lsh::interpolate(&table, -1.0 + 2.0 * 10.5 / steps as f32);
    assert!((mid - (table[10] + table[11]) / 2.0).abs() < 1e-5, "halfway: {mid}");
    Ok(())
}

test_device!(lsh_sample_matches_definition, lsh_sample_cpu, lsh_sample_cuda);
