//! The methods' fast paths on both decode tiers — offloaded (saved rows in host memory, gathered
//! by what a method picks) and resident (rows on the device) — against their CPU references
//! over a store holding the same rows, on fresh random workloads, with one test body for every
//! device.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use folio_eval::workload::{Case, Spec};
use folio_models::attention::{by_name, parse_params, AttnCall, Channels, Drawn, Read, Resources};
use folio_models::context::EncodeTensor;
use folio_models::kv_cache::OffloadKv;
use folio_models::kv_cache::{DenseKv, KvSegment, KvStore, Reference};
use folio_models::kv_cache::{Resident, TierRef};
use folio_models::Result;

// The kernels' one-body-per-device macro (and helpers), shared rather than written twice.
#[path = "../../kernels/tests/common/mod.rs"]
mod common;

/// Largest |a - b| over two tensors' elements.
fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let flat = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?)
    };
    Ok(common::max_abs_diff(&flat(a)?, &flat(b)?))
}

/// The same rows, resident, reporting the offloaded store's saved length (indexes cover the
/// saved prefix, so every path must see the same one): the resident tier, and under
/// [`Reference`] the references' store.
struct SavedDense {
    rows: DenseKv,
    saved: usize,
    shape: (usize, usize),
    device: Device,
}

impl KvStore for SavedDense {
    fn len(&self) -> usize {
        self.rows.len()
    }

    fn write(&mut self, layer: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.rows.write(layer, pos, k, v)
    }

    fn segments(&self, layer: usize, end: usize) -> Result<Vec<KvSegment>> {
        self.rows.segments(layer, end)
    }

    fn set_len(&mut self, len: usize) -> Result<()> {
        self.rows.set_len(len)
    }

    fn reserve(&mut self, total: usize) -> Result<()> {
        self.rows.reserve(total)
    }

    fn saved_len(&self) -> usize {
        self.saved
    }

    fn tier(&self) -> Option<TierRef<'_>> {
        Some(Resident::of(self, self.shape.0, self.shape.1, &self.device))
    }
}

/// The case's rows on the device, reporting `saved` as the saved length: the resident tier.
fn resident(case: &Case, saved: usize, device: &Device) -> Result<SavedDense> {
    let (kv_heads, d, len) = (case.k.dim(0)?, case.k.dim(2)?, case.k.dim(1)?);
    let mut rows = DenseKv::new(1, kv_heads, d, DType::F32, device);
    rows.write(0, 0, &case.k.narrow(1, 0, len)?.to_device(device)?, &case.v.narrow(1, 0, len)?.to_device(device)?)?;
    rows.set_len(len)?;
    Ok(SavedDense { rows, saved, shape: (kv_heads, d), device: device.clone() })
}

/// The case's rows up to `saved` left in a file at `path`, read through `blocks` blocks of host
/// memory (few: most picks miss, and a gather wanting more reads the rest past the cache; many:
/// the keys are read into memory and the rest caches values), the rest of the case's rows
/// written as its tail; and the bytes of a block.
fn on_file(
    case: &Case,
    saved: usize,
    path: &std::path::Path,
    blocks: usize,
    device: &Device,
) -> Result<(OffloadKv, usize)> {
    let (kv_heads, d, len) = (case.k.dim(0)?, case.k.dim(2)?, case.k.dim(1)?);
    let block = folio_models::kv_cache::BLOCK_ROWS * d * 4;
    let on = |t: Tensor| t.to_device(device);
    let mut kv = OffloadKv::stored_file(
        path,
        (1, kv_heads, saved, d),
        (folio_models::context::KvDtype::F32, DType::F32),
        device,
        |_, start, t| Ok((on(case.k.narrow(1, start, t)?)?, on(case.v.narrow(1, start, t)?)?)),
        (blocks * block) as u64,
    )?;
    kv.write(0, saved, &on(case.k.narrow(1, saved, len - saved)?)?, &on(case.v.narrow(1, saved, len - saved)?)?)?;
    kv.set_len(len)?;
    Ok((kv, block))
}

/// The knobs each labelled method runs with here: one layer, which HiP's and MagicPIG's dense
/// layers would cover.
fn knobs(label: &str) -> Result<Vec<(String, String)>> {
    Ok(match label {
        "hip" => parse_params(&["dense_layers=0".into(), "refresh=3".into()])?,
        "magicpig" => parse_params(&["dense_layers=0".into()])?,
        "magicpig gpu=0" => parse_params(&["dense_layers=0".into(), "gpu=0".into()])?,
        "magicpig gpu_attend=1" => parse_params(&["dense_layers=0".into(), "gpu_attend=1".into()])?,
        "magicpig balance=1" => parse_params(&["dense_layers=0".into(), "balance=1".into()])?,
        _ => vec![],
    })
}

