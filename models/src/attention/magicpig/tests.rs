//! MagicPIG against its definition and against dense attention on the same keys.

use super::index::{bias_of_cos, build_bytes, check_host_memory, projection, BiasTable, BIAS_TABLE_ERROR};
use super::*;
use crate::random::normal;
use candle_core::Device;
use folio_kernels::sparse;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn rand_vec(rng: &mut StdRng, d: usize) -> Vec<f32> {
    (0..d).map(|_| normal(rng)).collect()
}

/// The split starts where it is given, moves a head only on a net BALANCE_VOTES layers'
/// votes for one side (mixed votes cancel), and keeps a head on each side.
#[test]
fn the_balance_moves_toward_the_side_that_finishes_first() {
    let mut b = Balance::default();
    assert_eq!(b.on_gpu(28, 12), 12);
    assert_eq!(b.on_gpu(28, 20), 12, "the start is taken once");
    for i in 0..3 * BALANCE_VOTES {
        b.vote(28, i % 2 == 0);
    }
    assert_eq!(b.on_gpu(28, 12), 12, "mixed votes cancel");
    for _ in 0..BALANCE_VOTES - 1 {
        b.vote(28, true);
    }
    assert_eq!(b.on_gpu(28, 12), 12, "short of a net BALANCE_VOTES");
    b.vote(28, true);
    assert_eq!(b.on_gpu(28, 12), 13);
    for _ in 0..40 * BALANCE_VOTES {
        b.vote(28, true);
    }
    assert_eq!(b.on_gpu(28, 12), 27, "the CPU keeps a head");
    for _ in 0..40 * BALANCE_VOTES {
        b.vote(28, false);
    }
    assert_eq!(b.on_gpu(28, 12), 1, "the GPU keeps a head");
    assert_eq!(b.on_gpu(1, 12), 1, "never more heads than the layer has");
}

/// What the balance learns is reported apart from the settings, which stay the method's
/// identity: a session keeps a method (and its tables) while a fresh one's settings equal it.
#[test]
fn the_balanced_split_is_learned_not_a_setting() {
    let given = vec![("balance".to_string(), "1".to_string())];
    let method = || MagicPig::new(Budget::Tokens(64), Params::parse("magicpig", &PARAMS, &given).unwrap()).unwrap();
    let (used, fresh) = (method(), method());
    assert!(used.learned().is_none());
    used.balance.lock().unwrap().on_gpu = Some(13);
    assert_eq!(used.settings(), fresh.settings());
    assert_eq!(used.learned(), Some(serde_json::json!({ "gpu_heads": 13 })));
}

/// The GPU's share of the sample goes by query heads, the same in the cost as in a step:
/// the host bytes are the CPU's heads' rows, the link carries the GPU's.
#[test]
fn the_split_goes_by_query_heads() {
    use crate::attention::cost::Shape;
    for (share, heads, want) in
        [(0.0, 28, 0), (0.3, 28, 8), (0.4, 28, 11), (0.5, 28, 14), (1.0, 28, 28), (0.5, 1, 1), (0.4, 1, 0)]
    {
        assert_eq!(gpu_heads(share, heads), want, "{share} of {heads}");
    }
    let shape = Shape { layers: 4, heads: 8, kv_heads: 4, head_dim: 16 };
    let (context, elem, budget) = (1 << 16, 2, 256);
    let cost_of = |given: &[&str], fp8_rows: bool| {
        let given: Vec<(String, String)> = given
            .iter()
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect();
        let params = Params::parse("magicpig", &PARAMS, &given).unwrap();
        cost(&CostInput { shape, context, elem, budget, params: &params, fp8_rows })
    };
    let cost = |given: &[&str]| cost_of(given, false);
    // A query head's sample over every layer (all sparse with dense_layers=0): budget rows
    // of K and V.
    let sample_head = (shape.layers * budget * 2 * shape.head_dim * elem) as f64;
    // The CPU split reads every head's sample and walk in host memory, the walk the bytes
    // the GPU's walk brings over the link.
    let cpu = cost(&["gpu=0", "dense_layers=0"]);
    let walk_only = cost(&["dense_layers=0", "gpu_attend=0"]);
    let walk = walk_only.link_bytes - cpu.link_bytes;
    assert!(walk > 0.0 && cpu.host_bytes == 8.0 * sample_head + walk, "{} {walk}", cpu.host_bytes);
    for (share, on_gpu) in [("0.3", 2.0), ("0.4", 3.0), ("0.5", 4.0), ("1", 8.0)] {
        let split = cost(&["dense_layers=0", &format!("gpu_attend={share}")]);
        assert_eq!(split.host_bytes, (8.0 - on_gpu) * sample_head, "gpu_attend={share}");
        assert_eq!(split.link_bytes - walk_only.link_bytes, on_gpu * sample_head, "gpu_attend={share}");
    }
    // Over fp8 rows the share is gpu_attend_fp8's (every head by default), not gpu_attend's.
    let fp8 = cost_of(&["dense_layers=0", "gpu_attend=0.3"], true);
    assert_eq!((fp8.host_bytes, fp8.link_bytes - walk_only.link_bytes), (0.0, 8.0 * sample_head));
    let fp8_half = cost_of(&["dense_layers=0", "gpu_attend_fp8=0.5"], true);
    assert_eq!(fp8_half.host_bytes, 4.0 * sample_head);
}

