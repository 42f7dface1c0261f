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
//! appended to a context) is dense, as the papers prefill their prompts densely.

mod dense;
mod select;
mod streaming;
mod topk;

pub use dense::Dense;
pub use streaming::Streaming;
pub use topk::TopK;

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::kv::KvStore;

/// One layer's attention call.
pub struct AttnCall<'a> {
    /// The model layer.
    pub layer: usize,
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

/// An attention method.
pub trait Attention: Send + Sync {
    fn name(&self) -> &'static str;

    /// The method's settings as recorded with each answer (`--json`).
    fn settings(&self) -> serde_json::Value {
        serde_json::json!({ "method": self.name() })
    }

    /// Output `[q_heads, t, head_dim]` in the dtype of `call.q`.
    fn forward(&self, call: &AttnCall<'_>) -> Result<Tensor>;
}

/// Method names [`by_name`] accepts.
pub const METHODS: [&str; 3] = ["dense", "streaming", "topk"];

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
pub fn by_name(name: &str, budget: Option<&str>, params: &[(String, String)]) -> Result<Box<dyn Attention>> {
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
        let err = by_name("topk", Some("64"), &p("bogus=1")).err().unwrap().to_string();
        assert!(err.contains("unknown parameter") && err.contains("window"), "{err}");
        let err = by_name("streaming", Some("64"), &p("sinks=-1")).err().unwrap().to_string();
        assert!(err.contains("out of range") && err.contains("sinks"), "{err}");
        assert!(by_name("topk", None, &[]).err().unwrap().to_string().contains("needs a budget"));
        assert!(by_name("magic", None, &[]).err().unwrap().to_string().contains("available: dense, streaming, topk"));
        assert!(by_name("dense", Some("10"), &[]).is_err());
        assert!(parse_params(&["novalue".into()]).is_err());
    }
}
