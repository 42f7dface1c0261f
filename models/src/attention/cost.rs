//! What one decode step of a method moves, from its settings and a model's shape: the input of
//! `folio bench --shape`'s floor.
//!
//! Each method states its own cost ([`super::MethodSpec::cost`]) in its module, next to the
//! code that does the moving; this module holds the shared vocabulary. Figures are bytes per
//! decode step (all layers), split by where they are read — device memory, the host link,
//! host memory by the CPU — because each has its own bandwidth and the paths can overlap: the
//! floor of a step is the largest of the three times, not their sum.

use super::Params;

/// The facts of a model's shape a step's cost depends on.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Shape {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Shape {
    pub fn of(cfg: &crate::config::ModelConfig) -> Self {
        Self { layers: cfg.num_layers, heads: cfg.num_heads, kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim }
    }
}

/// What a cost is computed for: a shape, a context length, the bytes of one K/V element as
/// moved (the compute dtype's), the budget in tokens at that length, and the method's knobs.
pub struct CostInput<'a> {
    pub shape: Shape,
    pub context: usize,
    pub elem: usize,
    pub budget: usize,
    pub params: &'a Params,
    /// Whether the saved rows are a context file's fp8 codes (MagicPIG splits its sample
    /// otherwise there).
    pub fp8_rows: bool,
}

impl CostInput<'_> {
    /// Bytes of the K and V rows of `n` positions for each of `per` heads in one layer.
    pub fn rows(&self, n: usize, per: usize) -> f64 {
        (n * per * 2 * self.shape.head_dim * self.elem) as f64
    }

    /// Bytes of the keys alone of `n` positions for each of `per` heads in one layer (a scan, a
    /// search).
    pub fn keys(&self, n: usize, per: usize) -> f64 {
        (n * per * self.shape.head_dim * self.elem) as f64
    }

    pub fn layers(&self) -> f64 {
        self.shape.layers as f64
    }
}

/// One decode step's traffic beyond the weights, and the device memory the method holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepCost {
    /// Read in device memory: an index (labels), layers kept resident.
    pub device_bytes: f64,
    /// Moved over the host link: picked rows; every row for dense; every key for a scan.
    pub link_bytes: f64,
    /// Read by the CPU in host memory (MagicPIG's sample).
    pub host_bytes: f64,
    /// Device memory the method keeps while decoding (labels, resident layers, gathers).
    pub resident_bytes: u64,
    /// Host memory the method keeps while decoding (MagicPIG's hash tables).
    pub host_state_bytes: u64,
    /// Of `host_state_bytes`, what the method keeps on disk beside the context file instead
    /// when the rows are read from it (the file tier): MagicPIG's bucket lists, but for the
    /// layer being built.
    pub host_state_on_disk: u64,
    /// What a step then reads of that state from the disk (a read of one or two 4 KiB pages).
    pub state_disk_bytes: f64,
    /// Bytes over the host link on the file tier, where the method reads otherwise there
    /// (MagicPIG's whole sample through the tier's cache, HiP's search by the GPU); `None`:
    /// `link_bytes`.
    pub file_link_bytes: Option<f64>,
    /// Bytes the CPU reads in host memory on the file tier, where that differs (HiP's search,
    /// by the GPU there); `None`: `host_bytes`.
    pub file_host_bytes: Option<f64>,
}

impl StepCost {
    /// The host memory the method keeps, with the rows on the file tier (`on_disk`) or not.
    pub fn host_state(&self, on_disk: bool) -> u64 {
        match on_disk {
            true => self.host_state_bytes.saturating_sub(self.host_state_on_disk),
            false => self.host_state_bytes,
        }
    }

    /// The bytes a step moves over the host link and reads in host memory, with the rows on the
    /// file tier (`on_disk`: where a method reads otherwise, [`Self::file_link_bytes`] and
    /// [`Self::file_host_bytes`]) or not.
    pub fn link_and_host(&self, on_disk: bool) -> (f64, f64) {
        match on_disk {
            true => (self.file_link_bytes.unwrap_or(self.link_bytes), self.file_host_bytes.unwrap_or(self.host_bytes)),
            false => (self.link_bytes, self.host_bytes),
        }
    }
}

