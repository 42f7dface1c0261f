//! Storing a method's index in a saved context file (MagicPIG's tables, IVF lists, Double
//! Sparsity's labels), so a reopened context reads it instead of building it on its first
//! answer: what `folio context index` and the window's "Build index" run.
//!
//! The index is built layer by layer from the saved K/V (each layer decoded as a session
//! would) and written with every other section into a new file that replaces the old one
//! atomically: an interrupted build leaves the file as it was.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use super::Engine;
use crate::attention::MethodChoice;
use crate::context::{ContextFile, Header};
use crate::error::{Error, Result};
use crate::kv_cache::ContextKv;

/// Device memory for the decoded layer an index is built from (one layer at a time).
const BUILD_BUDGET: u64 = 1;

/// What a stored index took.
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct StoredIndex {
    /// The method's full settings the index was built with.
    pub settings: serde_json::Value,
    pub sections: usize,
    pub index_bytes: u64,
    /// The file's header after the write.
    #[cfg_attr(feature = "ts", ts(type = "unknown"))]
    pub header: Header,
}

impl Engine {
    /// Builds `choice`'s index over the context at `path` and stores it in the file (sections
    /// of the same name and layer replaced). `on_layer(done, layers)` follows the build;
    /// `Break` stops it with an error and the file unchanged. Refused for a method that keeps
    /// no index at these settings.
    pub fn store_index(
        &self,
        path: &Path,
        choice: &MethodChoice,
        mut on_layer: impl FnMut(usize, usize) -> ControlFlow<()>,
    ) -> Result<StoredIndex> {
        let file = Arc::new(ContextFile::open(path)?);
        self.check_context_to_change(&file)?;
        let attn = choice.build(&self.resources(std::slice::from_ref(choice))?)?;
        let kv = ContextKv::new(file.clone(), self.model.dtype(), self.model.device(), BUILD_BUDGET);
        let layers = file.header().layers;
        let mut sections = Vec::new();
        for layer in 0..layers {
            if let Some((name, bytes)) = attn.index_section(&kv, layer, layers)? {
                sections.push((name, layer, bytes));
            }
            if on_layer(layer + 1, layers).is_break() {
                return Err(Error::Invalid("the index build was stopped; the file is as it was".into()));
            }
        }
        if sections.is_empty() {
            return Err(Error::Invalid(format!(
                "{} keeps no index at these settings (dense, streaming, top-k, HiP and BUZZ search the keys \
                 directly; a budget covering the context needs none)",
                choice.method
            )));
        }
        let index_bytes = sections.iter().map(|s| s.2.len() as u64).sum();
        let count = sections.len();
        let header = file.write_with_indexes(path, sections)?;
        Ok(StoredIndex { settings: attn.settings(), sections: count, index_bytes, header })
    }
}