/// Every method with an offloaded path gives its reference's output on each decode step of a
/// mixed workload (a saved prefix on the host, a tail of question tokens on the device), and a
/// multi-token call (the question) is exact dense attention; on the offloaded tier with the rows
/// in host memory, on the file tier and on the resident tier.
fn offloaded_matches_reference(device: &Device) -> Result<()> {
    let seed = common::seed();
    let spec = Spec { q_heads: 8, kv_heads: 2, head_dim: 64, ..Spec::mixed(3000) };
    let case = Case::generate(&spec, seed)?;
    // The saved prefix ends 40 tokens before the first decode step: those are the tail.
    let (len, saved) = (spec.len(), spec.context - 40);
    let shape = (spec.kv_heads, spec.head_dim);
    let reference_kv = Reference(SavedDense { rows: case.store()?, saved, shape, device: Device::Cpu });
    let on = |t: Tensor| t.to_device(device);
    let resident_kv = resident(&case, saved, device)?;
    let mut kv = OffloadKv::new(1, spec.kv_heads, spec.head_dim, saved, DType::F32, device)?;
    kv.fill(0, 0, &case.k.narrow(1, 0, saved)?, &case.v.narrow(1, 0, saved)?)?;
    kv.write(0, saved, &on(case.k.narrow(1, saved, len - saved)?)?, &on(case.v.narrow(1, saved, len - saved)?)?)?;
    kv.set_len(len)?;
    assert!(kv.write(0, saved - 1, &on(case.k.narrow(1, 0, 1)?)?, &on(case.v.narrow(1, 0, 1)?)?).is_err());
    let dir = tempfile::tempdir().expect("a temporary folder");
    // 40 blocks' bytes for the 372 blocks the rows take; and 300, which hold the keys (186
    // blocks) in memory.
    let (file_kv, block) = on_file(&case, saved, &dir.path().join("rows"), 40, device)?;
    let (keys_kv, _) = on_file(&case, saved, &dir.path().join("keyed"), 300, device)?;
    let in_memory = |kv: &OffloadKv| kv.file_stats().is_some_and(|s| s.keys_in_memory > 0);
    assert!(!in_memory(&file_kv) && in_memory(&keys_kv));
    let tiers =
        [("offloaded", &kv as &dyn KvStore), ("file", &file_kv), ("file+keys", &keys_kv), ("resident", &resident_kv)];
    let channels = Arc::new(Channels::from_statistic(&[case.qk_statistic()?]));
    let resources = Resources { channels: Some(channels) };
    for (name, budget) in [
        ("dense", None),
        ("streaming", Some("5%")),
        // A window far shorter than the steps' reach: the device ring wraps every step.
        ("streaming", Some("12")),
        ("topk", Some("2%")),
        ("double-sparsity", Some("5%")),
        ("buzz", Some("10%")),
        ("hip", Some("5%")),
        // The sample drawn and attended by the CPU, as the paper splits it.
        ("magicpig gpu=0", Some("5%")),
        // Drawn by the GPU, the first `gpu_attend` share of the query heads' samples attended
        // there and the others' by the CPU (the default; the CPU alone on a CPU device); and
        // the balanced path (votes taken, though one layer's steps here are too few to move the
        // split: `Balance`'s unit test).
        ("magicpig", Some("5%")),
        ("magicpig balance=1", Some("5%")),
        // Drawn and attended by the GPU over the host link.
        ("magicpig gpu_attend=1", Some("5%")),
    ] {
        let params = knobs(name)?;
        let (label, name) = (name, name.split(' ').next().unwrap_or(name));
        let reference = by_name(name, budget, &params, &resources)?;
        for (tier, fast_kv) in tiers {
            let fast = by_name(name, budget, &params, &resources)?;
            let mut worst = 0f32;
            // Rows the reference read that the fast path read too, and rows the reference read.
            let (mut shared, mut wanted) = (0usize, 0usize);
            for step in 0..spec.steps {
                let want = reference.attend(&case.call(step, &reference_kv, (0, 1)))?;
                let q = case.queries[step].to_device(device)?;
                let call = AttnCall { q: &q, kv: fast_kv, ..case.call(step, &reference_kv, (0, 1)) };
                let got = fast.attend(&call)?;
                assert_eq!(got.out.dims(), want.out.dims());
                if name == "magicpig" && tier == "offloaded" {
                    // Drawn where asked: on a GPU by the kernels, on the CPU by the pool.
                    let on_device = matches!(got.read, Read::Sampled { picks: Drawn::Device { .. }, .. });
                    let asked = device.is_cuda() && label != "magicpig gpu=0";
                    assert_eq!(on_device, asked, "{label}: the sample was drawn elsewhere");
                }
                worst = worst.max(max_diff(&got.out, &want.out)?);
                match (got.read.rows()?, want.read.rows()?) {
                    (None, None) => {}
                    (Some(g), Some(w)) => {
                        for (g, w) in g.iter().zip(w.iter()) {
                            shared += w.iter().filter(|p| g.binary_search(p).is_ok()).count();
                            wanted += w.len();
                        }
                    }
                    (g, w) => {
                        panic!("{name}: the fast path read {:?} rows, the reference {:?}", g.is_some(), w.is_some())
                    }
                }
            }
            let overlap = if wanted == 0 { 1.0 } else { shared as f64 / wanted as f64 };
            println!(
            "{device:?} {label}, {tier}: max |fast - reference| over {} steps = {worst:.2e}, reads shared {:.4} (seed {seed})",
            spec.steps, overlap
        );
            // Every fast path reports what it read, and reads what the reference reads (a key tied at
            // the k-th place may swap).
            assert!(
                overlap > 0.98,
                "seed {seed}: {label} on the {tier} tier read other rows than the reference ({overlap})"
            );
            // Methods ranking keys by scores summed in another order (f64 vs f32, a kernel's order)
            // may swap a key tied at the k-th place to rounding: a shift of a few 1e-3 at most.
            let tol = if ["topk", "double-sparsity", "hip"].contains(&name) { 2e-2 } else { 1e-4 };
            assert!(worst < tol, "seed {seed}: {label} on the {tier} tier differs by {worst}");
        }
    }

    // The question: five tokens at once, crossing from the saved prefix's end into the tail.
    let q = Tensor::randn(0f32, 1.0, (spec.q_heads, 5, spec.head_dim), &Device::Cpu)?;
    let call = |q, kv| AttnCall { q, q_start: saved + 2, ..case.call(0, kv, (0, 1)) };
    let dense = by_name("dense", None, &[], &resources)?;
    let want = dense.attend(&call(&q, &reference_kv))?.out;
    let qd = q.to_device(device)?;
    for name in ["dense", "topk", "double-sparsity", "buzz"] {
        for (tier, fast_kv) in tiers {
            let method = by_name(name, (name != "dense").then_some("2%"), &[], &resources)?;
            let diff = max_diff(&method.attend(&call(&qd, fast_kv))?.out, &want)?;
            println!("{device:?} {name}, {tier}, 5-token call: max |fast - dense| = {diff:.2e}");
            assert!(diff < 1e-4, "seed {seed}: {name} question on the {tier} tier differs by {diff}");
        }
    }
    read_through_the_cache(&file_kv, &keys_kv, block);
    Ok(())
}

