//! The library's side of a prefill, the same for `folio prefill` and the window's jobs: the
//! context is listed as soon as its prefill has a checkpoint (so a kill shows it paused), the
//! measured cost is kept (the next estimate's prediction and ETA), and when it ends the library
//! follows the disk — the finished file, the paused prefill, or nothing for a new context that
//! never got a checkpoint. The library is a convenience here: one that cannot be written costs
//! a warning, never the prefill.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;

use folio_library::Library;
use folio_models::context::{Bookkeeping, BuildReport, PrefillCost, DENSE_PREFILL};
use folio_models::prefill::PrefillMode;
use folio_models::Engine;

/// A library call run to its end from the prefill's (blocking) thread.
pub(crate) type Block = Box<
    dyn for<'f> Fn(Pin<Box<dyn Future<Output = folio_library::Result<()>> + Send + 'f>>) -> folio_library::Result<()>,
>;

/// The settings keys of what the last prefill of a model on a device measured (written by
/// every prefill, read by the next estimate): the cost fitted to its chunks, one per kind of
/// prefill (a sparse one's time is not a dense one's), and a dense one's rate — what earlier
/// Folio versions kept and read, still written for them and read when no cost is.
#[derive(Clone)]
pub(crate) struct PrefillKeys {
    cost: String,
    rate: String,
    layers: usize,
}

impl PrefillKeys {
    pub(crate) fn new(engine: &Engine, device: &str) -> Self {
        Self {
            cost: format!("prefill_cost/{}/{device}", engine.source),
            rate: format!("prefill_rate/{}/{device}", engine.source),
            layers: engine.config().num_layers,
        }
    }

    /// Where the cost of a `prefill` (`dense`, `sparse:KNOBS`) is kept: a dense one's where
    /// earlier Folios kept it, each sparse one's beside it.
    fn cost_key(&self, prefill: &str) -> String {
        match prefill == DENSE_PREFILL {
            true => self.cost.clone(),
            false => format!("{}/{prefill}", self.cost),
        }
    }

    /// The last cost of a prefill like `mode`, else (dense) one from an earlier Folio's rate;
    /// `None` before any.
    pub(crate) async fn read(&self, lib: &Library, mode: PrefillMode) -> folio_library::Result<Option<PrefillCost>> {
        let key = self.cost_key(&mode.name());
        if let Some(cost) = lib.setting(&key).await?.and_then(|v| serde_json::from_value(v).ok()) {
            return Ok(Some(cost));
        }
        if mode != PrefillMode::Dense {
            return Ok(None);
        }
        let rate = lib.setting(&self.rate).await?.and_then(|v| v.as_f64());
        Ok(rate.and_then(|r| PrefillCost::from_rate(r, self.layers)))
    }

    /// Each of `modes` with its last cost here (the staging sheet's choices).
    pub(crate) async fn read_all(
        &self,
        lib: &Library,
        modes: Vec<PrefillMode>,
    ) -> folio_library::Result<Vec<(PrefillMode, Option<PrefillCost>)>> {
        let mut choices = Vec::with_capacity(modes.len());
        for mode in modes {
            choices.push((mode, self.read(lib, mode).await?));
        }
        Ok(choices)
    }
}

/// [`Bookkeeping`] over the library.
pub(crate) struct Listing {
    lib: Library,
    block: Block,
    /// Where the measured cost is kept (`None`: a refresh only, nothing measured).
    keys: Option<PrefillKeys>,
    /// The prefill changes a saved file (an addition, a removal or the resume of one): its
    /// context is never forgotten here, a missing file is the library's `missing` status.
    changes_a_file: bool,
}

impl Listing {
    pub(crate) fn new(lib: Library, block: Block, keys: Option<PrefillKeys>, changes_a_file: bool) -> Self {
        Self { lib, block, keys, changes_a_file }
    }

    fn run<'f>(&self, what: &str, out: &Path, fut: impl Future<Output = folio_library::Result<()>> + Send + 'f) {
        if let Err(e) = (self.block)(Box::pin(fut)) {
            eprintln!(
                "folio: the library was not updated ({what} {}: {e}); `folio library rebuild` lists the context again",
                out.display()
            );
        }
    }

    /// The library follows the disk: the finished file, the paused prefill, or nothing (a new
    /// context that never got a checkpoint is forgotten).
    pub(crate) fn refresh(&self, out: &Path) {
        let (lib, changes_a_file) = (&self.lib, self.changes_a_file);
        self.run("refreshing", out, async move {
            if changes_a_file || !lib.forget_if_gone(out).await? {
                lib.add_context(out).await?;
            }
            Ok(())
        });
    }
}

impl Bookkeeping for Listing {
    fn started(&mut self, out: &Path) {
        self.run("listing", out, async { self.lib.add_context(out).await.map(drop) });
    }

    /// A prefill's fitted cost becomes the next estimates' of its kind (a sparse one's would
    /// make every later dense estimate several times too short); a dense one's rate too.
    fn finished(&mut self, out: &Path, report: Option<&BuildReport>) {
        if let (Some(r), Some(keys)) = (report, &self.keys) {
            if r.prefill == DENSE_PREFILL {
                let rate = serde_json::json!(r.tokens_per_s);
                self.run("the rate of", out, self.lib.set_setting(&keys.rate, &rate));
            }
            if let Some(cost) = r.cost.and_then(|c| serde_json::to_value(c).ok()) {
                self.run("the cost of", out, self.lib.set_setting(&keys.cost_key(&r.prefill), &cost));
            }
        }
        self.refresh(out);
    }
}
