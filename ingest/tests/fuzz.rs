//! A mutation fuzz harness on stable Rust (cargo-fuzz needs nightly, which the build machine
//! lacks): every file of the corpus, mutated thousands of times, read as the app reads it
//! (`read_bytes`: a worker thread, panics caught, the time limit). Nothing may escape as a
//! panic, no read may run past its time limit, and the process's peak memory stays bounded.
//!
//! Mutations: bit flips, overwritten runs, truncation, a duplicated or deleted chunk, inserted
//! random bytes, a splice with another file; ZIP containers (DOCX, ODT, EPUB) are also mutated
//! *inside*: one XML entry mutated and the container packed again, so the XML walkers see
//! damaged markup rather than only ZIP checksum errors.
//!
//! `FOLIO_FUZZ_CASES` sets the cases per file (default 2000; the seed is printed and taken from
//! `FOLIO_FUZZ_SEED` to replay a run).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use folio_ingest::{read_bytes, Limits};
use rand::{Rng, SeedableRng};

const DEFAULT_CASES: usize = 2000;
/// Each case's time limit: mutated small files read in milliseconds; this bounds the ones
/// that make a parser spin.
const CASE_TIME: Duration = Duration::from_secs(2);
/// How late past its limit a case may come back (the worker's grace, and a loaded machine).
const LATE: Duration = Duration::from_secs(4);
/// Peak resident memory the whole run may reach.
const MAX_PEAK_RSS_BYTES: u64 = 3 << 30;

#[test]
fn mutated_documents_never_crash_hang_or_balloon() {
    let cases: usize = std::env::var("FOLIO_FUZZ_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(DEFAULT_CASES);
    let seed: u64 = std::env::var("FOLIO_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    println!("fuzz: seed {seed} (replay with FOLIO_FUZZ_SEED={seed}), {cases} cases per file");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/ingest/good"));
    let mut seeds: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    seeds.sort();
    let limits = Limits { time: CASE_TIME, ..Limits::default() };
    // Panics inside readers are expected (third-party parsers unwrap) and are caught; keep
    // the log readable.
    std::panic::set_hook(Box::new(|_| {}));
    let mut outcomes: BTreeMap<String, BTreeMap<&'static str, usize>> = BTreeMap::new();
    let mut slowest = Duration::ZERO;
    for (name, original) in &seeds {
        for case in 0..cases {
            let other = &seeds[rng.random_range(0..seeds.len())].1;
            let input = mutate(original, other, case, &mut rng);
            let started = Instant::now();
            let result = read_bytes(Arc::new(input), name, &limits);
            let took = started.elapsed();
            slowest = slowest.max(took);
            assert!(took < CASE_TIME + LATE, "{name} case {case} took {took:?} (seed {seed})");
            let outcome = match &result {
                Ok(_) => "read",
                Err(e) => match e.to_string() {
                    r if r.contains("limit") => "limit",
                    r if r.contains("failed on it") => "crash caught",
                    _ => "refused",
                },
            };
            *outcomes.entry(name.clone()).or_default().entry(outcome).or_default() += 1;
        }
    }
    let _ = std::panic::take_hook();
    println!("{:<26} {:>6} {:>8} {:>6} {:>13}", "file", "read", "refused", "limit", "crash caught");
    for (name, o) in &outcomes {
        let n = |k: &str| o.get(k).copied().unwrap_or(0);
        println!("{name:<26} {:>6} {:>8} {:>6} {:>13}", n("read"), n("refused"), n("limit"), n("crash caught"));
    }
    let peak = peak_rss_bytes();
    println!("slowest case {slowest:?}; peak RSS {} MiB", peak >> 20);
    assert!(peak < MAX_PEAK_RSS_BYTES, "peak RSS {} MiB", peak >> 20);
    // Mutations must leave many inputs readable, or the harness only exercises the first check.
    let read: usize = outcomes.values().map(|o| o.get("read").copied().unwrap_or(0)).sum();
    assert!(read * 4 > cases * seeds.len(), "only {read} of {} mutated inputs were read", cases * seeds.len());
}

fn mutate(original: &[u8], other: &[u8], case: usize, rng: &mut impl Rng) -> Vec<u8> {
    if original.starts_with(b"PK\x03\x04") && case.is_multiple_of(2) {
        if let Some(repacked) = mutate_inside_zip(original, rng) {
            return repacked;
        }
    }
    let mut data = original.to_vec();
    for _ in 0..rng.random_range(1..=3) {
        mutate_bytes(&mut data, other, rng);
    }
    data
}

fn mutate_bytes(data: &mut Vec<u8>, other: &[u8], rng: &mut impl Rng) {
    if data.is_empty() {
        data.push(rng.random());
        return;
    }
    let at = rng.random_range(0..data.len());
    let span = rng.random_range(1..=64.min(data.len() - at));
    match rng.random_range(0..7) {
        0 => {
            for _ in 0..rng.random_range(1..=8) {
                let i = rng.random_range(0..data.len());
                data[i] ^= 1 << rng.random_range(0..8);
            }
        }
        1 => data[at..at + span].iter_mut().for_each(|b| *b = rng.random()),
        2 => data.truncate(at.max(1)),
        3 => {
            let chunk = data[at..at + span].to_vec();
            let to = rng.random_range(0..=data.len());
            data.splice(to..to, chunk);
        }
        4 => {
            data.drain(at..at + span);
        }
        5 => {
            let bytes: Vec<u8> = (0..span).map(|_| rng.random()).collect();
            data.splice(at..at, bytes);
        }
        _ => {
            let from = rng.random_range(0..other.len().max(1));
            let piece = &other[from.min(other.len())..(from + 256).min(other.len())];
            data.splice(at..at + span, piece.iter().copied());
        }
    }
}

/// The container with one of its XML/XHTML entries mutated, packed again.
fn mutate_inside_zip(original: &[u8], rng: &mut impl Rng) -> Option<Vec<u8>> {
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(original)).ok()?;
    let names: Vec<String> = zip.file_names().map(|n| n.map(|n| n.into_owned())).collect::<Result<_, _>>().ok()?;
    let markup: Vec<usize> = (0..names.len())
        .filter(|&i| names[i].ends_with(".xml") || names[i].ends_with("html") || names[i].ends_with(".opf"))
        .collect();
    let target = markup[rng.random_range(0..markup.len())];
    let mut out = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (i, name) in names.iter().enumerate() {
        let mut entry = zip.by_index(i).ok()?;
        let mut data = Vec::new();
        entry.read_to_end(&mut data).ok()?;
        if i == target {
            for _ in 0..rng.random_range(1..=3) {
                mutate_bytes(&mut data, b"<w:p><w:t>x</w:t></w:p><h1>y</h1>", rng);
            }
        }
        out.start_file(name.as_str(), zip::write::SimpleFileOptions::default()).ok()?;
        out.write_all(&data).ok()?;
    }
    Some(out.finish().ok()?.into_inner())
}

fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}
