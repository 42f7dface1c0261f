//! The method registry: the one table every consumer reads — the CLI's `--method` and
//! `folio methods`, the eval and bench commands, the sessions' tier checks. A method is declared once,
//! by the [`MethodSpec`] in its own module (name, paper, default budget, knobs, what it needs,
//! which tiers run its fast path, its cost), and listed in [`REGISTRY`]; nothing else names it.
//!
//! One syntax names a method with its budget and knobs everywhere ([`MethodChoice`]):
//! `METHOD[:BUDGET][:KEY=VALUE]...`, e.g. `hip`, `hip:2048`, `magicpig:2%:bits=9:tables=120`;
//! lists are comma-separated (`dense,hip:2048,topk:1%`). A method named without a budget uses
//! its paper's default, so a user who picks one in a settings panel needs no number in mind.
//! Rejected: separate `--budget`/`--param` flags (a list of methods could not carry one budget
//! each) and `method.key=value` knobs (a second syntax for the same thing).

use std::fmt;

use super::method::MethodSpec;
use super::params::{Budget, Params};
use super::{buzz, dense, double_sparsity, hip, ivf, magicpig, streaming, topk};
use super::{Attention, Resources};
use crate::error::{Error, Result};

/// Every method, in the order a settings panel lists them.
pub static REGISTRY: [&MethodSpec; 8] = [
    &dense::SPEC,
    &streaming::SPEC,
    &topk::SPEC,
    &ivf::SPEC,
    &magicpig::SPEC,
    &hip::SPEC,
    &double_sparsity::SPEC,
    &buzz::SPEC,
];

/// The registered names, comma-separated (for error messages and help).
pub fn names() -> String {
    REGISTRY.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

/// The method called `name`.
pub fn spec(name: &str) -> Result<&'static MethodSpec> {
    REGISTRY
        .iter()
        .copied()
        .find(|m| m.name == name)
        .ok_or_else(|| Error::Invalid(format!("unknown attention method \"{name}\"; available: {}", names())))
}

/// The attention method called `name`, with its budget (its default when `None`) and knobs.
pub fn by_name(
    name: &str,
    budget: Option<&str>,
    params: &[(String, String)],
    resources: &Resources,
) -> Result<Box<dyn Attention>> {
    let spec = spec(name)?;
    let budget = spec.budget(budget)?;
    (spec.build)(budget, spec.params(params)?, resources)
}

/// A method named with its budget and knobs, as a user writes it:
/// `METHOD[:BUDGET][:KEY=VALUE]...` (see the module docs).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct MethodChoice {
    pub method: String,
    /// `None`: the method's default.
    pub budget: Option<String>,
    pub params: Vec<(String, String)>,
}

impl Default for MethodChoice {
    fn default() -> Self {
        Self { method: dense::SPEC.name.to_owned(), budget: None, params: Vec::new() }
    }
}

impl MethodChoice {
    /// Reads `METHOD[:BUDGET][:KEY=VALUE]...`, checking the name, budget and knobs against
    /// the registry (so a typo is refused here, with the valid names).
    pub fn parse(text: &str) -> Result<Self> {
        let mut items = text.split(':').map(str::trim);
        let method = items.next().unwrap_or_default().to_owned();
        let mut choice = Self { method, budget: None, params: Vec::new() };
        for item in items {
            match item.split_once('=') {
                Some((k, v)) => choice.params.push((k.trim().to_owned(), v.trim().to_owned())),
                None if choice.budget.is_none() && choice.params.is_empty() => choice.budget = Some(item.to_owned()),
                None => {
                    return Err(Error::Invalid(format!(
                        "bad method \"{text}\": write METHOD[:BUDGET][:KEY=VALUE]..., e.g. hip:2048:refresh=16 \
                         (the budget comes first, once)"
                    )))
                }
            }
        }
        choice.check()?;
        Ok(choice)
    }

    /// A comma-separated list of [`MethodChoice::parse`]'s syntax.
    pub fn parse_list(text: &str) -> Result<Vec<Self>> {
        text.split(',').filter(|s| !s.trim().is_empty()).map(Self::parse).collect()
    }

    pub fn spec(&self) -> Result<&'static MethodSpec> {
        spec(&self.method)
    }

    /// Validates the choice against the registry without building anything.
    pub fn check(&self) -> Result<()> {
        let spec = self.spec()?;
        spec.budget(self.budget.as_deref())?;
        spec.params(&self.params)?;
        Ok(())
    }

    /// The budget in effect: the given one, else the method's default (`None` for dense).
    pub fn budget(&self) -> Result<Option<Budget>> {
        self.spec()?.budget(self.budget.as_deref())
    }

    /// Every knob's value in effect.
    pub fn params(&self) -> Result<Params> {
        self.spec()?.params(&self.params)
    }

    pub fn build(&self, resources: &Resources) -> Result<Box<dyn Attention>> {
        by_name(&self.method, self.budget.as_deref(), &self.params, resources)
    }

    /// A name for files and folders: `topk-1pct`, `hip-2048-refresh-16`.
    pub fn slug(&self) -> String {
        self.to_string().replace('%', "pct").replace([':', '='], "-")
    }
}

