//! The read tally against host references on random keys: rows by span, the exact mass,
//! passages, and the copy weighing.

use super::*;
use crate::attention::{by_name, Resources};
use crate::kv_cache::DenseKv;
use candle_core::{DType, Device, Tensor};

/// Dense counts every visible row by span; streaming's sinks and window land where they are.
#[test]
fn rows_land_in_their_spans() -> Result<()> {
    let dev = Device::Cpu;
    let (heads, d, t) = (2, 4, 40);
    let mut kv = DenseKv::new(1, 1, d, DType::F32, &dev);
    kv.write(0, 0, &Tensor::randn(0f32, 1.0, (1, t, d), &dev)?, &Tensor::randn(0f32, 1.0, (1, t, d), &dev)?)?;
    kv.set_len(t)?;
    let q = Tensor::randn(0f32, 1.0, (heads, 1, d), &dev)?;
    let call = AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: t - 1, kv: &kv, scale: 0.5, window: None };
    let spans = vec![(2, 10), (10, 30)];
    let dense = by_name("dense", None, &[], &Resources::default())?;
    let tally = ReadTally::new(dense.as_ref(), spans.clone());
    tally.attend(&call)?;
    let s = tally.summary();
    assert_eq!((s.total_rows, s.other_rows, s.steps), ((t * heads) as f64, (12 * heads) as f64, 1));
    assert_eq!(s.documents.iter().map(|r| (r.document, r.rows)).collect::<Vec<_>>(), [(1, 40.0), (0, 16.0)]);
    // 4 sinks (positions 0..4: 2 outside, 2 in span 0) and a window of 4 (36..40: outside).
    let streaming = by_name("streaming", Some("8"), &[], &Resources::default())?;
    let tally = ReadTally::new(streaming.as_ref(), spans);
    tally.attend(&call)?;
    let s = tally.summary();
    assert_eq!((s.total_rows, s.other_rows), ((8 * heads) as f64, (6 * heads) as f64));
    assert_eq!(s.documents.len(), 1);
    assert_eq!((s.documents[0].document, s.documents[0].share), (0, 0.25));
    Ok(())
}

/// The weighed tally against a host reference on random keys: for dense, each span gets
/// the softmax weights of its rows summed over heads (all spans and the rest: one per
/// head); for streaming, only the rows it read count, at their exact weights.
#[test]
fn mass_is_the_exact_attention_weight_of_the_rows_read() -> Result<()> {
    let dev = Device::Cpu;
    let (heads, kv_heads, d, t) = (4, 2, 8, 50);
    let mut kv = DenseKv::new(1, kv_heads, d, DType::F32, &dev);
    let k = Tensor::randn(0f32, 1.0, (kv_heads, t, d), &dev)?;
    kv.write(0, 0, &k, &Tensor::randn(0f32, 1.0, (kv_heads, t, d), &dev)?)?;
    kv.set_len(t)?;
    let q = Tensor::randn(0f32, 1.0, (heads, 1, d), &dev)?;
    let call = AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: t - 1, kv: &kv, scale: 0.35, window: None };
    // The reference: softmax over every visible key, per head, on the host.
    let (qv, kv_rows): (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) = (q.squeeze(1)?.to_vec2()?, k.to_vec3()?);
    let weights: Vec<Vec<f64>> = (0..heads)
        .map(|h| {
            let g = h / (heads / kv_heads);
            let z: Vec<f64> = (0..t)
                .map(|p| 0.35 * qv[h].iter().zip(&kv_rows[g][p]).map(|(a, b)| (a * b) as f64).sum::<f64>())
                .collect();
            let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.into_iter().map(|x| x / sum).collect()
        })
        .collect();
    let spans = vec![(2, 10), (10, 30)];
    let want = |rows: &dyn Fn(usize) -> bool| -> Vec<f64> {
        spans
            .iter()
            .map(|&(a, b)| (0..heads).map(|h| (a..b).filter(|&p| rows(p)).map(|p| weights[h][p]).sum::<f64>()).sum())
            .collect()
    };
    let close = |got: &[SpanReads], want: &[f64]| {
        for r in got {
            assert!(
                (r.mass - want[r.document]).abs() < 1e-5,
                "span {}: {} vs {}",
                r.document,
                r.mass,
                want[r.document]
            );
        }
    };
    let dense = by_name("dense", None, &[], &Resources::default())?;
    let tally = ReadTally::new(dense.as_ref(), spans.clone()).with_mass();
    tally.attend(&call)?;
    let s = tally.summary();
    assert_eq!((s.weighed_calls, s.calls), (1, 1));
    close(&s.documents, &want(&|_| true));
    let shares: f64 = s.documents.iter().map(|r| r.mass_share.unwrap()).sum();
    let outside: f64 = (0..heads).map(|h| (0..2).chain(30..t).map(|p| weights[h][p]).sum::<f64>()).sum();
    assert!((shares - (heads as f64 - outside) / heads as f64).abs() < 1e-5, "{shares}");
    // Streaming reads sinks 0..4 and the window 42..50: span 0 gets positions 2 and 3.
    let streaming = by_name("streaming", Some("12"), &[], &Resources::default())?;
    let tally = ReadTally::new(streaming.as_ref(), spans.clone()).with_mass();
    tally.attend(&call)?;
    let s = tally.summary();
    assert_eq!(s.documents.len(), 1);
    close(&s.documents, &want(&|p| !(4..42).contains(&p)));
    // Without with_mass nothing is weighed and rows order the documents.
    let tally = ReadTally::new(dense.as_ref(), spans);
    tally.attend(&call)?;
    let s = tally.summary();
    assert!(s.weighed_calls == 0 && s.documents.iter().all(|r| r.mass_share.is_none()));
    // A long answer is weighed by a sample of its steps.
    let weighed: Vec<usize> = (0..40).filter(|&s| weighs_step(s)).collect();
    assert_eq!(weighed, (0..16).chain([16, 24, 32]).collect::<Vec<_>>());
    Ok(())
}

