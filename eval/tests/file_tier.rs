//! `folio eval needle --kv-on-disk`: each prompt's documents prefilled into a context file and
//! opened as the app opens one. On the file tier (`--kv-cache`: the rows read from the file
//! through a cache, bytes from disk reported per sample) every method answers as it does over
//! the same file read in place from host memory. (The host budget's own choice of the file tier
//! is the engine's test, models/tests/host_budget.rs.)

use std::path::Path;

use candle_core::{DType, Device};
use folio_eval::needle::{self, PromptTier};
use folio_eval::spec::EvalSpec;
use folio_models::attention::{self, Attention, Resources};
use folio_models::prefill::PrefillMode;
use folio_models::Engine;

#[test]
fn the_needle_eval_answers_from_the_file_tier_as_from_host_memory() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    let engine = Engine::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32).unwrap();
    let spec = EvalSpec::load(&dir).unwrap();
    let none = Resources::default();
    // Every method that reads rows on the offloaded tier and needs no calibration but MagicPIG,
    // whose file-tier decode (its CPU reference: K and V are not both in host memory) is held to
    // its reference in the engine's tests.
    let methods = [
        ("dense", None),
        ("hip", Some("256")),
        ("topk", Some("128")),
        ("buzz", Some("50%")),
        ("streaming", Some("256")),
    ];
    let attns: Vec<_> = methods.iter().map(|(m, b)| attention::by_name(m, *b, &[], &none).unwrap()).collect();
    let attns: Vec<&dyn Attention> = attns.iter().map(|a| a.as_ref()).collect();
    let folder = tempfile::tempdir().unwrap();
    let cell = (4096, 0.5, 0);
    let prompt = needle::cell_prompt(&engine, &spec, cell, 5).unwrap();
    // Read in place from host memory (the default budget has room for the file's 4 MiB of rows):
    // nothing read from disk.
    let in_memory = PromptTier::OnDisk(folder.path().to_owned(), None);
    let in_memory = needle::run_sample(&engine, &prompt, &attns, (&in_memory, PrefillMode::Dense), cell).unwrap();
    assert!(in_memory.iter().all(|s| s.disk_bytes.is_none()));
    // On the file tier through a cache of 1 MiB: most rows come from the file, the same answers.
    let on_file = PromptTier::OnDisk(folder.path().to_owned(), Some(1 << 20));
    let from_file = needle::run_sample(&engine, &prompt, &attns, (&on_file, PrefillMode::Dense), cell).unwrap();
    for (((method, _), m), f) in methods.iter().zip(&in_memory).zip(&from_file) {
        println!("{method}: in memory {:?}, from the file {:?} ({:?} bytes read)", m.output, f.output, f.disk_bytes);
        assert_eq!(m.output, f.output, "{method}");
        assert!(f.disk_bytes.is_some_and(|b| b > 0), "{method} read from the file");
    }
    assert_eq!(std::fs::read_dir(folder.path()).unwrap().count(), 0, "the prompt's file is removed");
}
