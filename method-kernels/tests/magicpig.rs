//! MagicPIG's kernels (method-kernels/cuda/magicpig.cu, method-kernels/src/magicpig/) against
//! their definitions, on fresh random inputs, with one test body for every device: the CPU's
//! attention of picked host rows, the GPU's table walk and its attention of the sample.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;

use folio_kernels::select::{HostRows, SharedHost};
use folio_method_kernels::magicpig::{self, Tables};
use rand::{rngs::StdRng, Rng, SeedableRng};

#[path = "../../kernels/tests/common/mod.rs"]
mod common;
use common::random;
#[path = "../../kernels/tests/common/rows.rs"]
mod rows;
use rows::{stored_section, PageAligned};

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
                    magicpig::attend_partial(&q[h * d..(h + 1) * d], (&kh, &vh), h / group, part, scale, &|j, qk| {
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
        let (out, lse) = magicpig::merge_partials(heads, d, partials);
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
            magicpig::attend_partial(q, (&kh, &vh), kv_head, pick, scale, &no_bias).map(|_| ())
        };
        assert!(attend(&q[..d], 0, &[n as u32]).is_err(), "a position past the rows");
        assert!(attend(&q[..d], kv_heads, &[0]).is_err(), "a KV head past the heads");
        assert!(attend(&q[..d - 1], 0, &[0]).is_err(), "a short query");
        assert!(attend(&q[..d], 0, &[0, n as u32 - 1]).is_ok());
    }
    Ok(())
}

test_device!(host_attention_matches_reference, host_attention_cpu, host_attention_cuda);

