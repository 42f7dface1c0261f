//! What a decode run (`folio bench --shape`) plans to use before it allocates anything —
//! device memory against the VRAM budget, host memory against the host budget — refused with
//! each part when a budget cannot hold it.

use folio_models::config::ModelConfig;
use folio_models::error::{human_bytes, Error, Result};
use folio_runtime::device::MemorySampler;
use folio_runtime::host_budget;

use super::WORKSPACE_BYTES;

/// The device memory the run plans to use (what is in use already, weights, the largest
/// index, the conversation's K/V `tail`, a layer's scores, a workspace) and the budget it is
/// held to (`vram_budget`, else the device's memory); a plan over the budget is refused
/// before anything is allocated.
pub(super) fn plan_memory(
    sampler: &MemorySampler,
    cfg: &ModelConfig,
    weights: u64,
    index: u64,
    tail: u64,
    context: usize,
    vram_budget: Option<u64>,
) -> Result<(u64, Option<u64>)> {
    let (baseline, total_device) = match sampler.now()? {
        Some((used, total)) => (used, Some(total)),
        None => (0, None),
    };
    let scores = (cfg.num_heads * context * 4 * 2) as u64;
    let planned = baseline + weights + index + tail + scores + WORKSPACE_BYTES;
    let budget = vram_budget.or(total_device);
    if let Some(b) = budget.filter(|&b| planned > b) {
        return Err(Error::Invalid(format!(
            "this run needs about {} of device memory, more than the {} budget: weights {}, index {}, \
             conversation K/V {}, scores {}, workspace {}, already in use {}",
            human_bytes(planned),
            human_bytes(b),
            human_bytes(weights),
            human_bytes(index),
            human_bytes(tail),
            human_bytes(scores),
            human_bytes(WORKSPACE_BYTES),
            human_bytes(baseline)
        )));
    }
    Ok((planned, budget))
}

/// The host memory the run plans to use — the K/V in host memory, the largest method state
/// (MagicPIG's tables), the embedding table, the process as it is — held to the host budget
/// (`--host-budget`, else the default); over it, refused before anything is allocated.
pub(super) fn plan_host(kv: u64, state: u64, table: u64) -> Result<u64> {
    let process = folio_runtime::host_memory::rss().unwrap_or(0);
    let planned = kv + state + table + process;
    if let Some(b) = host_budget::budget().filter(|&b| planned > b) {
        return Err(Error::Invalid(format!(
            "this run needs about {} of host memory, more than the {}{} host budget: K/V {}, method state {}, \
             embedding table {}, the process {}; raise --host-budget or store the K/V in fp8 (--kv-dtype fp8)",
            human_bytes(planned),
            if host_budget::is_set() { "" } else { "default " },
            human_bytes(b),
            human_bytes(kv),
            human_bytes(state),
            human_bytes(table),
            human_bytes(process)
        )));
    }
    Ok(planned)
}
