//! The `folio bench` commands end to end on the CPU: decode over a shape's synthetic context
//! against its floor, held to the device and host budgets; prefill of a shape; the kernels
//! against measured limits. What scripts see (`--json`), and a clear error for bad input.

use std::path::Path;

use serde_json::Value;

#[path = "common/cli.rs"]
mod common;
use common::{err_text, folio};

/// `folio bench --shape` on the CPU with a tiny shape: every offloaded method decodes over the
/// same synthetic context and reports its time, its floor and their ratio (JSON lines); a
/// method without an offloaded path, and a plan over the memory budget, are refused up front.
#[test]
fn shape_bench_reports_decode_against_its_floor() {
    let shape = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/shapes/tiny.json");
    let shape = shape.to_str().unwrap();
    let methods = "dense,streaming:5%,topk:5%,double-sparsity:5%,buzz:5%,hip:5%,magicpig:5%";
    let args = [
        "bench",
        "--shape",
        shape,
        "--context",
        "2000",
        "--method",
        methods,
        "--steps",
        "3",
        "--warmup",
        "1",
        "--json",
    ];
    let out = folio(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(names, methods.split(',').collect::<Vec<_>>());
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    for r in &rows {
        let (mean, floor) = (f(r, "decode_ms_mean"), f(r, "floor_ms"));
        assert!(mean > 0.0 && floor > 0.0, "{r}");
        // The mean leads: the ratio to the floor is the mean's.
        assert!((f(r, "measured_over_floor") - mean / floor).abs() < 1e-9 * mean / floor);
        assert!((f(r, "p90_over_mean") - f(r, "decode_ms_p90") / mean).abs() < 1e-9);
        // The floor is its largest term, named; the device term is the weights and the index.
        let terms =
            [("device", f(r, "floor_device_ms")), ("link", f(r, "floor_link_ms")), ("host", f(r, "floor_host_ms"))];
        let binds = terms.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        assert_eq!((r["floor_binds"].as_str().unwrap(), floor), (binds.0, binds.1), "{r}");
        assert!((f(r, "floor_weights_ms") + f(r, "floor_index_ms") - terms[0].1).abs() < 1e-9 * floor, "{r}");
        // The consumer link: the same bytes at 25 GB/s, added to the measured mean.
        let pcie_link = f(r, "link_bytes_per_step") / 25e9 * 1e3;
        assert!((f(r, "pcie4_link_ms") - pcie_link).abs() < 1e-9 * (1.0 + pcie_link), "{r}");
        assert!((f(r, "pcie4_mean_ms") - (mean + pcie_link - terms[1].1)).abs() < 1e-9 * mean, "{r}");
        assert!((f(r, "pcie4_floor_ms") - terms[0].1.max(pcie_link).max(terms[2].1)).abs() < 1e-12 + 1e-9 * floor);
        // Two layers × two KV heads × 2000 tokens × 32 channels × K and V, f32 on the CPU.
        assert_eq!(r["host_kv_bytes"].as_u64().unwrap(), 2 * 2 * 2000 * 32 * 2 * 4);
        assert_eq!(r["parameters"].as_u64().unwrap(), 361_600);
    }
    // Dense moves every row over the link; streaming 5% of them, once per KV head.
    assert!(rows[0]["link_bytes_per_step"].as_f64().unwrap() > 10.0 * rows[1]["link_bytes_per_step"].as_f64().unwrap());
    // Stored as an fp8 context file stores it: the host holds the sections (codes, then a scale
    // per row), and the rows cross the link at that size.
    let mut fp8 = args.to_vec();
    fp8[6] = "topk:5%,buzz:5%";
    fp8.extend(["--kv-dtype", "fp8"]);
    let out = folio(&fp8);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stored: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let section = 2 * 2000 * 32 + 2 * 2000 * 4;
    for r in &stored {
        assert_eq!((r["kv_dtype"].as_str(), r["host_kv_bytes"].as_u64()), (Some("fp8"), Some(2 * 2 * section)), "{r}");
        assert!(f(r, "decode_ms_mean") > 0.0, "{r}");
    }
    let ratio = section as f64 / (2.0 * 2000.0 * 32.0 * 4.0);
    let topk_link = f(&rows[2], "link_bytes_per_step");
    assert!((f(&stored[0], "link_bytes_per_step") - topk_link * ratio).abs() < 1e-6 * topk_link, "{}", stored[0]);
    let mut bad = args.to_vec();
    bad[6] = "topk-ivf";
    assert!(err_text(folio(&bad)).contains("topk-ivf on the offloaded tier: no offloaded fast path"));
    let mut tight = args.to_vec();
    tight.extend(["--vram-budget", "1MiB"]);
    assert!(err_text(folio(&tight)).contains("more than the 1.0 MiB budget"));
    // --profile: the host's share of a step within the step, and the layer's spans, each
    // called once a layer a step (two layers), inside the synchronised step.
    let mut profiled = args.to_vec();
    profiled[6] = "streaming:5%";
    profiled.push("--profile");
    let out = folio(&profiled);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    let p = &r["profile"];
    assert!(f(p, "host_ms") > 0.0 && f(p, "step_ms") > 0.0, "{p}");
    let spans = p["spans"].as_array().unwrap();
    let names: Vec<&str> = spans.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let named = |want: &str| &spans[names.iter().position(|n| *n == want).unwrap_or_else(|| panic!("{want} in {p}"))];
    for want in ["attention", "MLP", "q/k/v projections, RoPE", "o projection, residual, norm"] {
        assert_eq!(f(named(want), "calls"), 2.0, "{want}: {p}");
    }
    // The offloaded attention's parts, inside its span and left out of the sum.
    let parts = ["attention: gather", "attention: kernel"];
    for want in parts {
        assert_eq!(f(named(want), "calls"), 2.0, "{want}: {p}");
    }
    // And a fresh conversation's first step, its spans synchronised.
    let first = &r["first_step_profile"];
    assert!(f(first, "seconds") > 0.0 && !first["spans"].as_array().unwrap().is_empty(), "{first}");
    assert!(parts.iter().map(|w| f(named(w), "device_ms")).sum::<f64>() <= f(named("attention"), "device_ms"), "{p}");
    let top = spans.iter().filter(|s| !s["name"].as_str().unwrap().contains(": "));
    assert!(top.map(|s| f(s, "device_ms")).sum::<f64>() <= f(p, "synced_step_ms"), "{p}");
    // Both clocked passes saw every span (a span missing from the host's pass reads 0).
    assert!(spans.iter().all(|s| f(s, "host_ms") > 0.0 && f(s, "device_ms") > 0.0), "{p}");
}

/// `--host-budget` holds a decode run's whole process: a run whose K/V, method state and
/// process would pass it is refused before anything is allocated, naming each part; one that
/// fits reports its plan and a peak resident set within the budget (the run fails otherwise).
#[test]
fn the_host_budget_holds_a_decode_run() {
    let shape = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/shapes/tiny.json");
    let bench = |budget: &str| {
        let args = ["--host-budget", budget, "bench", "--shape", shape.to_str().unwrap()];
        let rest = ["--context", "200000", "--method", "streaming:1%,magicpig:1%", "--steps", "2", "--warmup", "1"];
        folio(&[&args[..], &rest[..], &["--json"]].concat())
    };
    // 2 layers × 2 KV heads × 200,000 tokens × 32 f32 × K and V: 195.3 MiB.
    let err = err_text(bench("150MiB"));
    assert!(err.contains("more than the 150.0 MiB host budget: K/V 195.3 MiB, method state"), "{err}");
    assert!(err.contains("raise --host-budget"), "{err}");
    let out = bench("2GiB");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let r: Value = serde_json::from_str(line).unwrap();
        let (peak, budget) = (r["peak_rss_bytes"].as_u64().unwrap(), r["host_budget"].as_u64().unwrap());
        assert_eq!(budget, 2 << 30);
        assert!(peak <= budget && r["planned_host_bytes"].as_u64().unwrap() > r["host_kv_bytes"].as_u64().unwrap());
    }
    assert!(err_text(bench("lots")).contains("--host-budget: bad size \"lots\""));
    let huge = err_text(bench("18446744073709551615KiB"));
    assert!(huge.contains("more bytes than a size can hold"), "{huge}");
}

