//! Building and changing contexts at the engine's level: a context grown by a document, or cut
//! before one and continued, is the one prefilled in one go; a resume takes only the very same
//! tokens; the hidden states between layers give the same file wherever they live, and a
//! prefill interrupted with them in one place resumes with them in another.

use std::ops::ControlFlow;

use folio_models::context::{self, BuildOptions, HiddenPlace, KvDtype};
use folio_models::Result;
use rand::{rngs::StdRng, Rng, SeedableRng};

// The kernels' shared test helpers (a replayable seed).
#[path = "../../kernels/tests/common/mod.rs"]
mod common;
mod support;
use support::{build, engine, plan, sample_documents, smallest_budget};

/// A context grown by a document is the context prefilled with all the documents in one go:
/// the same tokens and spans, and (f32 on the CPU) byte for byte the same file, K/V and
/// checksums included; the append computes only the new document's tokens.
#[test]
fn a_grown_context_is_the_one_prefilled_in_one_go() -> Result<()> {
    let e = engine("demo");
    let docs = sample_documents();
    let dir = tempfile::tempdir().unwrap();
    let date = || Some("25 Nov 2026".to_owned());
    let (whole, grown) = (dir.path().join("whole.folio"), dir.path().join("grown.folio"));
    let all = e.plan_context(&docs, None, date())?;
    let whole_report = build(&e, &all, &whole, KvDtype::F32, None);
    build(&e, &e.plan_context(&docs[..2], None, date())?, &grown, KvDtype::F32, None);

    let base = context::ContextFile::open(&grown)?;
    let plan = e.plan_append(&base, &docs[2..])?;
    assert_eq!((&plan.tokens, &plan.documents), (&all.tokens, &all.documents));
    let err = e.plan_append(&base, &docs[1..2]).unwrap_err();
    assert!(err.to_string().contains("already in this context"), "{err}");
    let opts = BuildOptions::new(KvDtype::F32);
    let wrong = BuildOptions { kv_dtype: KvDtype::Bf16, ..opts.clone() };
    let err = context::append(&e.model, e.stamp()?, &base, &plan, &grown, &wrong, &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(err.to_string().contains("--kv-dtype f32"), "{err}");
    let report =
        context::append(&e.model, e.stamp()?, &base, &plan, &grown, &opts, &mut |_| ControlFlow::Continue(()))?;
    assert_eq!(report.computed_tokens, all.tokens.len() - base.tokens().len());
    assert_eq!((report.tokens, report.next_token), (whole_report.tokens, whole_report.next_token));
    drop(base);
    assert!(
        std::fs::read(&whole).unwrap() == std::fs::read(&grown).unwrap(),
        "the grown file differs from the one prefilled in one go"
    );
    Ok(())
}

/// An interrupted prefill resumes only with the very same tokens: other tokens of the same
/// length (same header sizes) are refused, not mixed with the finished layers.
#[test]
fn a_resume_with_other_tokens_of_the_same_length_is_refused() -> Result<()> {
    let e = engine("demo");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.folio");
    let vocab = e.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(7);
    let mut tokens = |_: ()| -> Vec<u32> { (0..300).map(|_| rng.random_range(0..vocab)).collect() };
    let (first, second) = (plan(tokens(())), plan(tokens(())));
    let opts = BuildOptions::new(KvDtype::F32);
    let mut stop =
        |p: &context::Progress| if p.layer >= 1 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) };
    assert!(context::build(&e.model, e.stamp()?, &first, &out, &opts, &mut stop).is_err());
    let err = context::build(&e.model, e.stamp()?, &second, &out, &opts, &mut |_| ControlFlow::Continue(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not match") && err.contains("300 tokens then, 300 now"), "{err}");
    // The original resumes.
    context::build(&e.model, e.stamp()?, &first, &out, &opts, &mut |_| ControlFlow::Continue(()))?;
    Ok(())
}

/// The hidden states between layers on the device, in RAM or in files give the same file byte
/// for byte; a prefill cancelled with its hidden states in one place resumes with them in
/// another (the checkpoint names which hidden file holds them), from the last finished layer.
#[test]
fn hidden_states_anywhere_give_the_same_file_and_resume_across_places() -> Result<()> {
    let e = engine("demo");
    let dir = tempfile::tempdir().unwrap();
    let vocab = e.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(common::seed());
    let tokens = plan((0..400).map(|_| rng.random_range(0..vocab)).collect());
    let budget = smallest_budget(&e, 400, KvDtype::Bf16);
    let opts = |place| BuildOptions {
        memory_budget: Some(budget),
        hidden_in: Some(place),
        ..BuildOptions::new(KvDtype::Bf16)
    };
    let go = &mut |_: &context::Progress| ControlFlow::Continue(());
    let mut files = Vec::new();
    for place in [HiddenPlace::Files, HiddenPlace::Ram, HiddenPlace::Device] {
        let out = dir.path().join(format!("{place:?}.folio"));
        let report = context::build(&e.model, e.stamp()?, &tokens, &out, &opts(place), go)?;
        assert_eq!(report.hidden_in, place);
        assert!(report.chunk < 100, "several chunks: {}", report.chunk);
        files.push(std::fs::read(&out).unwrap());
    }
    assert!(files.iter().all(|f| *f == files[0]), "the hidden states' place changed the file");

    let layers = e.config().num_layers;
    for (first, then, stop_in) in [
        (HiddenPlace::Ram, HiddenPlace::Files, 2),
        (HiddenPlace::Files, HiddenPlace::Device, 3),
        (HiddenPlace::Device, HiddenPlace::Ram, 1),
    ] {
        let out = dir.path().join(format!("{first:?}-then-{then:?}.folio"));
        let mut stop = |p: &context::Progress| {
            if p.layer >= stop_in && p.layer_tokens > 0 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let err = context::build(&e.model, e.stamp()?, &tokens, &out, &opts(first), &mut stop).unwrap_err();
        assert!(err.to_string().contains("cancelled"), "{err}");
        let report = context::build(&e.model, e.stamp()?, &tokens, &out, &opts(then), go)?;
        assert_eq!(report.resumed_layers, stop_in.min(layers), "{first:?} then {then:?}");
        assert!(std::fs::read(&out).unwrap() == files[0], "{first:?} then {then:?}: the resumed file differs");
    }
    Ok(())
}

/// Taking a document out keeps the tokens before it as saved and prefills the ones after it
/// again: the result is the context prefilled without that document in one go (f32, byte for
/// byte).
#[test]
fn a_context_cut_before_a_document_and_continued_is_the_one_without_it() -> Result<()> {
    let e = engine("demo");
    let docs = sample_documents();
    let dir = tempfile::tempdir().unwrap();
    let date = || Some("25 Nov 2026".to_owned());
    let (all, without) = (dir.path().join("all.folio"), dir.path().join("without.folio"));
    build(&e, &e.plan_context(&docs, None, date())?, &all, KvDtype::F32, None);
    let kept = [docs[0].clone(), docs[2].clone()];
    build(&e, &e.plan_context(&kept, None, date())?, &without, KvDtype::F32, None);
    let base = context::ContextFile::open(&all)?;
    let plan = e.plan_keeping(&base, 1, &docs[2..])?;
    let keep = base.tokens_before(1);
    let opts = BuildOptions::new(KvDtype::F32);
    let cut = dir.path().join("cut.folio");
    let report =
        context::extend(&e.model, e.stamp()?, context::Base { file: &base, keep }, &plan, &cut, &opts, &mut |_| {
            ControlFlow::Continue(())
        })?;
    assert_eq!(report.computed_tokens, plan.tokens.len() - keep);
    assert!(std::fs::read(&cut).unwrap() == std::fs::read(&without).unwrap(), "cut and continued != prefilled without");
    Ok(())
}