/// Streaming: one set of `picked` positions per KV head, kept on the device and read there once
/// for its group; a step adds its own row, already on the device. (Under a model's sliding
/// window the sinks move and the set is gathered again every step: not counted here.)
pub fn per_kv_head(input: &CostInput<'_>, picked: usize) -> StepCost {
    let kept = input.layers() * input.rows(picked, input.shape.kv_heads);
    StepCost { device_bytes: kept, resident_bytes: kept as u64, ..StepCost::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::REGISTRY;

    /// Each method's cost at the Qwen2.5-7B shape, 1M tokens, budget 2048, bf16, written out
    /// from the formulas `bench --shape` used before the costs moved into the methods.
    #[test]
    fn costs_match_their_formulas() {
        let shape = Shape { layers: 28, heads: 28, kv_heads: 4, head_dim: 128 };
        let (context, elem, budget) = (1 << 20, 2, 2048);
        let (l, h, kv, d) = (28.0, 28.0, 4.0, 128.0);
        let row = d * elem as f64;
        let rows = |n: f64, per: f64| n * per * 2.0 * row;
        let n = context as f64;
        for spec in REGISTRY {
            let params = spec.params(&[]).unwrap();
            let p = |k: &str| params.get(k);
            let got = (spec.cost)(&CostInput { shape, context, elem, budget, params: &params, fp8_rows: false });
            let b = budget as f64;
            let (device, link, host) = match spec.name {
                "dense" => (0.0, l * rows(n, kv), 0.0),
                "streaming" => (l * rows(b, kv), 0.0, 0.0),
                "buzz" => (l * 1.5 * rows(b, kv), 0.0, 0.0),
                "topk" => (0.0, l * (n * kv * row + rows(b + p("window"), h)), 0.0),
                "topk-ivf" => {
                    let lists = if n > 900_000.0 { n.sqrt().ceil() } else { (n / 1000.0).ceil() };
                    let probed = (p("nprobe") * n / lists).ceil();
                    (0.0, l * ((lists + probed) * h * row + rows(b + p("window"), h)), 0.0)
                }
                "double-sparsity" => (l * kv * n * (d / 4.0 + 8.0), l * rows(b + p("window"), h), 0.0),
                "hip" => {
                    let dense = p("dense_layers");
                    let picked = b + p("sinks") + p("window");
                    let blocks_n = (b / p("block")).ceil();
                    let rounds = ((n / p("block")).ceil() / blocks_n).log2().ceil();
                    let search = rounds * 2.0 * blocks_n * p("block") * h * row;
                    let sparse = l - dense;
                    (
                        dense * rows(n, kv) + sparse * rows(picked, h),
                        sparse * (rows(picked, h) + search) / p("refresh"),
                        0.0,
                    )
                }
                "magicpig" => {
                    let dense = 2.0 * p("dense_layers");
                    let picked = p("sinks") + p("window");
                    let sparse = l - dense;
                    // The default split: the GPU walks every query head's tables (2 bytes an
                    // entry, 2^-K of the indexed keys a table) and attends the gpu_attend share
                    // of the heads' samples over the link; the CPU reads the rest in host memory.
                    let indexed = n - picked;
                    let (bits, tables) = crate::attention::magicpig::tables_for(b / indexed, p("bits") as usize);
                    let walked = sparse * h * tables as f64 * (indexed / 2f64.powi(bits as i32)).floor() * 2.0;
                    let on_gpu = (h * p("gpu_attend")).round();
                    let link = dense * rows(n, kv) + sparse * rows(picked, h) + walked + sparse * rows(b, on_gpu);
                    (0.0, link, sparse * rows(b, h - on_gpu))
                }
                other => panic!("no formula for {other}"),
            };
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
            assert!(close(got.device_bytes, device), "{}: device {} vs {device}", spec.name, got.device_bytes);
            assert!(close(got.link_bytes, link), "{}: link {} vs {link}", spec.name, got.link_bytes);
            assert!(close(got.host_bytes, host), "{}: host {} vs {host}", spec.name, got.host_bytes);
        }
    }
}