/// Bucket lists laid out as MagicPIG's index lays them: per table, the keys sorted by (code, key)
/// as offsets within their segment (`members`, u16), and where each (code, segment) run starts
/// (`starts`, u32, at `code · segments + segment`), from each key's code in each table.
fn bucket_lists(codes: &[Vec<u32>], n: usize, bits: usize) -> (Vec<u8>, Vec<u8>) {
    let (seg, segs) = (magicpig::SEGMENT_KEYS, magicpig::segments(n));
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

/// Tables of random codes over three segments of keys (the last partial), their bucket lists
/// shared with the device, the query heads' codes, and each head's keys that collide with its
/// codes in two tables or more (the definition of the sample).
struct Walked {
    kv_heads: usize,
    group: usize,
    d: usize,
    n: usize,
    first: usize,
    rows: usize,
    index: Tables,
    qc: Vec<u32>,
    codes: Tensor,
    every: Vec<Vec<u32>>,
}

impl Walked {
    fn new(device: &Device, rng: &mut StdRng) -> Result<Self> {
        // Tables past one warp's 32 (the run scan's carry), a head dim past 128 (a lane's second
        // four values).
        let (kv_heads, group, d, bits, tables) = (2, 3, 192, 8, 75);
        let heads = kv_heads * group;
        let n = 2 * magicpig::SEGMENT_KEYS + 1000;
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
        let short = Tables::new(device, lists.clone(), (n + 1, bits, tables)).err().expect("lists for n keys");
        assert!(short.to_string().contains("lists of"), "{short}");
        let index = Tables::new(device, lists, (n, bits, tables))?;
        let qc: Vec<u32> = (0..heads * tables).map(|_| rng.random_range(0..1u32 << bits)).collect();
        let codes = Tensor::from_vec(qc.clone(), (heads, tables), device)?;
        let every: Vec<Vec<u32>> = (0..heads)
            .map(|h| {
                let collide =
                    |i: usize| (0..tables).filter(|&l| key_codes[h / group][l][i] == qc[h * tables + l]).count();
                (0..n).filter(|&i| collide(i) >= 2).map(|i| (first + i) as u32).collect()
            })
            .collect();
        Ok(Self { kv_heads, group, d, n, first, rows, index, qc, codes, every })
    }

    /// The sample's definition from key `first + skip` on.
    fn want(&self, skip: usize) -> Vec<Vec<u32>> {
        self.every.iter().map(|p| p.iter().copied().filter(|&x| x as usize >= self.first + skip).collect()).collect()
    }
}

/// MagicPIG's walk where the device runs it: exactly the keys whose code equals the query
/// head's in two tables or more, from `skip` on, counted from each key's own codes (some heads
/// sharing a KV head's lists); reports of a range of heads, with the codes; walks of a range
/// of heads; bad ranges refused.
fn lsh_walk_matches_definition(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let w = Walked::new(device, &mut rng)?;
    let (group, n, first, qc, codes, index) = (w.group, w.n, w.first, &w.qc, &w.codes, &w.index);
    let heads = w.kv_heads * group;
    let want = |skip| w.want(skip);
    for skip in [0, 70_000, n] {
        let sample = index.walk(codes, group, 0..heads, (first, skip))?;
        // On a GPU the first report of the process (this one: no other test here reports) holds
        // ~28k picks, past the 4,096 words of a first report buffer: it reports again into a
        // larger one, and the comparison covers that path too.
        assert!(sample.positions()? == want(skip), "seed {seed}: skip {skip}: the walk's sample differs");
        // The heads from the middle of the first KV head's on, with the codes; an empty range.
        let (rest, also) = sample.report(group - 1..heads, Some(codes))?.wait()?;
        assert!(rest == want(skip)[group - 1..], "seed {seed}: skip {skip}: heads {}.. differ", group - 1);
        assert!(also == *qc, "seed {seed}: the codes reported with the picks differ");
        let (none, also) = sample.report(heads..heads, Some(codes))?.wait()?;
        assert!(none.is_empty() && also == *qc, "seed {seed}: an empty range");
        // A walk of a range of the heads (from mid-KV-head on; the first heads) is the sample of
        // those heads alone.
        for range in [group - 1..heads, 0..group + 1] {
            let part = index.walk(codes, group, range.clone(), (first, skip))?;
            assert!(part.positions()? == want(skip)[range.clone()], "seed {seed}: skip {skip}: a walk of {range:?}");
        }
    }
    // Empty, reversed and past-the-end ranges are refused.
    for range in [1..1, heads..heads + 1, 0..heads + 1] {
        assert!(index.walk(codes, group, range.clone(), (first, 0)).is_err(), "seed {seed}: {range:?}");
    }
    // Heads past the sample's are refused.
    let sample = index.walk(codes, group, 0..heads, (first, 0))?;
    assert!(sample.report(0..heads + 1, None).is_err() && sample.report(heads + 1..heads + 1, None).is_err());
    assert!(want(0).iter().all(|p| p.len() > 1000), "seed {seed}: samples this size exercise every warp");

    Ok(())
}

test_device!(lsh_walk_matches_definition, lsh_walk_cpu, lsh_walk_cuda);

/// MagicPIG's attention of the walk's sample where the device runs it equals the softmax of
/// `scale·q·k + bias(cos)` in f64 over the stored rows, read from a registered view (bf16, and
/// a context file's fp8 codes with a scale a row) and from page-locked rows (f32); an empty sample gives zeros and an LSE of −∞; the first heads
/// attended alone give what they gave among all; a sample over other keys, more heads than
/// sampled and a walk of later heads are refused; the bias's interpolation hits its table.
fn lsh_attention_matches_definition(device: &Device) -> Result<()> {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let w = Walked::new(device, &mut rng)?;
    let (kv_heads, group, d, n, first, rows, codes, index) =
        (w.kv_heads, w.group, w.d, w.n, w.first, w.rows, &w.codes, &w.index);
    let heads = kv_heads * group;
    // The attention, over the walk's sample and an empty one.
    let (steps, scale) = (64, 0.125f32);
    let table: Vec<f32> = (0..=steps).map(|_| rng.random_range(-3f32..3.0)).collect();
    let norms: Vec<f32> =
        (0..kv_heads * n).map(|i| if i % 997 == 0 { 0.0 } else { rng.random_range(0.1f32..3.0) }).collect();
    let weights_t = Tensor::from_vec([table.clone(), norms.clone()].concat(), steps + 1 + kv_heads * n, device)?;
    let weights = magicpig::Weights { table_and_norms: &weights_t, steps, first, n };
    // Stored as, read as, and whether a view of stored rows (a context file's) or rows of their own.
    for (kind, dtype, view) in
        [(DType::BF16, DType::BF16, true), (DType::F32, DType::F32, false), (DType::F8E4M3, DType::F32, true)]
    {
        let draw = |rng: &mut StdRng| -> Result<Vec<f32>> {
            Tensor::from_vec(random(rng, kv_heads * rows * d, 1.0), kv_heads * rows * d, &Device::Cpu)?
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .to_vec1()
        };
        // The rows, and their values as read (an fp8 row: its codes × its scale).
        let host = |x: &[f32]| -> Result<(HostRows, Vec<f32>)> {
            if view {
                let (section, stored, read) = stored_section(x, d, kind);
                let mut bytes = vec![0u8; PageAligned::PAGE];
                bytes.extend(&section);
                let shared = SharedHost::new(device, Arc::new(PageAligned::new(&bytes)))?;
                Ok((HostRows::view(device, &shared, PageAligned::PAGE, stored, (kv_heads, rows, d), dtype)?, read))
            } else {
                let mut host = HostRows::new(device, dtype, kv_heads, rows, d)?;
                host.write(0, &Tensor::from_slice(x, (kv_heads, rows, d), device)?.to_dtype(dtype)?)?;
                Ok((host, x.to_vec()))
            }
        };
        let ((hk, k), (hv, v)) = (host(&draw(&mut rng)?)?, host(&draw(&mut rng)?)?);
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
        let shifted = index.walk(codes, group, 0..heads, (first + 1, 0))?;
        let err = magicpig::attend(&query_t, &shifted, (&hk, &hv), &weights, scale).expect_err("keys 6.. against 5..");
        assert!(err.to_string().contains("sampled from keys 6.."), "seed {seed}: {err}");
        for skip in [0, n] {
            let sample = index.walk(codes, group, 0..heads, (first, skip))?;
            let (out, lse) = magicpig::attend(&query_t, &sample, (&hk, &hv), &weights, scale)?;
            let (out, lse): (Vec<f32>, Vec<f32>) = (out.flatten_all()?.to_vec1()?, lse.to_vec1()?);
            // The first heads attended alone (part of a KV head's too) give what they gave
            // among all; more query heads than sampled are refused.
            for first_heads in [group, group + 1] {
                let query_first = query_t.narrow(0, 0, first_heads)?;
                let (part_out, part_lse) = magicpig::attend(&query_first, &sample, (&hk, &hv), &weights, scale)?;
                let (part_out, part_lse): (Vec<f32>, Vec<f32>) =
                    (part_out.flatten_all()?.to_vec1()?, part_lse.to_vec1()?);
                assert!(
                    part_out == out[..first_heads * d] && part_lse == lse[..first_heads],
                    "seed {seed}: {kind:?}: the first {first_heads} heads attended alone differ"
                );
            }
            let more = Tensor::cat(&[&query_t, &query_t.narrow(0, 0, 1)?], 0)?;
            assert!(magicpig::attend(&more, &sample, (&hk, &hv), &weights, scale).is_err(), "seed {seed}: {kind:?}");
            // A walk of the first heads attends as the whole walk does; one of later heads is
            // refused (the kernel reads KV head h / group for its head h).
            let first_walk = index.walk(codes, group, 0..group + 1, (first, skip))?;
            let query_first = query_t.narrow(0, 0, group + 1)?;
            let (part_out, part_lse) = magicpig::attend(&query_first, &first_walk, (&hk, &hv), &weights, scale)?;
            let (part_out, part_lse): (Vec<f32>, Vec<f32>) = (part_out.flatten_all()?.to_vec1()?, part_lse.to_vec1()?);
            assert!(
                part_out == out[..(group + 1) * d] && part_lse == lse[..group + 1],
                "seed {seed}: {kind:?}: a walk of the first heads attended differs"
            );
            let later = index.walk(codes, group, 1..heads, (first, skip))?;
            let err = magicpig::attend(&query_t.narrow(0, 1, 1)?, &later, (&hk, &hv), &weights, scale)
                .expect_err("head 1 on");
            assert!(err.to_string().contains(" from head 1 on "), "seed {seed}: {err}");
            let inputs = Inputs { query: &query, k: &k, v: &v, norms: &norms, table: &table, scale };
            check_definition(&w, &inputs, skip, (&out, &lse), &format!("seed {seed}: {kind:?}"));
        }
    }
    // The bias's interpolation: the table at its sample points, halfway between two in between.
    let (a, b) = (magicpig::interpolate(&table, -1.0), magicpig::interpolate(&table, 1.0));
    assert!(a == table[0] && (b - table[steps]).abs() < 1e-6, "the ends");
    let mid = magicpig::interpolate(&table, -1.0 + 2.0 * 10.5 / steps as f32);
    assert!((mid - (table[10] + table[11]) / 2.0).abs() < 1e-5, "halfway: {mid}");
    Ok(())
}

test_device!(lsh_attention_matches_definition, lsh_attention_cpu, lsh_attention_cuda);

/// What the attention was given, as the CPU holds it: `query [heads, d + 2]` (q, |q|, q·mean),
/// the stored rows K and V `[kv_heads, rows, d]` as read, the keys' centred norms and the bias
/// table.
struct Inputs<'a> {
    query: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    norms: &'a [f32],
    table: &'a [f32],
    scale: f32,
}