/// The syntax [`MethodChoice::parse`] reads.
impl fmt::Display for MethodChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.method)?;
        if let Some(b) = &self.budget {
            write!(f, ":{b}")?;
        }
        for (k, v) in &self.params {
            write!(f, ":{k}={v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_read_back_what_they_print() {
        let c = MethodChoice::parse("hip:2048:refresh=16").unwrap();
        assert_eq!((c.method.as_str(), c.budget.as_deref()), ("hip", Some("2048")));
        assert_eq!(c.params, vec![("refresh".to_owned(), "16".to_owned())]);
        assert_eq!(MethodChoice::parse(&c.to_string()).unwrap(), c);
        assert_eq!(c.slug(), "hip-2048-refresh-16");
        // Knobs without a budget: the default budget.
        let c = MethodChoice::parse("magicpig:bits=9").unwrap();
        assert_eq!(c.budget, None);
        assert_eq!(
            c.budget().unwrap(),
            Some(Budget::parse(magicpig::SPEC.default_budget.as_ref().unwrap().budget).unwrap())
        );
        assert_eq!(MethodChoice::parse_list("dense, topk:1%,hip").unwrap().len(), 3);
        for bad in ["hip:2048:4096", "hip:refresh=4:2048", "dense:10", "hip:0", "magic", "hip:bogus=1", "hip:refresh=0"]
        {
            assert!(MethodChoice::parse(bad).is_err(), "{bad}");
        }
        let err = MethodChoice::parse("hip:refesh=4").unwrap_err().to_string();
        assert!(err.contains("unknown parameter \"refesh\"") && err.contains("refresh"), "{err}");
    }

    #[test]
    fn every_method_has_a_default_budget_and_builds_with_it() {
        let resources = Resources::default();
        for spec in REGISTRY {
            assert_eq!(spec.default_budget.is_none(), spec.name == dense::SPEC.name, "{}", spec.name);
            if let Some(d) = &spec.default_budget {
                Budget::parse(d.budget).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
                assert!(!d.source.is_empty());
            }
            match by_name(spec.name, None, &[], &resources) {
                Ok(m) => assert_eq!(m.name(), spec.name),
                // Double Sparsity needs the model's calibration, which these resources lack.
                Err(e) => assert!(spec.needs.calibration && e.to_string().contains("folio calibrate"), "{e}"),
            }
        }
    }

    #[test]
    fn budgets_and_params_are_validated() {
        assert_eq!(Budget::parse("2048").unwrap(), Budget::Tokens(2048));
        assert_eq!(Budget::parse("2%").unwrap(), Budget::Fraction(0.02));
        assert_eq!(Budget::parse("0.5").unwrap(), Budget::Fraction(0.5));
        for bad in ["0", "-3", "150%", "1.5", "lots"] {
            assert!(Budget::parse(bad).unwrap_err().to_string().contains("token count"), "{bad}");
        }
        for text in ["7%", "6.25%", "2048", "0.5%"] {
            assert_eq!(Budget::parse(text).unwrap().text(), text);
        }
        assert_eq!(Budget::Fraction(0.1).tokens(1000), 100);
        assert_eq!(Budget::Tokens(5000).tokens(1000), 1000);
        let p = |s: &str| crate::attention::parse_params(&[s.to_owned()]).unwrap();
        let r = Resources::default();
        let err = by_name("topk", Some("64"), &p("bogus=1"), &r).err().unwrap().to_string();
        assert!(err.contains("unknown parameter") && err.contains("window"), "{err}");
        let err = by_name("streaming", Some("64"), &p("sinks=-1"), &r).err().unwrap().to_string();
        assert!(err.contains("out of range") && err.contains("sinks (an integer from"), "{err}");
        // A bad value names that knob alone, not every knob of the method.
        let err = by_name("hip", None, &p("block=0"), &r).err().unwrap().to_string();
        assert!(err.contains("block (an integer from 1 to 256, default 2)"), "{err}");
        assert!(!err.contains("refresh") && !err.contains("dense_layers"), "{err}");
        let err = by_name("magic", None, &[], &r).err().unwrap().to_string();
        assert!(err.contains(&format!("available: {}", names())), "{err}");
        assert!(by_name("dense", Some("10"), &[], &r).is_err());
        let err = by_name("double-sparsity", Some("5%"), &[], &r).err().unwrap().to_string();
        assert!(err.contains("folio calibrate"), "{err}");
        for spec in REGISTRY.iter().skip(1) {
            let err = by_name(spec.name, Some("5%"), &p("nonsense=1"), &r).err().unwrap().to_string();
            assert!(err.contains("unknown parameter") || err.contains("folio calibrate"), "{}: {err}", spec.name);
        }
        assert!(crate::attention::parse_params(&["novalue".into()]).is_err());
    }

    #[test]
    #[should_panic(expected = "no knob \"windw\"")]
    fn reading_an_undeclared_knob_is_a_bug() {
        let params = topk::SPEC.params(&[]).unwrap();
        params.get("windw");
    }

    #[test]
    fn names_are_unique() {
        let mut names: Vec<_> = REGISTRY.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), REGISTRY.len());
    }
}
