//! Top-k and the row gather (kernels/cuda/select.cu) against their references, on fresh random
//! inputs, with one test body for every device.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

use folio_kernels::select::{self, reference, HostRows, SharedHost};
use folio_kernels::Positions;
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::random;
#[path = "common/rows.rs"]
mod rows;
use rows::{stored_section, PageAligned};

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
