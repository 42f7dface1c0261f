//! The process's host budget (`--host-budget`) holds the engine's large host allocations: the
//! offloaded K/V (rows of its own, a stored layout, a context file read in place) is refused
//! before it is allocated when the budget cannot hold it beside the rest of the process, with
//! what is in use and what to change; what is granted goes back when the store goes.
//!
//! A binary of its own: the budget is the process's, and the other tests' stores must not see
//! the small budgets set here.

mod support;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use folio_models::context::{ContextFile, KvDtype};
use folio_models::kv_cache::OffloadKv;
use folio_runtime::host_budget;
use support::{build, engine, plan};

const MIB: u64 = 1 << 20;

/// The budget is the process's: the tests here take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn the_host_budget_refuses_what_it_cannot_hold_and_gets_back_what_goes() {
    let _alone = alone();
    let cpu = Device::Cpu;
    let rss = folio_runtime::host_memory::rss().unwrap_or(0);
    host_budget::set_budget(Some(rss + 256 * MIB));
    let start = host_budget::held();

    // 2 layers × K and V × 2 heads × 1M rows × 32 f32: 1 GiB, refused, nothing allocated.
    let err = OffloadKv::new(2, 2, 32, 1 << 20, DType::F32, &cpu).err().expect("1 GiB in a 256 MiB budget").to_string();
    assert!(err.starts_with("the offloaded K/V needs 1.00 GiB of host memory, and the host budget of"), "{err}");
    assert!(err.contains("--host-budget") && err.contains("fp8"), "{err}");
    assert_eq!(host_budget::held(), start);
    // Stored as an fp8 file stores it: half a GiB and the scales, refused before a row is made.
    let rows = |_: usize, _: usize, _: usize| -> folio_models::Result<(Tensor, Tensor)> { panic!("never asked for") };
    let err = OffloadKv::stored((2, 2, 1 << 21, 32), KvDtype::Fp8, DType::F32, &cpu, rows).err().unwrap().to_string();
    assert!(err.starts_with("the offloaded K/V needs 0.5"), "{err}");

    // What fits is held while the store lives, and given back when it goes.
    let kv = OffloadKv::new(2, 2, 32, 4096, DType::F32, &cpu).unwrap();
    assert_eq!(host_budget::held(), start + kv.host_bytes());
    drop(kv);
    assert_eq!(host_budget::held(), start);

    // A context file read in place: its whole mapping is held.
    let e = engine("demo");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.folio");
    build(&e, &plan((0..600).map(|i| 3 + i % 200).collect()), &out, KvDtype::Bf16, None);
    let file = Arc::new(ContextFile::open(&out).unwrap());
    let bytes = std::fs::metadata(&out).unwrap().len();
    let kv = OffloadKv::from_context(file.clone(), DType::F32, &cpu).unwrap();
    assert_eq!(host_budget::held(), start + bytes);
    drop(kv);
    let now = folio_runtime::host_memory::rss().unwrap_or(0);
    host_budget::set_budget(Some(now + bytes / 2));
    let err = OffloadKv::from_context(file.clone(), DType::F32, &cpu).err().unwrap().to_string();
    assert!(err.contains("c.folio (read in place) needs") && err.contains("host budget"), "{err}");
    // On a GPU too: refused by the budget, the file is not copied instead (a copy takes more).
    #[cfg(feature = "cuda")]
    {
        let gpu = Device::new_cuda(0).unwrap();
        let err = OffloadKv::from_context(file.clone(), DType::BF16, &gpu).err().unwrap().to_string();
        assert!(err.contains("c.folio (read in place) needs") && err.contains("host budget"), "{err}");
    }
    assert_eq!(host_budget::held(), start);
    // Opened twice (a session reopened while the old one lives), a file is held once.
    host_budget::set_budget(None);
    let again = Arc::new(ContextFile::open(&out).unwrap());
    let (a, b) = (
        OffloadKv::from_context(file, DType::F32, &cpu).unwrap(),
        OffloadKv::from_context(again, DType::F32, &cpu).unwrap(),
    );
    assert_eq!(host_budget::held(), start + bytes);
    drop((a, b));
    assert_eq!(host_budget::held(), start);
}

