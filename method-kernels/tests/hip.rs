//! HiP's block search (method-kernels/cuda/hip.cu, method-kernels/src/hip/) against its
//! references, on fresh random inputs, with one test body for every device: a round's steps,
//! and the whole search over host rows against the search round by round.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

use folio_kernels::select::{HostRows, SharedHost};
use folio_kernels::Positions;
use folio_method_kernels::hip::{self, reference, Search};
use rand::{rngs::StdRng, Rng, SeedableRng};

#[path = "../../kernels/tests/common/mod.rs"]
mod common;
use common::random;
#[path = "../../kernels/tests/common/rows.rs"]
mod rows;
use rows::{stored_section, PageAligned};

/// Halving: random nodes (empty and one-block ones included), with and without a pick of them,
/// block sizes 1 to 5, the last block cut short by the end of the keys; the halves and the
/// positions are the reference's exactly.
fn halve_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, m, n, b, first, picked) in
        [(28, 512, 256, 2, 4, true), (3, 7, 7, 1, 0, false), (5, 40, 9, 5, 100, true)]
    {
        let blocks = 10_000u32;
        let keys = blocks as usize * b - b / 2;
        let nodes: Vec<u32> = (0..heads * m)
            .flat_map(|_| {
                let f = rng.random_range(0..blocks);
                [f, rng.random_range(f..=blocks)]
            })
            .collect();
        let keep: Vec<u32> = (0..heads * n).map(|_| rng.random_range(0..m as u32)).collect();
        let keep_ref = picked.then_some(&keep[..]);
        let n = if picked { n } else { m };
        let (want_c, want_p) = reference::halve(&nodes, keep_ref, (heads, m, n), b, first, keys);
        let nt = Tensor::from_vec(nodes, (heads, m, 2), device)?;
        let kt = Tensor::from_vec(keep, (heads, n), device)?;
        let (c, p) = hip::halve(&nt, picked.then_some(&kt), b, first, keys)?;
        assert_eq!(c.dims(), [heads, 2 * n, 2]);
        assert_eq!(c.flatten_all()?.to_vec1::<u32>()?, want_c, "seed {seed}: halves");
        assert_eq!(p.flatten_all()?.to_vec1::<u32>()?, want_p, "seed {seed}: positions");
        assert!(want_p.iter().all(|&x| (x as usize) < first + keys), "seed {seed}: a position past the keys");
    }
    Ok(())
}

test_device!(halve_matches_reference, halve_cpu, halve_cuda);

/// Block maxima over f32 and bf16 keys, head dims that are and are not multiples of the warp,
/// empty candidates scoring −∞.
fn block_max_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, c, b, d, dtype) in
        [(28, 1024, 2, 128, DType::BF16), (4, 9, 3, 70, DType::F32), (2, 5, 1, 256, DType::F32)]
    {
        let q = random(&mut rng, heads * d, 1.0);
        let keys =
            Tensor::from_vec(random(&mut rng, heads * c * b * d, 1.0), (heads, c * b, d), device)?.to_dtype(dtype)?;
        let keys_ref: Vec<f32> = keys.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut cand: Vec<u32> = (0..heads * c)
            .flat_map(|_| {
                let f = rng.random_range(0..100u32);
                [f, f + rng.random_range(0..3u32)]
            })
            .collect();
        cand[1] = cand[0]; // one empty candidate at least
        let want = reference::block_max(&q, &keys_ref, &cand, (heads, c, b, d));
        let qt = Tensor::from_vec(q, (heads, d), device)?;
        let ct = Tensor::from_vec(cand, (heads, c, 2), device)?;
        let got: Vec<f32> = hip::block_max(&qt, &keys, &ct, b)?.flatten_all()?.to_vec1()?;
        for (g, w) in got.iter().zip(&want) {
            assert!(g == w || (g - w).abs() < 1e-4 * w.abs().max(1.0), "seed {seed}: {g} vs {w}");
        }
        assert_eq!(want[0], f32::NEG_INFINITY);
    }
    Ok(())
}

test_device!(block_max_matches_reference, block_max_cpu, block_max_cuda);