/// The file tier read what the steps picked through its cache: hits, and misses read from the
/// file, in a cache of about 40 blocks' bytes (its records take a little: a block's worth here);
/// gathers whose blocks all had a slot were read from the cache by the device, the others
/// widened by the CPU.
fn read_through_the_cache(file_kv: &OffloadKv, keys_kv: &OffloadKv, block: usize) {
    let stats = file_kv.file_stats().expect("rows on the file tier");
    let read = stats.hits > 0 && stats.blocks_read > 0 && stats.bytes_read > 0;
    assert!(read && stats.cache_bytes <= 40 * block as u64 && stats.slots >= 38, "{stats:?}");
    let keyed = keys_kv.file_stats().expect("rows on the file tier");
    assert!(keyed.device_gathers > 0 && stats.device_gathers < stats.gathers, "{stats:?} {keyed:?}");
    // HiP's searches between refreshes read their rows ahead.
    assert!(stats.blocks_ahead > 0 && keyed.blocks_ahead > 0, "{stats:?} {keyed:?}");
}

test_device!(offloaded_matches_reference, offloaded_cpu, offloaded_cuda);

/// Rows stored as a context file of each K/V dtype stores them (`OffloadKv::stored`, the bench's
/// file tier) read back as that file's decode of the same rows, bit for bit: every storage
/// dtype, on every device, positions spread over more than one fill chunk.
fn stored_rows_read_as_the_file_decodes(device: &Device) -> Result<()> {
    use folio_models::context::format::SectionKind;
    use folio_models::context::KvDtype;
    use folio_models::kv_cache::DecodeTier;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (layers, kv_heads, saved, d) = (2, 2, 70_000, 32);
    // The fill is asked for every layer's chunks; the rows are kept to decode them here too.
    let rows: Vec<Vec<f32>> = (0..2 * layers).map(|_| common::random(&mut rng, kv_heads * saved * d, 3.0)).collect();
    let dtype = if device.is_cuda() { DType::BF16 } else { DType::F32 };
    let fill = |layer: usize, start: usize, t: usize| -> Result<(Tensor, Tensor)> {
        let part = |x: &[f32]| -> candle_core::Result<Tensor> {
            let all = Tensor::from_vec(x.to_vec(), (kv_heads, saved, d), device)?;
            all.narrow(1, start, t)?.contiguous()?.to_dtype(dtype)
        };
        Ok((part(&rows[2 * layer])?, part(&rows[2 * layer + 1])?))
    };
    let dir = tempfile::tempdir().expect("a temporary folder");
    for kv_dtype in [KvDtype::Fp8, KvDtype::Bf16Fp8, KvDtype::Bf16, KvDtype::F32] {
        let shape = (layers, kv_heads, saved, d);
        let kv = OffloadKv::stored(shape, kv_dtype, dtype, device, fill)?;
        assert!(kv.in_place());
        // The same layout in a file, on the file tier with 3 MB (the fp8 scales take 2.2 MB of
        // it: a few hundred blocks of cache, fewer than a gather's): a scan (the segments) and
        // random picks give the in-memory rows bit for bit.
        let path = dir.path().join(kv_dtype.name());
        let on_file = OffloadKv::stored_file(&path, shape, (kv_dtype, dtype), device, fill, 3_000_000)?;
        if kv_dtype == KvDtype::Fp8 {
            // Less than its scales and a block is refused, saying what it needs.
            let small = dir.path().join("small");
            let err = OffloadKv::stored_file(&small, shape, (kv_dtype, dtype), device, fill, 3 << 16).err();
            let err = err.map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("needs at least 2.2 MiB of host memory"), "{err}");
        }
        // And with 64 MiB: the keys (at most 36 MB) read into memory, the values from the file.
        let keyed_path = dir.path().join(format!("{}-keyed", kv_dtype.name()));
        let keyed = OffloadKv::stored_file(&keyed_path, shape, (kv_dtype, dtype), device, fill, 64 << 20)?;
        assert!(keyed.file_stats().is_some_and(|s| s.keys_in_memory > 0));
        for layer in 0..layers {
            // Random rows, and rows of every other block (runs read with the gaps between).
            let picks: Vec<u32> = (0..2 * kv_heads * 300)
                .map(|i| match i % 2 {
                    0 => rng.random_range(0..saved as u32),
                    _ => (i as u32 / 2 * 64 + 3) % saved as u32,
                })
                .collect();
            let idx = Tensor::from_vec(picks, (2 * kv_heads, 300), device)?;
            for (tier, file_kv) in [("file", &on_file), ("file+keys", &keyed)] {
                let name = format!("seed {seed}: {} layer {layer} on the {tier} tier", kv_dtype.name());
                let (a, b) = (&kv.segments(layer, saved)?[0], &file_kv.segments(layer, saved)?[0]);
                for (x, y) in [(&a.k, &b.k), (&a.v, &b.v)] {
                    assert_eq!(max_diff(x, y)?, 0.0, "{name}: a scan");
                }
                let (a, b) =
                    (DecodeTier::gather(&kv, layer, &idx, saved)?, DecodeTier::gather(file_kv, layer, &idx, saved)?);
                for (x, y) in [(&a.0, &b.0), (&a.1, &b.1)] {
                    assert_eq!(max_diff(x, y)?, 0.0, "{name}: picks");
                }
            }
        }
        // The picks from the 64 MiB cache were gathered by the device from its slots.
        assert!(keyed.file_stats().is_some_and(|s| s.device_gathers > 0), "{}", kv_dtype.name());
        let name = format!("seed {seed}: {}", kv_dtype.name());
        reads_ahead(&kv, [("file", &on_file), ("file+keys", &keyed)], &mut rng, &name)?;
        for layer in 0..layers {
            let got = kv.segments(layer, saved)?;
            for (i, (kind, t)) in
                [(SectionKind::Keys, &got[0].k), (SectionKind::Values, &got[0].v)].into_iter().enumerate()
            {
                // The file's path: the rows in the compute dtype, encoded, decoded, cast.
                let x = Tensor::from_vec(rows[2 * layer + i].clone(), kv_heads * saved * d, &Device::Cpu)?
                    .to_dtype(dtype)?;
                let codec = kv_dtype.codec(kind);
                let bytes = codec.encode_tensor(&x.to_device(device)?.reshape((kv_heads * saved, d))?, d)?;
                let want =
                    Tensor::from_vec(codec.decode(&bytes, kv_heads * saved, d)?, kv_heads * saved * d, &Device::Cpu)?
                        .to_dtype(dtype)?
                        .to_dtype(DType::F32)?
                        .to_vec1::<f32>()?;
                let got: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                assert!(got == want, "seed {seed}: {} {kind:?} of layer {layer} on {device:?}", kv_dtype.name());
            }
        }
    }
    Ok(())
}