/// The stable form equals the textbook one where the latter is accurate, and the
/// budget rule inverts it.
#[test]
fn sampling_probability_matches_the_binomial_tail() {
    for (p, k, l) in [(0.9, 10, 150), (0.7, 4, 20), (0.5, 1, 3), (0.99, 8, 75)] {
        let big_p = f64::powi(p, k as i32);
        let naive = 1.0 - (1.0 - big_p).powi(l as i32) - l as f64 * big_p * (1.0 - big_p).powi(l as i32 - 1);
        let got = sampling_probability(p, k, l);
        assert!((got - naive).abs() < 1e-12, "{p} {k} {l}: {got} vs {naive}");
    }
    // Tiny P: the naive form cancels to 0 in f64, the stable one keeps (L choose 2) P².
    let tiny = sampling_probability(0.1, 10, 150);
    let expect = 150.0 * 149.0 / 2.0 * 1e-20;
    assert!((tiny / expect - 1.0).abs() < 1e-6, "{tiny} vs {expect}");
    let (k, l) = tables_for(0.02, 10);
    assert_eq!(k, 10);
    assert!(sampling_probability(0.5, k, l) >= 0.02 && sampling_probability(0.5, k, l - 1) < 0.02);
    // Out of reach at K = 10 within MAX_TABLES: K comes down.
    assert!(tables_for(0.6, 10).0 < 10);
}

/// The fast path's interpolated bias is within its stated error of the exact one, for the
/// (K, L) of the budgets from 0.2% to 10% and the paper's, at random cosines and at the
/// ends (where `acos` is steep); a (K, L) too steep for it has none.
#[test]
fn bias_table_is_within_its_error() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut settings: Vec<(usize, usize)> =
        [0.002, 0.01, 0.0156, 0.05, 0.1].iter().map(|&f| tables_for(f, 10)).collect();
    settings.extend([(10, 150), (4, 20), (1, 3), (12, 1024)]);
    for (bits, tables) in settings {
        let Some(table) = BiasTable::new(bits, tables) else {
            // Too steep to interpolate: only a small K may be, never the budgets' K = 10.
            assert!(bits < 10, "K {bits}, L {tables} has no table");
            continue;
        };
        let ends = [-1.0, -0.999_999, 1.0, 0.999_999, 0.0];
        let cosines = ends.into_iter().chain((0..100_000).map(|_| rng.random_range(-1f32..=1.0)));
        let worst = cosines.map(|c| (table.get(c) - bias_of_cos(c as f64, bits, tables)).abs()).fold(0f32, f32::max);
        assert!(worst < BIAS_TABLE_ERROR, "seed {seed}: K {bits}, L {tables}: off by {worst}");
    }
    assert!(BiasTable::new(10, 150).unwrap().get(f32::NAN).is_nan());
}

/// Codes of one row, as the index computes them.
fn codes(x: &[f32], w: &[f32], bits: usize, tables: usize) -> Vec<u32> {
    sparse::reference::simhash_codes(x, w, x.len(), bits, tables)
}