/// Each head's output and LSE against the definition over the sample from `skip` on, in f64.
fn check_definition(w: &Walked, x: &Inputs<'_>, skip: usize, (out, lse): (&[f32], &[f32]), what: &str) {
    let (d, n, first, rows, group) = (w.d, w.n, w.first, w.rows, w.group);
    for (h, pick) in w.want(skip).iter().enumerate() {
        let kvh = h / group;
        let row = |p: u32| (kvh * rows + p as usize) * d;
        let qh = &x.query[h * (d + 2)..(h + 1) * (d + 2)];
        let logits: Vec<f64> = pick
            .iter()
            .map(|&p| {
                let at = row(p);
                let qk: f64 = (0..d).map(|c| qh[c] as f64 * x.k[at + c] as f64).sum();
                let kn = x.norms[kvh * n + p as usize - first].max(f32::MIN_POSITIVE) as f64;
                let cos = (qk - qh[d + 1] as f64) / (qh[d] as f64 * kn);
                x.scale as f64 * qk + magicpig::interpolate(x.table, cos as f32) as f64
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let got = &out[h * d..(h + 1) * d];
        if pick.is_empty() {
            assert!(got.iter().all(|&x| x == 0.0) && lse[h] == f32::NEG_INFINITY, "{what}: empty head {h}");
            continue;
        }
        let sum: f64 = logits.iter().map(|z| (z - max).exp()).sum();
        for (c, &g) in got.iter().enumerate() {
            let o: f64 =
                pick.iter().zip(&logits).map(|(&p, z)| (z - max).exp() * x.v[row(p) + c] as f64).sum::<f64>() / sum;
            assert!((g as f64 - o).abs() < 1e-4, "{what}: head {h} channel {c}: {g} vs {o}");
        }
        let l = max + sum.ln();
        assert!((lse[h] as f64 - l).abs() < 1e-4 * l.abs().max(1.0), "{what}: head {h}: lse {} vs {l}", lse[h]);
    }
}