test_device!(stored_rows_read_as_the_file_decodes, stored_rows_cpu, stored_rows_cuda);

/// A read-ahead on the file tier (what HiP starts as its search ends): fresh picks read into
/// the cache on a thread of their own while another gather runs, then gathered with their
/// positions listed — the in-memory rows bit for bit, and where the cache holds every block
/// (`file+keys`: the values cached, the keys in memory) none read by the gather. The host tier
/// reads nothing ahead.
fn reads_ahead(kv: &OffloadKv, tiers: [(&str, &OffloadKv); 2], rng: &mut rand::rngs::StdRng, name: &str) -> Result<()> {
    use folio_models::kv_cache::DecodeTier;
    use rand::Rng;
    let (saved, heads) = (DecodeTier::saved(kv), 2 * DecodeTier::kv_heads(kv));
    let device = DecodeTier::device(kv).clone();
    let mut picks = || -> Result<(Vec<u32>, Tensor)> {
        let list: Vec<u32> = (0..heads * 300).map(|_| rng.random_range(0..saved as u32)).collect();
        let idx = Tensor::from_vec(list.clone(), (heads, 300), &device)?;
        Ok((list, idx))
    };
    let same = |a: &(Tensor, Tensor), b: &(Tensor, Tensor), what: &str| -> Result<()> {
        for (x, y) in [(&a.0, &b.0), (&a.1, &b.1)] {
            assert_eq!(max_diff(x, y)?, 0.0, "{name}: {what}");
        }
        Ok(())
    };
    for (tier, file_kv) in tiers {
        let ((ahead, ahead_idx), (other, other_idx)) = (picks()?, picks()?);
        let before = file_kv.file_stats().expect("the file tier");
        let list = ahead.clone();
        let read = DecodeTier::read_ahead(file_kv, 0, (heads, 300), Box::new(move || Ok(list)));
        let read = read.expect("the file tier reads ahead");
        // A gather while the read-ahead runs.
        let got = DecodeTier::gather_listed(file_kv, 0, &other_idx, &other, saved)?;
        same(&got, &DecodeTier::gather(kv, 0, &other_idx, saved)?, &format!("{tier}: a gather beside a read-ahead"))?;
        assert_eq!(read.positions()?, ahead, "{name}: {tier}: the positions read ahead");
        let mid = file_kv.file_stats().expect("the file tier");
        let got = DecodeTier::gather_listed(file_kv, 0, &ahead_idx, &ahead, saved)?;
        same(&got, &DecodeTier::gather(kv, 0, &ahead_idx, saved)?, &format!("{tier}: rows read ahead"))?;
        let after = file_kv.file_stats().expect("the file tier");
        assert!(mid.blocks_ahead > before.blocks_ahead, "{name}: {tier}: nothing read ahead: {mid:?}");
        if tier == "file+keys" {
            assert_eq!(after.blocks_read, mid.blocks_read, "{name}: the gather read blocks read ahead");
        }
        assert!(DecodeTier::gather_listed(file_kv, 0, &ahead_idx, &ahead[1..], saved).is_err());
    }
    assert!(DecodeTier::read_ahead(kv, 0, (heads, 300), Box::new(|| Ok(Vec::new()))).is_none());
    Ok(())
}