/// Hashed in chunks of any size (as an offloaded layer is read; boundaries inside and
/// outside the indexed range), the index is the one built from the whole layer; a chunk of
/// the wrong shape is an error, not a wrong index.
#[test]
fn chunked_build_equals_whole() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (kv_heads, len, d) = (2, 500, 16);
    let plan = Plan { first: 7, end: 431, bits: 4, tables: 6, seed };
    let k: Vec<f32> = (0..kv_heads * len * d).map(|_| normal(&mut rng)).collect();
    let rows = LayerRows { k: k.clone(), v: vec![0.0; k.len()], kv_heads, len, head_dim: d };
    let whole = LayerIndex::build(&rows, &plan).unwrap();
    let key = |h: usize, p: usize, out: &mut [f32]| out.copy_from_slice(rows.key(h, p));
    let chunk = |a: usize, b: usize| -> Result<Tensor> {
        let part: Vec<f32> = (0..kv_heads).flat_map(|h| k[(h * len + a) * d..(h * len + b) * d].to_vec()).collect();
        Ok(Tensor::from_vec(part, (kv_heads, b - a, d), &Device::Cpu)?)
    };
    for chunk_rows in [1, 37, 100, 424, 1000] {
        let centre = super::centre::of_rows((kv_heads, d), plan.first..plan.end, &key);
        let parts = LayerIndex::build_with((kv_heads, d), &plan, centre, &chunk, (chunk_rows, &Device::Cpu)).unwrap();
        // The means from the chunks alone, the norms from the chunks the build hashes: the same.
        let centre = super::centre::of_chunks((kv_heads, d), plan.first..plan.end, &chunk, chunk_rows).unwrap();
        let read = LayerIndex::build_with((kv_heads, d), &plan, centre, &chunk, (chunk_rows, &Device::Cpu)).unwrap();
        for (a, b) in read.heads.iter().zip(&whole.heads) {
            let same_lists = (0..plan.tables).all(|l| a.members(l) == b.members(l)) && a.starts[..] == b.starts[..];
            assert!(a.mean == b.mean && a.norms == b.norms && same_lists, "seed {seed}: chunks of {chunk_rows}");
        }
        assert_eq!((parts.first, parts.end, &parts.w), (whole.first, whole.end, &whole.w));
        for (a, b) in parts.heads.iter().zip(&whole.heads) {
            assert!(a.mean == b.mean && a.norms == b.norms, "seed {seed}");
            assert!(
                (0..plan.tables).all(|l| a.members(l) == b.members(l)) && a.starts[..] == b.starts[..],
                "seed {seed}: chunks of {chunk_rows}"
            );
        }
    }
    let short = |a: usize, b: usize| -> Result<Tensor> { chunk(a, b - 1) };
    let centre = super::centre::of_rows((kv_heads, d), plan.first..plan.end, &key);
    assert!(LayerIndex::build_with((kv_heads, d), &plan, centre, &short, (100, &Device::Cpu)).is_err());
    assert!(super::centre::of_chunks((kv_heads, d), plan.first..plan.end, &short, 100).is_err());
}

/// A build that would not fit in the host memory available is refused with what to change;
/// one that fits, or where the available memory is unknown, goes ahead.
#[test]
fn builds_beyond_host_memory_are_refused() {
    let plan = Plan { first: 4, end: 1 << 20, bits: 10, tables: 150, seed: 0 };
    let needed = build_bytes(4, plan.end - plan.first, plan.bits, plan.tables);
    // 150 tables × 6 bytes per key (4-byte codes, 2-byte bucket lists) × 4 KV heads ≈ 3.6 GiB.
    assert!(needed > 3_800_000_000 && needed < 3_900_000_000, "{needed}");
    let err = check_host_memory(needed, Some(needed - 1), &plan).unwrap_err().to_string();
    assert!(err.contains("150 tables of 10 bits") && err.contains("tables="), "{err}");
    assert!(check_host_memory(needed, Some(needed), &plan).is_ok());
    assert!(check_host_memory(needed, None, &plan).is_ok());
}