/// `--kv-on-disk`: a context larger than the host budget decodes on the file tier — its rows in
/// a file, read through a cache within the budget — and reports the disk's rate and each step's
/// disk bytes, cache hits and overlap with the step before (HiP searching every step over a
/// cache smaller than its search's reach); the file goes when the run ends. (HiP without dense
/// layers: on the CPU the "device" a dense layer is copied to is host memory too.)
#[test]
fn a_context_larger_than_the_host_budget_decodes_from_disk() {
    let shape = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/shapes/tiny.json");
    let dir = tempfile::tempdir().unwrap();
    let args = ["--host-budget", "200MiB", "bench", "--shape", shape.to_str().unwrap(), "--kv-dtype", "f32"];
    let methods = "streaming:1%,hip:1%:dense_layers=0:refresh=1";
    let rest = ["--context", "200000", "--method", methods, "--steps", "3", "--warmup", "1"];
    let out = folio(&[&args[..], &rest[..], &["--kv-on-disk", dir.path().to_str().unwrap(), "--json"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        let f = &r["file"];
        assert_eq!(r["kv_tier"], "file", "{r}");
        let cache = f["cache_bytes"].as_u64().unwrap();
        // 2 layers × 2 KV heads × 200,000 tokens × 32 f32 × K and V: 195.3 MiB, in a cache of less.
        let held = cache + f["keys_in_memory"].as_u64().unwrap();
        assert!(cache > 0 && held < 150 << 20 && r["host_kv_bytes"].as_u64() == Some(held), "{r}");
        assert!(r["peak_rss_bytes"].as_u64().unwrap() <= 200 << 20, "{r}");
        assert!(f["disk_bandwidth"].as_f64().unwrap() > 0.0, "{r}");
    }
    let hip = &rows[1]["file"];
    assert!(hip["disk_bytes_per_step"].as_f64().unwrap() > 0.0 && hip["disk_reads_per_step"].as_f64().unwrap() > 0.0);
    let (hits, overlap) = (hip["hit_rate"].as_f64().unwrap(), hip["step_overlap"].as_f64().unwrap());
    assert!(rows[0]["file"]["hit_rate"].is_null(), "streaming asks for no block a step: no rate");
    assert!(hits > 0.0 && hits < 1.0 && overlap > 0.5, "{hip}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the rows file is removed");
}

/// `--disk-gbps` and `--disk-iops`: the file tier's reads held to an emulated disk — the disk
/// rate the run measures is at most the rate asked for, a step's reads take at least their count
/// at the IOPS asked for, and the report names the disk emulated; one flag without the other, or
/// a rate of nothing, is refused.
#[test]
fn an_emulated_disk_paces_the_file_tier() {
    let shape = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/shapes/tiny.json");
    let dir = tempfile::tempdir().unwrap();
    let (rate, iops) = (0.2e9, 20_000.0);
    let disk = ["--disk-gbps", "0.2", "--disk-iops", "20000", "--host-budget", "200MiB"];
    let args = ["bench", "--shape", shape.to_str().unwrap(), "--kv-dtype", "f32", "--context", "200000"];
    let rest = ["--method", "hip:1%:dense_layers=0:refresh=1", "--steps", "3", "--warmup", "1", "--json"];
    let out = folio(&[&disk[..], &args[..], &rest[..], &["--kv-on-disk", dir.path().to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    let f = &r["file"];
    assert_eq!((f["emulated_disk"][0].as_f64(), f["emulated_disk"][1].as_f64()), (Some(rate), Some(iops)), "{r}");
    assert_eq!(f["direct"], false, "the emulated disk's medium is the page cache: {r}");
    let measured = f["disk_bandwidth"].as_f64().unwrap();
    assert!(measured <= rate * 1.01 && measured > rate / 4.0, "{measured} for {rate}: {r}");
    let (reads, ms) = (f["disk_reads_per_step"].as_f64().unwrap(), f["disk_read_ms_per_step"].as_f64().unwrap());
    assert!(reads > 0.0 && ms >= reads / iops * 1e3 * 0.99, "{reads} reads in {ms} ms: {r}");
    for (flags, says) in [
        (&["--disk-gbps", "5"][..], "--disk-iops"),
        (&["--disk-iops", "500000"][..], "--disk-gbps"),
        (
            &["--disk-gbps", "0", "--disk-iops", "1"][..],
            "--disk-gbps and --disk-iops must be at least 0.01 GB/s and 100 reads a second",
        ),
        (
            &["--disk-gbps=-1", "--disk-iops", "1000"][..],
            "--disk-gbps and --disk-iops must be at least 0.01 GB/s and 100 reads a second",
        ),
        (
            &["--disk-gbps", "5", "--disk-iops", "1e-300"][..],
            "--disk-gbps and --disk-iops must be at least 0.01 GB/s and 100 reads a second",
        ),
    ] {
        let err = err_text(folio(&[flags, &["bench", "link"][..]].concat()));
        assert!(err.contains(says), "{flags:?}: {err}");
    }
}

/// `--link-gbps` below the slowest rate it emulates is refused, and `bench link` measures a GPU's
/// link: on the CPU (no link) it says so rather than print rates of nothing.
#[test]
fn link_emulation_is_checked_up_front() {
    for rate in ["0", "0.01", "-3", "inf"] {
        let err = err_text(folio(&[&format!("--link-gbps={rate}"), "bench", "link"]));
        assert!(err.contains("--link-gbps must be a rate of at least 0.1 GB/s"), "{rate}: {err}");
    }
    let err = err_text(folio(&["--link-gbps", "25", "bench", "link"]));
    assert!(err.contains("bench link measures the host link of a GPU: run it with --device cuda"), "{err}");
}

/// `bench prefill --shape`: random weights of a shape, prefilled through the real builder
/// (every layer computed, a file written, the reopen timed), up to the shape's whole trained
/// length (its question after the reopen included); resumable into a kept folder; a model and
/// a shape at once are refused, and so, before any prefill, is a model's row with no room left
/// for the question.
#[test]
fn prefill_bench_runs_a_shape() {
    let shape = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/shapes/tiny.json");
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "bench",
        "prefill",
        "--shape",
        shape.to_str().unwrap(),
        "--tokens",
        "300,4096",
        "--kv-dtype",
        "fp8",
        "--dir",
        dir.path().to_str().unwrap(),
        "--resume",
        "--json",
    ];
    let out = folio(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["model"], "tiny (random weights)");
    let rows = doc["rows"].as_array().unwrap();
    // 4096: tiny.json's max_position_embeddings.
    assert_eq!(rows.iter().map(|r| r["tokens"].as_u64().unwrap()).collect::<Vec<_>>(), [300, 4096]);
    for r in rows {
        assert_eq!(r["layers_computed"], 2, "{r}");
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0 && r["file_bytes"].as_u64().unwrap() > 0, "{r}");
        // A shape's reopen is timed too (its first token is not read).
        assert!(
            r["reopen_first_token_seconds"].as_f64() > Some(0.0) && r["reopen_warm_seconds"].as_f64() > Some(0.0),
            "{r}"
        );
    }
    // The kept folder holds nothing once the runs finished (files are removed after use).
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    let mut both = args.to_vec();
    both.extend(["--model", "assets/models/demo"]);
    assert!(err_text(folio(&both)).contains("--shape and --model are two different models"));
    let missing = dir.path().join("missing");
    let mut nowhere = args.to_vec();
    nowhere[9] = missing.to_str().unwrap();
    let err = err_text(folio(&nowhere));
    assert!(err.contains("missing: no such folder"), "{err}");
    // The demo model's whole window (1,179,648 positions) leaves no room for the question (a
    // prefill of that length on the CPU would take hours: the refusal comes first).
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    let full = ["bench", "prefill", "--model", demo.to_str().unwrap(), "--tokens", "1179648"];
    let err = err_text(folio(&full));
    assert!(err.contains("--tokens 1179648 leaves no room for the 16-token question"), "{err}");
    assert!(err.contains("at most 1179632 tokens"), "{err}");
}

/// `bench kernels` on the CPU: every kernel's row (prefill attention, the MLP's parts and
/// whole, the decode rows at each selection, the label scan, top-k, the host gather, SimHash, a
/// quantized projection per type)
/// with a positive time and its share of a limit measured in the same run, the limit named.
#[test]
fn kernel_bench_reports_each_kernel_against_a_measured_limit() {
    let args = ["bench", "kernels", "--context", "4096", "--select", "64,512", "--json"];
    let out = folio(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    for limit in ["copy_bandwidth", "host_link", "f32_gemm_flops", "gemm_flops"] {
        assert!(doc[limit].as_f64().is_some_and(|x| x > 0.0 && x.is_finite()), "{limit}: {doc}");
    }
    let rows = doc["kernels"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
    for want in ["prefill attention", "MLP whole", "label_scores", "topk", "simhash_codes"] {
        assert_eq!(names.iter().filter(|n| n.starts_with(want)).count(), 1, "{want}: {names:?}");
    }
    // A decode step's quantized projection per type and shape (candle's CPU kernel), beside the plain one.
    for want in [
        "quantized matvec Q4_0",
        "quantized matvec Q8_0",
        "quantized matvec Q4_K",
        "quantized matvec Q5_K",
        "quantized matvec Q6_K",
        "matvec 512x",
    ] {
        assert_eq!(names.iter().filter(|n| n.starts_with(want)).count(), 2, "{want}: {names:?}");
    }
    // One decode row and one gather per selection.
    for kernel in ["decode_attention_rows 28 heads over", "gather 28x"] {
        for sel in ["64", "512"] {
            let hit = |n: &&&str| n.starts_with(kernel) && n[kernel.len()..].trim_start().starts_with(sel);
            assert_eq!(names.iter().filter(hit).count(), 1, "{kernel} {sel}: {names:?}");
        }
    }
    for r in rows {
        let share = r["of_limit"].as_f64().unwrap();
        assert!(r["seconds"].as_f64().unwrap() > 0.0 && share > 0.0 && share.is_finite(), "{r}");
        assert!(!r["limit"].as_str().unwrap().is_empty(), "{r}");
    }
    let err = err_text(folio(&["bench", "kernels", "--select", "0"]));
    assert!(err.contains("every --select at least 1"), "{err}");
}