/// Passages: with random keys and one key planted to match every query, the planted
/// row's block leads its document's passages, each passage's share is its blocks' exact
/// mass over the document's (host reference), and passages stay inside their span. A
/// sparse method not weighed reports where it picked.
#[test]
fn passages_say_where_the_weight_went() -> Result<()> {
    let dev = Device::Cpu;
    let (heads, kv_heads, d, t) = (2, 1, 8, 200);
    let seed = match std::env::var("FOLIO_SEED") {
        Ok(s) => s.parse().expect("FOLIO_SEED is a u64"),
        Err(_) => rand::random(),
    };
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    use rand::Rng;
    let planted = rng.random_range(70..150);
    let mut keys: Vec<f32> = (0..t * d).map(|_| rng.random_range(-0.3f32..0.3)).collect();
    let q: Vec<f32> = (0..heads * d).map(|i| if i % d == 0 { 4.0 } else { 0.0 }).collect();
    keys[planted * d] = 3.0;
    let k = Tensor::from_vec(keys.clone(), (kv_heads, t, d), &dev)?;
    let mut kv = DenseKv::new(1, kv_heads, d, DType::F32, &dev);
    kv.write(0, 0, &k, &Tensor::randn(0f32, 1.0, (kv_heads, t, d), &dev)?)?;
    kv.set_len(t)?;
    let q = Tensor::from_vec(q, (heads, 1, d), &dev)?;
    let call = AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: t - 1, kv: &kv, scale: 1.0, window: None };
    let spans = vec![(10, 60), (60, 190)];
    let dense = by_name("dense", None, &[], &Resources::default())?;
    let tally = ReadTally::new(dense.as_ref(), spans.clone()).with_mass();
    tally.attend(&call)?;
    let s = tally.summary();
    let doc = s.documents.iter().find(|r| r.document == 1).expect("span 1 read");
    let first = &doc.passages[0];
    assert!((first.start..first.end).contains(&planted), "seed {seed}: {:?} vs {planted}", doc.passages);
    assert_eq!(doc.passages.len(), PASSAGES_KEPT);
    // Host reference: softmax of q·k (every head has the same q), summed per block.
    let z: Vec<f64> = (0..t).map(|p| 4.0 * keys[p * d] as f64).collect();
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    let in_doc: f64 = (60..190).map(|p| e[p] / sum).sum();
    for p in &doc.passages {
        assert!(p.start >= 60 && p.end <= 190 && p.start < p.end, "{p:?}");
        let want = (p.start..p.end).map(|x| e[x] / sum).sum::<f64>() / in_doc;
        assert!((p.share - want).abs() < 1e-5, "seed {seed}: {p:?} vs {want}");
    }
    let span0 = s.documents.iter().find(|r| r.document == 0).expect("span 0 read");
    assert!(span0.passages.iter().all(|p| p.start >= 10 && p.end <= 60));
    // Not weighed: dense says nothing of where; a picking method says where it picked.
    let tally = ReadTally::new(dense.as_ref(), spans.clone());
    tally.attend(&call)?;
    assert!(tally.summary().documents.iter().all(|r| r.passages.is_empty()));
    let topk = by_name("topk", Some("8"), &[], &Resources::default())?;
    let tally = ReadTally::new(topk.as_ref(), spans).with_mass();
    tally.attend(&call)?;
    let s = tally.summary();
    let doc = s.documents.iter().find(|r| r.document == 1).expect("span 1 read");
    assert!((doc.passages[0].start..doc.passages[0].end).contains(&planted), "seed {seed}: {:?}", doc.passages);
    Ok(())
}