/// Expansion of the kept blocks into positions: with and without sinks, block sizes 1 to 4,
/// picks in any order; the reference's positions exactly.
fn expand_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (heads, m, n, b, sinks) in [(28, 514, 257, 2, (0, 4)), (3, 8, 4, 1, (0, 0)), (5, 40, 20, 4, (7, 10))] {
        let nodes: Vec<u32> = (0..heads * m)
            .flat_map(|_| {
                let f = rng.random_range(0..100_000u32);
                [f, f + 1]
            })
            .collect();
        let keep: Vec<u32> = (0..heads * n).map(|_| rng.random_range(0..m as u32)).collect();
        let want = reference::expand(&nodes, &keep, (heads, m, n), b, sinks);
        assert_eq!(want.len(), heads * (sinks.1 - sinks.0 + n * b));
        let nt = Tensor::from_vec(nodes, (heads, m, 2), device)?;
        let kt = Tensor::from_vec(keep, (heads, n), device)?;
        let got = hip::expand(&nt, &kt, b, sinks)?;
        assert_eq!(got.dims(), [heads, sinks.1 - sinks.0 + n * b]);
        assert_eq!(got.flatten_all()?.to_vec1::<u32>()?, want, "seed {seed}: positions");
    }
    Ok(())
}

test_device!(expand_matches_reference, expand_cpu, expand_cuda);

/// HiP's whole block search over host rows (on a GPU one launch reading the keys where they
/// lie; round by round past its shared memory) gives the round-by-round search's positions
/// exactly: with small integer keys and queries (exact sums, ties everywhere) against that
/// search over the decoded keys on the CPU, its definition; with random keys on the same
/// device (the same f32 arithmetic), rows stored as fp8, bf16 and f32 and read as bf16 or f32
/// (a context file's section read in place) or held in the tier's own page-locked copy, regions
/// that run into the device tail, sinks, GQA, an odd number of heads, 2n at the kernel's limit
/// and past it. Each search also runs queued ahead while the device's stream does other work.
fn search_blocks_matches_rounds(device: &Device) -> Result<()> {
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
        // An odd number of heads: the last block's second half searches none.
        (1, 3, 2000, 7, 64, DType::BF16, DType::BF16, true, false, Search { n: 33, blocks: 990, b: 2, first: 4, lo: 0 }),
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
        let ahead = hip::search_host(&rows, &q, group, tail, &plan, true)?;
        let busy = q.matmul(&q.t()?)?.exp()?.sum_all()?;
        let ahead = ahead.positions()?;
        busy.to_scalar::<f32>()?;
        let got = hip::search_host(&rows, &q, group, tail, &plan, false)?.positions()?;
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
            hip::search_by_rounds(&q, &plan, gather)?
        } else {
            // The same device's rounds, through this store's gather.
            hip::search_by_rounds(&q, &plan, |pos| rows.gather(pos, group, tail, Positions::Trusted))?
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
    assert!(hip::search_host(&rows, &q, 2, None, &all, false).is_err(), "blocks ≤ n");
    let fine = Search { n: 5, blocks: 50, b: 2, first: 0, lo: 0 };
    assert!(hip::search_host(&rows, &q, 1, None, &fine, true).is_err(), "2 query heads for 1 KV head, group 1");
    assert!(hip::search_host(&rows, &q, 2, None, &fine, true)?.positions().is_ok());
    Ok(())
}

test_device!(search_blocks_matches_rounds, search_blocks_cpu, search_blocks_cuda);

