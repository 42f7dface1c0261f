//! The library's side of a prefill, the same for `folio prefill` and the window's jobs: the
//! context is listed as soon as its prefill has a checkpoint (so a kill shows it paused), the
//! measured rate is kept (the next estimate's prediction), and when it ends the library
//! follows the disk — the finished file, the paused prefill, or nothing for a new context that
//! never got a checkpoint. The library is a convenience here: one that cannot be written costs
//! a warning, never the prefill.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;

use folio_library::Library;
use folio_models::context::{Bookkeeping, BuildReport};
use folio_models::Engine;

/// A library call run to its end from the prefill's (blocking) thread.
pub(crate) type Block = Box<
    dyn for<'f> Fn(Pin<Box<dyn Future<Output = folio_library::Result<()>> + Send + 'f>>) -> folio_library::Result<()>,
>;

/// The settings key of the last measured prefill rate of a model on a device (written by
/// every prefill, read by the next estimate).
pub(crate) fn rate_key(engine: &Engine, device: &str) -> String {
    format!("prefill_rate/{}/{device}", engine.source)
}

/// [`Bookkeeping`] over the library.
pub(crate) struct Listing {
    lib: Library,
    block: Block,
    rate_key: String,
    /// The prefill changes a saved file (an addition, a removal or the resume of one): its
    /// context is never forgotten here, a missing file is the library's `missing` status.
    changes_a_file: bool,
}

impl Listing {
    pub(crate) fn new(lib: Library, block: Block, rate_key: String, changes_a_file: bool) -> Self {
        Self { lib, block, rate_key, changes_a_file }
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

    fn finished(&mut self, out: &Path, report: Option<&BuildReport>) {
        if let Some(r) = report {
            let rate = serde_json::json!(r.tokens_per_s);
            self.run("the rate of", out, self.lib.set_setting(&self.rate_key, &rate));
        }
        self.refresh(out);
    }
}
