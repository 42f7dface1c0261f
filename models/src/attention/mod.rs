//! The attention seam: the decoder hands each layer's queries to an [`Attention`] method,
//! which reads what it chooses from the [`KvStore`] and returns the layer's attention output.
//!
//! The decoder knows nothing about which rows a method reads; sparse methods and offloaded
//! tiers plug in here without touching the model code (mistral.rs's pluggable attention is the
//! model). A method is built by [`by_name`] from a name, a user-facing *budget* (tokens, or a
//! fraction of the context) and `key=value` knobs, each validated against the method's
//! [`ParamSpec`] table (the papers' defaults and ranges), so every bad value is refused with
//! the valid ones listed.
//!
//! Sparse methods act on decode steps (one query token); a multi-token call (the question
//! appended to a context) is dense, as the papers prefill their prompts densely — except
//! BUZZ, whose cache is what it kept, for every later call of the conversation.
//!
//! A method reports what it read ([`Attended`]): the quality harness turns that into recall of
//! the true top keys and the fraction of the KV cache touched, so cost is measured, never
//! assumed from the budget.
//!
//! Indexes (MagicPIG's hash tables, Double Sparsity's label cache, the IVF lists) cover the
//! saved context; the first time a layer decodes they are loaded from the context file's index
//! sections (`folio context index`) or built from the stored keys, and kept until
//! [`Attention::reset`].
//! Keys after the indexed prefix (the question and the answer so far) are attended densely by
//! MagicPIG and HiP, as their papers keep generated tokens dense; top-k, IVF and Double
//! Sparsity score them exactly and let them compete for the budget.

mod buzz;
mod dense;
mod double_sparsity;
mod hip;
mod ivf;
mod magicpig;
pub mod probe;
mod select;
mod streaming;
mod topk;
pub mod workload;

pub use buzz::Buzz;
pub use dense::Dense;
pub use double_sparsity::{Channels, DoubleSparsity};
pub use hip::Hip;
pub use ivf::TopKIvf;
pub use magicpig::MagicPig;
pub use select::IndexSource;
pub use streaming::Streaming;
pub use topk::TopK;

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::kv::KvStore;

/// One layer's attention call.
pub struct AttnCall<'a> {
    /// The model layer, of `layers`.
    pub layer: usize,
    pub layers: usize,
    /// Where that layer's rows are in `kv`: the same index, except in layer-major prefill,
    /// whose store holds one layer at a time.
    pub kv_layer: usize,
    /// Post-RoPE queries `[q_heads, t, head_dim]` for positions `q_start..q_start + t`.
    pub q: &'a Tensor,
    pub q_start: usize,
    /// The store holds this layer's rows for positions `0..q_start + t`.
    pub kv: &'a dyn KvStore,
    pub scale: f32,
    /// Sliding window (Mistral), counted with the query's own token.
    pub window: Option<usize>,
}

/// What one call computed and what it read.
pub struct Attended {
    /// `[q_heads, t, head_dim]` in the dtype of the call's queries.
    pub out: Tensor,
    /// Per query head, the sorted key positions whose K and V rows the attention read;
    /// `None` when it read every visible key (dense).
    pub read: Option<Vec<Vec<usize>>>,
    /// Key rows the search touched per query head to make that choice (bucket walks, label
    /// scans, representative scores), in units of one full key row.
    pub searched: f64,
}

impl Attended {
    pub fn dense(out: Tensor) -> Self {
        Self { out, read: None, searched: 0.0 }
    }
}

/// An attention method.
pub trait Attention: Send + Sync {
    fn name(&self) -> &'static str;

    /// The method's settings as recorded with each answer (`--json`).
    fn settings(&self) -> serde_json::Value {
        serde_json::json!({ "method": self.name() })
    }

