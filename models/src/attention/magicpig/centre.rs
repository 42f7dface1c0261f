//! Each KV head's key mean and every indexed key's distance from it: what MagicPIG hashes
//! (centred keys) and what it weighs a sampled key by (its centred norm). Sums in f64 in
//! position order and norms of the f32 rows minus the f32 mean, whichever way the keys are
//! read, so that every tier builds the reference's tables from the same keys.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::attention::select::dot;
use crate::error::{Error, Result};

/// Per KV head: the keys' mean and each indexed key's centred norm.
pub(super) type Centre = Vec<(Vec<f32>, Vec<f32>)>;

/// Over keys `keys`, from `key(h, p, out)`, key `p` of KV head `h` as f32, read at random (host
/// memory).
pub(super) fn of_rows(
    (kv_heads, d): (usize, usize),
    keys: Range<usize>,
    key: &(dyn Fn(usize, usize, &mut [f32]) + Sync),
) -> Centre {
    let (first, end) = (keys.start, keys.end);
    (0..kv_heads)
        .into_par_iter()
        .map(|h| {
            let (mut sum, mut row) = (vec![0f64; d], vec![0f32; d]);
            for p in first..end {
                key(h, p, &mut row);
                sum.iter_mut().zip(&row).for_each(|(m, x)| *m += *x as f64);
            }
            let mean = mean_of(&sum, end - first);
            let norms = (first..end)
                .into_par_iter()
                .map_init(
                    || vec![0f32; d],
                    |row, p| {
                        key(h, p, row);
                        centred_norm(row, &mean)
                    },
                )
                .collect();
            (mean, norms)
        })
        .collect()
}

/// Over keys `keys`, from `chunk(a, b)`, keys `a..b` as `[kv_heads, b - a, d]` on any device,
/// read once `chunk_rows` at a time (the file tier without its keys in memory: a layer's keys
/// as f32 would be 2 GiB at a million tokens): the means, the norms left empty — the build takes
/// them from the centred keys it hashes ([`super::index::LayerIndex::build_with`]), which saves
/// a pass over the keys from disk.
pub(super) fn of_chunks(
    (kv_heads, d): (usize, usize),
    keys: Range<usize>,
    chunk: &dyn Fn(usize, usize) -> Result<Tensor>,
    chunk_rows: usize,
) -> Result<Centre> {
    let (first, end, step) = (keys.start, keys.end, chunk_rows.max(1));
    // Each head's channels in [`SUM_LANES`]-wide parts over the cores: a channel's sum is its
    // own, in position order, whatever the split.
    let mut sums = vec![vec![0f64; d]; kv_heads];
    for a in (first..end).step_by(step) {
        let b = (a + step).min(end);
        let keys = chunk(a, b)?;
        if keys.dims() != [kv_heads, b - a, d] {
            return Err(Error::Invalid(format!(
                "magicpig: keys {a}..{b} came as {:?}, not [{kv_heads}, {}, {d}]",
                keys.dims(),
                b - a
            )));
        }
        let keys: Vec<f32> = keys.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
        let parts = sums
            .iter_mut()
            .enumerate()
            .flat_map(|(h, sum)| sum.chunks_mut(SUM_LANES).enumerate().map(move |(c, part)| (h, c * SUM_LANES, part)));
        parts.collect::<Vec<_>>().into_par_iter().for_each(|(h, from, part)| {
            for row in keys[h * (b - a) * d..(h + 1) * (b - a) * d].chunks_exact(d) {
                part.iter_mut().zip(&row[from..]).for_each(|(m, x)| *m += *x as f64);
            }
        });
    }
    Ok(sums.iter().map(|s| (mean_of(s, end - first), Vec::new())).collect())
}

/// The norms of `rows` (`d` values each) already centred, as [`of_rows`] takes them.
pub(super) fn norms_of_centred(rows: &[f32], d: usize) -> Vec<f32> {
    rows.par_chunks_exact(d).map(|row| dot(row, row).sqrt()).collect()
}

/// Channels of a head summed by one task: 16 f64 sums, two cache lines.
const SUM_LANES: usize = 16;

fn mean_of(sum: &[f64], n: usize) -> Vec<f32> {
    sum.iter().map(|m| (m / n as f64) as f32).collect()
}

/// `|row − mean|`, `row` centred in place.
fn centred_norm(row: &mut [f32], mean: &[f32]) -> f32 {
    row.iter_mut().zip(mean).for_each(|(x, m)| *x -= m);
    dot(row, row).sqrt()
}