/// A context whose K/V the host budget cannot hold stays in its file: a session opens it on the
/// file tier, with a cache of the budget's room held while it lives, and every row-reading
/// method gives the tokens it gives with the rows in host memory (greedy, same question) —
/// MagicPIG with its bucket lists on disk beside the file, in a budget with room for its
/// build (Double Sparsity, which needs a calibration, is held to its reference on the file
/// tier in tests/context.rs).
#[test]
fn a_context_larger_than_the_host_budget_answers_from_its_file() {
    let _alone = alone();
    use folio_models::attention::{MethodChoice, Tier};
    use folio_models::session::{GenerationSettings, Session};
    let e = Arc::new(engine("demo"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("big.folio");
    // 6,000 tokens of f32 K/V: 12 MiB of rows.
    build(&e, &plan((0..6000).map(|i| 3 + (i * 7919) % 500).collect()), &out, KvDtype::F32, None);
    let file = Arc::new(ContextFile::open(&out).unwrap());
    let kv_bytes = std::fs::metadata(&out).unwrap().len();
    let settings = GenerationSettings { max_tokens: 12, temperature: Some(0.0), ..GenerationSettings::default() };
    let answers = |session: &mut Session, methods: &[&str]| -> Vec<Vec<u32>> {
        methods
            .iter()
            .map(|m| {
                let mut conv = session.new_conversation();
                let method = MethodChoice::parse(m).unwrap();
                session
                    .ask(&mut conv, "what is the pass key ?", &method, &settings, |_| {
                        std::ops::ControlFlow::Continue(())
                    })
                    .unwrap()
                    .tokens
            })
            .collect()
    };
    let (rows, tables) =
        (["dense", "streaming:10%", "buzz:30%", "hip:10%", "topk:5%"], ["magicpig:10%:bits=4:tables=8"]);
    host_budget::set_budget(None);
    let mut host = Session::over(e.clone(), file.clone(), Tier::Offloaded).unwrap();
    let (want, want_tables) = (answers(&mut host, &rows), answers(&mut host, &tables));
    drop(host);

    let start = host_budget::held();
    let now = folio_runtime::host_memory::rss().unwrap_or(0);
    host_budget::set_budget(Some(now + kv_bytes / 2));
    let kv = OffloadKv::from_context(file.clone(), DType::F32, &Device::Cpu).unwrap();
    let stats = kv.file_stats().expect("a file larger than the budget stays on disk");
    assert!(stats.cache_bytes < kv_bytes / 2, "{stats:?}");
    assert_eq!(host_budget::held(), start + stats.cache_bytes);
    drop(kv);
    assert_eq!(host_budget::held(), start);
    let mut on_file = Session::over(e.clone(), file.clone(), Tier::Offloaded).unwrap();
    assert_eq!(answers(&mut on_file, &rows), want, "the file tier answers as the host tier");
    drop(on_file);
    // MagicPIG's build holds the keys and their codes for a while: a quarter of the rows more
    // (beside what the process holds now, after the other methods' steps).
    let now = folio_runtime::host_memory::rss().unwrap_or(0);
    host_budget::set_budget(Some(now + kv_bytes / 2 + kv_bytes / 4));
    let mut on_file = Session::over(e.clone(), file, Tier::Offloaded).unwrap();
    let (spilled, _) = folio_models::kv_cache::spill_reads();
    assert_eq!(answers(&mut on_file, &tables), want_tables, "magicpig answers from the file as from memory");
    assert!(folio_models::kv_cache::spill_reads().0 > spilled, "its bucket lists were read from disk");
    drop(on_file);
    host_budget::set_budget(None);
    assert_eq!(host_budget::held(), start);
}