/// Retrieval returns exactly the keys whose codes match the query's in ≥ 2 tables, each
/// once and ascending, and the bucket lists are permutations with every member in its bucket — within
/// one segment of keys and across three (members stored as offsets within 64 Ki keys).
#[test]
fn retrieval_equals_brute_force_collision_counting() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    for (d, n, heads) in [(16, 700, 2), (8, 2 * 65_536 + 300, 1)] {
        let k: Vec<f32> = (0..heads * n * d).map(|_| normal(&mut rng) + 0.8).collect();
        let rows = LayerRows { k: k.clone(), v: k, kv_heads: heads, len: n, head_dim: d };
        let (first, end, bits, tables) = (3, n - 20, 4, 12);
        let ix = LayerIndex::build(&rows, &Plan { first, end, bits, tables, seed }).unwrap();
        for h in 0..heads {
            let t = &ix.heads[h];
            let key_codes: Vec<Vec<u32>> = (0..end - first)
                .map(|i| {
                    let c: Vec<f32> = rows.key(h, first + i).iter().zip(&t.mean).map(|(a, m)| a - m).collect();
                    codes(&c, &ix.w, bits, tables)
                })
                .collect();
            (0..tables).for_each(|l| {
                let mut seen: Vec<usize> = (0..1 << bits).flat_map(|b| t.bucket(l, b)).collect();
                seen.sort_unstable();
                assert!(seen.iter().enumerate().all(|(i, &x)| i == x), "table {l} is not a permutation");
                for b in 0..1u32 << bits {
                    assert!(t.bucket(l, b).all(|i| key_codes[i][l] == b), "seed {seed}: n {n}, table {l}");
                }
            });
            for _ in 0..5 {
                let q = rand_vec(&mut rng, d);
                // Ascending, as the fast path reads them.
                let (got, _) = ix.retrieve(h, &q).unwrap();
                // The same keys, walked one segment at a time (the fast path's parts).
                let qc = ix.query_codes(&q);
                let parts: Vec<usize> =
                    (0..ix.segments()).flat_map(|s| ix.retrieve_segments(h, &qc, s..s + 1).unwrap().0).collect();
                assert_eq!(parts, got, "seed {seed}: n {n}, walked in parts");
                let qc = codes(&q, &ix.w, bits, tables);
                let want: Vec<usize> = (0..end - first)
                    .filter(|&i| key_codes[i].iter().zip(&qc).filter(|(a, b)| a == b).count() >= 2)
                    .collect();
                assert_eq!(got, want, "seed {seed}: n {n}");
            }
        }
    }
}

/// Bucket lists moved to a spill file (the file tier's) give the walk what the lists in memory
/// give — every query's keys and entries walked, whole and in parts, several heads' runs read
/// at once — and encode to the same section.
#[test]
fn lists_on_disk_walk_as_lists_in_memory() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (d, n, heads) = (8, 2 * 65_536 + 300, 2);
    let k: Vec<f32> = (0..heads * n * d).map(|_| normal(&mut rng) + 0.5).collect();
    let rows = LayerRows { k: k.clone(), v: k, kv_heads: heads, len: n, head_dim: d };
    let plan = Plan { first: 5, end: n - 9, bits: 4, tables: 10, seed };
    let memory = LayerIndex::build(&rows, &plan).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk = LayerIndex::build(&rows, &plan).unwrap().spill(dir.path(), 1).unwrap();
    assert!((0..plan.tables).all(|l| disk.heads[0].members(l).is_none()), "the lists left memory");
    assert_eq!(disk.encode().unwrap(), memory.encode().unwrap(), "seed {seed}");
    for _ in 0..4 {
        let q = rand_vec(&mut rng, d);
        let qc = memory.query_codes(&q);
        for h in 0..heads {
            let want = memory.retrieve(h, &q).unwrap();
            assert!(!want.0.is_empty(), "seed {seed}: a walk that finds nothing checks little");
            assert_eq!(disk.retrieve(h, &q).unwrap(), want, "seed {seed}: head {h}");
            let parts: Vec<usize> =
                (0..disk.segments()).flat_map(|s| disk.retrieve_segments(h, &qc, s..s + 1).unwrap().0).collect();
            assert_eq!(parts, want.0, "seed {seed}: head {h}, in parts");
            let (segs, tail) = (disk.segments(), memory.retrieve_segments(h, &qc, 1..disk.segments()).unwrap());
            assert_eq!(disk.retrieve_segments(h, &qc, 1..segs).unwrap(), tail, "seed {seed}: head {h}, segments 1..");
        }
        let all = disk.read_runs(&[(0, &qc), (1, &qc)], 0..disk.segments()).unwrap();
        for (h, runs) in all.iter().enumerate() {
            assert_eq!(disk.walk_read(h, &qc, runs), memory.retrieve(h, &q).unwrap(), "seed {seed}: read at once");
        }
    }
}

