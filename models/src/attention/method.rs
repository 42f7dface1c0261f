//! What a method declares about itself ([`MethodSpec`]: name, paper, default budget, knobs,
//! needs, tiers, cost) and the tiers it runs on. Its own module, apart from the table that
//! lists the methods (`registry`), so that each method's module names these types without
//! importing the table that imports it.

use super::cost::{CostInput, StepCost};
use super::params::{Budget, ParamSpec, Params};
use super::{Attention, Resources};
use crate::error::{Error, Result};

/// Where a saved context's rows live while a conversation decodes over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Whole layers decoded into device memory as attention asks for them; picks are gathered
    /// there.
    Resident,
    /// The saved rows in host memory; a step moves only the rows the method picks.
    Offloaded,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Self::Resident => "resident",
            Self::Offloaded => "offloaded",
        }
    }
}

/// How a tier runs a method: its fast path (`crate::kv_cache::DecodeTier`), or its CPU reference
/// (with why) — or not at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(tag = "path", content = "why", rename_all = "lowercase")]
pub enum Path {
    Fast,
    /// The obviously-right CPU implementation runs: correct, but every step reads the layer.
    Reference(&'static str),
    /// The tier refuses the method.
    None(&'static str),
}

/// How each tier runs a method.
#[derive(Debug, Clone, Copy, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Tiers {
    pub resident: Path,
    pub offloaded: Path,
}

impl Tiers {
    /// A fast path on both tiers.
    pub const FAST: Self = Self { resident: Path::Fast, offloaded: Path::Fast };
}

/// A method's budget when none is given, and where that number comes from.
#[derive(Debug, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct DefaultBudget {
    pub budget: &'static str,
    pub source: &'static str,
}

/// What a method needs besides its knobs.
#[derive(Debug, Default, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Needs {
    /// The model's outlier channels (`folio calibrate`): Double Sparsity.
    pub calibration: bool,
    /// The index it builds over the saved context (and can store in the file with
    /// `folio context index`), in words.
    pub index: Option<&'static str>,
}

impl Needs {
    /// Nothing but its knobs.
    pub const NONE: Self = Self { calibration: false, index: None };
}

/// A method made from a budget and its knobs alone (what most are).
pub(super) trait Budgeted: Attention + Sized + 'static {
    fn new(budget: Budget, params: Params) -> Result<Self>;
}

/// [`MethodSpec::build`] of a [`Budgeted`] method.
pub(super) fn budgeted<M: Budgeted>(
    budget: Option<Budget>,
    params: Params,
    _: &Resources,
) -> Result<Box<dyn Attention>> {
    Ok(Box::new(M::new(super::params::required(budget)?, params)?))
}

/// How the registry makes a method: from its budget (`None` only for a method without one)
/// and its validated knobs.
pub(super) type Build = fn(Option<Budget>, Params, &Resources) -> Result<Box<dyn Attention>>;

/// One method, declared in its module.
#[derive(serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct MethodSpec {
    pub name: &'static str,
    /// One line, for a settings panel.
    pub summary: &'static str,
    pub paper: &'static str,
    /// `None`: the method reads every key and takes no budget (dense).
    pub default_budget: Option<DefaultBudget>,
    pub params: &'static [ParamSpec],
    pub needs: Needs,
    #[serde(flatten)]
    pub tiers: Tiers,
    /// The step's traffic at a shape, context and budget (`folio bench --shape`'s floor).
    #[serde(skip)]
    pub cost: fn(&CostInput<'_>) -> StepCost,
    #[serde(skip)]
    pub(super) build: Build,
}

impl MethodSpec {
    /// How `tier` runs this method.
    pub fn path(&self, tier: Tier) -> Path {
        match tier {
            Tier::Resident => self.tiers.resident,
            Tier::Offloaded => self.tiers.offloaded,
        }
    }

    /// Refuses a tier that cannot run this method, with the reason.
    pub fn check_tier(&self, tier: Tier) -> Result<()> {
        match self.path(tier) {
            Path::None(why) => Err(Error::Invalid(format!("{} on the {} tier: {why}", self.name, tier.name()))),
            _ => Ok(()),
        }
    }

    /// The method's knobs: `given` validated against its table, the rest at their defaults.
    pub fn params(&self, given: &[(String, String)]) -> Result<Params> {
        Params::parse(self.name, self.params, given)
    }

    /// `given`, else the default budget; an error for a budget given to a method without one.
    pub fn budget(&self, given: Option<&str>) -> Result<Option<Budget>> {
        match (&self.default_budget, given) {
            (None, Some(b)) => {
                Err(Error::Invalid(format!("{} reads every token; it takes no budget (got {b})", self.name)))
            }
            (None, None) => Ok(None),
            (Some(_), Some(b)) => Budget::parse(b).map(Some),
            (Some(d), None) => Budget::parse(d.budget).map(Some),
        }
    }
}