    /// The attention output of one layer's call and what it read.
    fn attend(&self, call: &AttnCall<'_>) -> Result<Attended>;

    /// Output `[q_heads, t, head_dim]` in the dtype of `call.q`.
    fn forward(&self, call: &AttnCall<'_>) -> Result<Tensor> {
        Ok(self.attend(call)?.out)
    }

    /// Forgets indexes and conversation state; called before each new generation, whose
    /// store may hold different keys at the same positions.
    fn reset(&self) {}

    /// Forgets the conversation too: what [`Attention::reset`] keeps across its turns (BUZZ's
    /// cache), with the indexes. For a caller that runs unrelated prompts through one method
    /// (the needle eval), whose next prompt could start at the position where the last ended.
    fn end_conversation(&self) {
        self.reset()
    }

    /// This method's index of `layer` over `kv`'s saved prefix as a context-file section
    /// (name, bytes), for `folio context index`; `None` for methods (or layers) without one.
    fn index_section(&self, _kv: &dyn KvStore, _layer: usize, _layers: usize) -> Result<Option<(String, Vec<u8>)>> {
        Ok(None)
    }

    /// Where each layer's index came from since the last reset.
    fn index_sources(&self) -> BTreeMap<usize, IndexSource> {
        BTreeMap::new()
    }
}

/// Method names [`by_name`] accepts.
pub const METHODS: [&str; 8] = ["dense", "streaming", "topk", "topk-ivf", "magicpig", "hip", "double-sparsity", "buzz"];

/// What some methods need besides their knobs: Double Sparsity's calibrated channels.
#[derive(Default, Clone)]
pub struct Resources {
    pub channels: Option<Arc<Channels>>,
}

/// How many tokens a sparse method may read per step and head.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Budget {
    Tokens(usize),
    /// A share of the keys visible at the step, in (0, 1].
    Fraction(f64),
}

impl Budget {
    /// `2048` (tokens), `2%` or `0.02` (a fraction of the context).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || {
            Error::Invalid(format!(
                "bad budget \"{s}\": give a token count (e.g. 2048) or a share of the context (e.g. 2% or 0.02, up to 100%)"
            ))
        };
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let p: f64 = p.trim().parse().map_err(|_| bad())?;
            return if p > 0.0 && p <= 100.0 { Ok(Self::Fraction(p / 100.0)) } else { Err(bad()) };
        }
        if let Ok(n) = t.parse::<usize>() {
            return if n > 0 { Ok(Self::Tokens(n)) } else { Err(bad()) };
        }
        match t.parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(Self::Fraction(f)),
            _ => Err(bad()),
        }
    }

    /// Tokens this budget buys over `visible` keys (at least 1, at most `visible`).
    pub fn tokens(&self, visible: usize) -> usize {
        let n = match *self {
            Self::Tokens(n) => n,
            Self::Fraction(f) => (f * visible as f64).ceil() as usize,
        };
        n.clamp(1, visible.max(1))
    }
}

/// One knob of a method: name, the paper's default, the valid range, what it does.
pub struct ParamSpec {
    pub name: &'static str,
    pub default: f64,
    pub min: f64,
    pub max: f64,
    pub integer: bool,
    pub doc: &'static str,
}

/// Validated knobs of one method: every spec'd name, given or defaulted.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Params(BTreeMap<String, f64>);

impl Params {
    pub fn parse(method: &str, specs: &[ParamSpec], given: &[(String, String)]) -> Result<Self> {
        let list = || {
            if specs.is_empty() {
                format!("{method} takes no parameters")
            } else {
                let items: Vec<String> = specs
                    .iter()
                    .map(|p| {
                        format!(
                            "{} ({}, {}..={}, default {}): {}",
                            p.name,
                            if p.integer { "integer" } else { "number" },
                            p.min,
                            p.max,
                            p.default,
                            p.doc
                        )
                    })
                    .collect();
                format!("{method} takes: {}", items.join("; "))
            }
        };
        let mut values: BTreeMap<String, f64> = specs.iter().map(|p| (p.name.to_owned(), p.default)).collect();
        for (k, v) in given {
            let spec = specs
                .iter()
                .find(|p| p.name == k)
                .ok_or_else(|| Error::Invalid(format!("unknown parameter \"{k}\" for {method}; {}", list())))?;
            let x: f64 = v
                .trim()
                .parse()
                .map_err(|_| Error::Invalid(format!("parameter {k}={v} is not a number; {}", list())))?;
            if !(x >= spec.min && x <= spec.max) || (spec.integer && x.fract() != 0.0) {
                return Err(Error::Invalid(format!("parameter {k}={v} is out of range; {}", list())));
            }
            values.insert(k.clone(), x);
        }
        Ok(Self(values))
    }

    pub fn get(&self, name: &str) -> f64 {
        self.0.get(name).copied().unwrap_or_default()
    }

    pub fn usize(&self, name: &str) -> usize {
        self.get(name) as usize
    }
}