/// The copy weighing against a host reference: of the planted rows that match the query,
/// the heavier holds the written token after another one than the step read, the lighter
/// two hold the pair the step read and wrote; the heaviest are a sink holding that pair
/// and a recent row. Raw mass marks a sink or the recent row first; copies mark the written
/// rows, each passage's share its rows' exact softmax weight over theirs.
#[test]
fn copies_mark_where_the_answer_was_copied_from() -> Result<()> {
    use rand::{Rng, SeedableRng};
    let dev = Device::Cpu;
    let (heads, d, t) = (2, 8, 400);
    let seed = match std::env::var("FOLIO_SEED") {
        Ok(s) => s.parse().expect("FOLIO_SEED is a u64"),
        Err(_) => rand::random(),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut tokens: Vec<u32> = (0..t).map(|_| rng.random_range(100..200)).collect();
    let mut keys: Vec<f32> = (0..t * d).map(|_| rng.random_range(-0.3f32..0.3)).collect();
    // The written rows and the rows before them in one passage each (a row before a written
    // one holds the read token, which the other rule counts too).
    let wrote = loop {
        let w = rng.random_range(40..120);
        if [w, w + 70].iter().all(|r| r % PASSAGE_ROWS != 0) {
            break w;
        }
    };
    let (other, recent, sink) = (rng.random_range(200..240), t - 20, 3);
    let written = [wrote, wrote + 70];
    for (p, strength) in [(written[0], 3.0), (written[1], 2.5), (other, 4.0), (recent, 5.0), (sink, 5.0)] {
        keys[p * d] = strength;
    }
    for p in [written[0], written[1], sink] {
        tokens[p] = 7;
        tokens[p - 1] = 5;
    }
    // The other row holds the written token after another one: not a copy of this step.
    tokens[other] = 7;
    let k = Tensor::from_vec(keys.clone(), (1, t, d), &dev)?;
    let mut kv = DenseKv::new(1, 1, d, DType::F32, &dev);
    kv.write(0, 0, &k, &Tensor::randn(0f32, 1.0, (1, t, d), &dev)?)?;
    kv.set_len(t)?;
    let q: Vec<f32> = (0..heads * d).map(|i| if i % d == 0 { 4.0 } else { 0.0 }).collect();
    let q = Tensor::from_vec(q, (heads, 1, d), &dev)?;
    let call = AttnCall { layer: 0, layers: 1, kv_layer: 0, q: &q, q_start: t - 1, kv: &kv, scale: 1.0, window: None };
    let spans = vec![(0, t)];
    let dense = by_name("dense", None, &[], &Resources::default())?;
    // One decode step: it read the answer's token 0 and wrote token 1 (7).
    let answer = [5, 7];
    let raw = ReadTally::new(dense.as_ref(), spans.clone()).with_mass();
    raw.attend(&call)?;
    let first = |s: &ReadSummary| s.documents[0].passages[0].clone();
    let p = first(&raw.summary_of(&answer));
    assert!([sink, recent].iter().any(|x| (p.start..p.end).contains(x)), "seed {seed}: {p:?}");
    let copied = ReadTally::new(dense.as_ref(), spans).with_mass().with_copies(&tokens);
    copied.attend(&call)?;
    let doc = &copied.summary_of(&answer).documents[0];
    // Host reference: the planted rows' softmax weights (every head has the same query).
    let z: Vec<f64> = (0..t).map(|p| 4.0 * keys[p * d] as f64).collect();
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
    let total = e[written[0]] + e[written[1]];
    assert_eq!(doc.passages.len(), 2, "seed {seed}: {:?}", doc.passages);
    for (p, &row) in doc.passages.iter().zip(&written) {
        assert!((p.start..p.end).contains(&row), "seed {seed}: {:?} vs {written:?}", doc.passages);
        assert!((p.share - e[row] / total).abs() < 1e-4, "seed {seed}: {p:?} vs {}", e[row] / total);
    }
    // Before the answer is known (or with an answer that copied nothing), raw mass decides.
    assert_eq!(first(&copied.summary()), p);
    Ok(())
}