/// HiP's search on the CPU ([`hip::host::search_head`], one query head at a time over the saved
/// rows where they lie and the rows written since) against the search round by round on the
/// CPU over the same keys as the tier's gather gives them. Integer keys and queries (and fp8
/// codes read as bf16, whose values are then dyadic with 8-bit mantissas) make every sum
/// exact in both arithmetics, so the positions must be equal. f32 rows read as bf16 carry
/// 1/1024 more than an integer, which the bf16 they are read as drops (but at 0): a search
/// that skipped the rounding would rank them otherwise.
#[test]
fn cpu_search_matches_rounds() -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let cpu = Device::Cpu;
    #[rustfmt::skip]
    let cases = [
        // (kv heads, group, rows, tail, d, stored, read as, plan, added to every saved key)
        (4, 7, 6000, 0, 128, DType::BF16, DType::BF16, Search { n: 256, blocks: 2900, b: 2, first: 4, lo: 0 }, 0.0),
        (2, 3, 1000, 50, 64, DType::F32, DType::F32, Search { n: 7, blocks: 255, b: 4, first: 20, lo: 3 }, 0.0),
        (2, 2, 3000, 10, 36, DType::BF16, DType::F32, Search { n: 1024, blocks: 3005, b: 1, first: 0, lo: 0 }, 0.0),
        (4, 7, 4000, 30, 128, DType::F8E4M3, DType::BF16, Search { n: 256, blocks: 2010, b: 2, first: 4, lo: 0 }, 0.0),
        (2, 2, 800, 5, 20, DType::F8E4M3, DType::BF16, Search { n: 9, blocks: 800, b: 1, first: 2, lo: 1 }, 0.0),
        (2, 3, 3000, 10, 64, DType::F32, DType::BF16, Search { n: 64, blocks: 1500, b: 2, first: 4, lo: 0 }, 1.0 / 1024.0),
    ];
    for (kv_heads, group, n, tail_n, d, kind, dtype, plan, offset) in cases {
        let heads = kv_heads * group;
        let ints = |rng: &mut StdRng, len: usize, spread: i32| -> Vec<f32> {
            (0..len).map(|_| rng.random_range(-spread..=spread) as f32).collect()
        };
        let saved: Vec<f32> = ints(&mut rng, kv_heads * n * d, 3).into_iter().map(|k| k + offset).collect();
        let (section, stored, decoded) = stored_section(&saved, d, kind);
        let at = PageAligned::PAGE;
        let mut bytes = vec![0u8; at];
        bytes.extend(&section);
        let shared = SharedHost::new(&cpu, Arc::new(PageAligned::new(&bytes)))?;
        let rows = HostRows::view(&cpu, &shared, at, stored, (kv_heads, n, d), dtype)?;
        let tail: Vec<f32> = ints(&mut rng, kv_heads * tail_n * d, 3);
        let q = ints(&mut rng, heads * d, 2);
        let view = rows.host()?;
        let got: Vec<u32> = (0..heads)
            .flat_map(|h| {
                let kvh = h / group;
                let keys = hip::host::HeadKeys {
                    rows: &view,
                    kvh,
                    tail: &tail[kvh * tail_n * d..(kvh + 1) * tail_n * d],
                    bf16: hip::host::rounds_to_bf16(dtype, stored),
                };
                hip::host::search_head(&keys, &q[h * d..(h + 1) * d], &plan)
            })
            .collect();
        // The definition: the rounds over the decoded keys as the tier's dtype.
        let keys: Vec<f32> = (0..kv_heads)
            .flat_map(|g| [&decoded[g * n * d..(g + 1) * n * d], &tail[g * tail_n * d..(g + 1) * tail_n * d]])
            .flatten()
            .copied()
            .collect();
        let keys = Tensor::from_vec(keys, (kv_heads, n + tail_n, d), &cpu)?.to_dtype(dtype)?;
        let gather = |pos: &Tensor| -> Result<Tensor> {
            let per_head =
                (0..heads).map(|h| keys.get(h / group)?.index_select(&pos.get(h)?, 0)).collect::<Result<Vec<_>>>()?;
            Tensor::stack(&per_head, 0)
        };
        let want = hip::search_by_rounds(&Tensor::from_vec(q, (heads, d), &cpu)?, &plan, gather)?;
        assert_eq!(got, want.flatten_all()?.to_vec1::<u32>()?, "seed {seed}: {kind:?} as {dtype:?}, {plan:?}");
        println!("cpu search {heads}/{kv_heads} heads, {kind:?} as {dtype:?}, tail {tail_n}, {plan:?}: equal");
    }
    Ok(())
}