/// Parses `key=value` items (`--param k=v`).
pub fn parse_params(items: &[String]) -> Result<Vec<(String, String)>> {
    items
        .iter()
        .map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| Error::Invalid(format!("bad parameter \"{s}\": write key=value")))
        })
        .collect()
}

/// The attention method called `name`, with its budget and knobs.
pub fn by_name(
    name: &str,
    budget: Option<&str>,
    params: &[(String, String)],
    resources: &Resources,
) -> Result<Box<dyn Attention>> {
    let budget = budget.map(Budget::parse).transpose()?;
    let need_budget = || {
        budget.ok_or_else(|| {
            Error::Invalid(format!("{name} needs a budget (--budget): a token count (e.g. 2048) or a share (e.g. 2%)"))
        })
    };
    match name {
        "dense" => {
            if let Some(b) = budget {
                return Err(Error::Invalid(format!(
                    "dense attention reads every token; it takes no budget (got {b:?})"
                )));
            }
            Params::parse(name, &[], params)?;
            Ok(Box::new(Dense))
        }
        "streaming" => Ok(Box::new(Streaming::new(need_budget()?, Params::parse(name, &streaming::PARAMS, params)?))),
        "topk" => Ok(Box::new(TopK::new(need_budget()?, Params::parse(name, &topk::PARAMS, params)?))),
        "topk-ivf" => Ok(Box::new(TopKIvf::new(need_budget()?, Params::parse(name, &ivf::PARAMS, params)?))),
        "magicpig" => Ok(Box::new(MagicPig::new(need_budget()?, Params::parse(name, &magicpig::PARAMS, params)?)?)),
        "hip" => Ok(Box::new(Hip::new(need_budget()?, Params::parse(name, &hip::PARAMS, params)?))),
        "buzz" => Ok(Box::new(Buzz::new(need_budget()?, Params::parse(name, &buzz::PARAMS, params)?))),
        "double-sparsity" => {
            let params = Params::parse(name, &double_sparsity::PARAMS, params)?;
            let channels = resources.channels.clone().ok_or_else(|| {
                Error::Invalid(
                    "double-sparsity needs the model's outlier channels: run `folio calibrate --model <model> --docs <files>` once"
                        .into(),
                )
            })?;
            Ok(Box::new(DoubleSparsity::new(need_budget()?, params, channels)?))
        }
        _ => Err(Error::Invalid(format!("unknown attention method \"{name}\"; available: {}", METHODS.join(", ")))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_and_params_are_validated() {
        assert_eq!(Budget::parse("2048").unwrap(), Budget::Tokens(2048));
        assert_eq!(Budget::parse("2%").unwrap(), Budget::Fraction(0.02));
        assert_eq!(Budget::parse("0.5").unwrap(), Budget::Fraction(0.5));
        for bad in ["0", "-3", "150%", "1.5", "lots"] {
            assert!(Budget::parse(bad).unwrap_err().to_string().contains("token count"), "{bad}");
        }
        assert_eq!(Budget::Fraction(0.1).tokens(1000), 100);
        assert_eq!(Budget::Tokens(5000).tokens(1000), 1000);
        let p = |s: &str| parse_params(&[s.to_owned()]).unwrap();
        let r = Resources::default();
        let err = by_name("topk", Some("64"), &p("bogus=1"), &r).err().unwrap().to_string();
        assert!(err.contains("unknown parameter") && err.contains("window"), "{err}");
        let err = by_name("streaming", Some("64"), &p("sinks=-1"), &r).err().unwrap().to_string();
        assert!(err.contains("out of range") && err.contains("sinks"), "{err}");
        assert!(by_name("topk", None, &[], &r).err().unwrap().to_string().contains("needs a budget"));
        let err = by_name("magic", None, &[], &r).err().unwrap().to_string();
        assert!(err.contains("available: dense, streaming, topk, topk-ivf, magicpig, hip, double-sparsity, buzz"));
        assert!(by_name("dense", Some("10"), &[], &r).is_err());
        let err = by_name("double-sparsity", Some("5%"), &[], &r).err().unwrap().to_string();
        assert!(err.contains("folio calibrate"), "{err}");
        for name in METHODS.iter().skip(1) {
            let err = by_name(name, Some("5%"), &p("nonsense=1"), &r).err().unwrap().to_string();
            assert!(err.contains("unknown parameter") || err.contains("folio calibrate"), "{name}: {err}");
        }
        assert!(parse_params(&["novalue".into()]).is_err());
    }
}