/// A section holding several segments of keys decodes to the index it was encoded from,
/// and a member past its segment's keys (in the last, partial segment) is refused.
#[test]
fn sections_round_trip_and_refuse_members_past_their_segment() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (d, n, heads) = (4, 2 * 65_536 + 300, 1);
    let k: Vec<f32> = (0..heads * n * d).map(|_| normal(&mut rng)).collect();
    let rows = LayerRows { k: k.clone(), v: k, kv_heads: heads, len: n, head_dim: d };
    let plan = Plan { first: 0, end: n, bits: 3, tables: 2, seed };
    let ix = LayerIndex::build(&rows, &plan).unwrap();
    let mut bytes = ix.encode().unwrap();
    let back = LayerIndex::decode(&bytes, "test", &plan, heads, d).unwrap();
    let (a, b) = (&ix.heads[0], &back.heads[0]);
    let same_lists = (0..plan.tables).all(|l| a.members(l) == b.members(l));
    assert!(same_lists && a.starts[..] == b.starts[..] && a.norms == b.norms && back.w == ix.w);
    // Table 0's first member of a non-empty run in the last segment, where 300 keys lie.
    let segs = super::index::segments(n);
    let run = (0..1 << plan.bits).map(|c| c * segs + segs - 1).find(|&r| a.starts(0)[r] < a.starts(0)[r + 1]);
    let at = 4 * (d * plan.bits * plan.tables + d + n + a.starts(0).len()) + 2 * a.starts(0)[run.unwrap()] as usize;
    bytes[at..at + 2].copy_from_slice(&300u16.to_le_bytes());
    let err = LayerIndex::decode(&bytes, "test", &plan, heads, d).err().expect("a member past its segment");
    assert!(err.to_string().contains("out of range"), "{err}");
}

/// A key's inclusion rate over fresh projections matches u = P[Bin(L, p^K) ≥ 2], and one
/// table's collision rate matches (1 - θ/π)^K.
#[test]
fn sampling_probability_matches_monte_carlo() {
    let seed = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (d, bits, tables, draws) = (8, 3, 6, 20_000);
    let q = rand_vec(&mut rng, d);
    for _ in 0..3 {
        // A key at a random angle to q.
        let mix: f32 = rng.random_range(-0.5..1.5);
        let k: Vec<f32> = q.iter().zip(rand_vec(&mut rng, d)).map(|(a, b)| mix * a + b).collect();
        let cos = dot(&q, &k) as f64 / (dot(&q, &q) as f64 * dot(&k, &k) as f64).sqrt();
        let p = collision_probability(cos);
        let (mut sampled, mut first_table) = (0, 0);
        for _ in 0..draws {
            let w = projection(d, bits * tables, rng.random());
            let (cq, ck) = (codes(&q, &w, bits, tables), codes(&k, &w, bits, tables));
            let hits = cq.iter().zip(&ck).filter(|(a, b)| a == b).count();
            sampled += usize::from(hits >= 2);
            first_table += usize::from(cq[0] == ck[0]);
        }
        let tol = |x: f64| 4.0 * (x * (1.0 - x) / draws as f64).sqrt() + 1e-3;
        let u = sampling_probability(p, bits, tables);
        let rate = sampled as f64 / draws as f64;
        assert!((rate - u).abs() < tol(u), "seed {seed}: cos {cos:.3}: sampled {rate} vs u {u}");
        let one = p.powi(bits as i32);
        let rate1 = first_table as f64 / draws as f64;
        assert!((rate1 - one).abs() < tol(one), "seed {seed}: one table {rate1} vs {one}");
    }
}
