//! A method's user-facing settings: one *budget* (tokens, or a share of the context) and its
//! knobs, each validated against the method's [`ParamSpec`] table (the papers' defaults and
//! ranges), so a bad value is refused with that knob's range and an unknown name with the knobs'
//! names.
//!
//! [`Params::get`] panics on a name outside the method's table: a knob is read only by the
//! method that declares it, so such a name is a typo in Folio's code (the tests exercise every
//! knob), never user input — silently reading 0 would hide it.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// How many tokens a sparse method may read per step and head.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
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

    /// The budget as [`Budget::parse`] reads it back: `2048` or `2%`.
    pub fn text(&self) -> String {
        match *self {
            Self::Tokens(n) => n.to_string(),
            // Rounded to a millionth of a percent: 7% is 0.07, whose product with 100 is not 7.
            Self::Fraction(f) => format!("{}%", (f * 1e8).round() / 1e6),
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
#[derive(Debug, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct ParamSpec {
    pub name: &'static str,
    pub default: f64,
    pub min: f64,
    pub max: f64,
    pub integer: bool,
    pub doc: &'static str,
}

impl ParamSpec {
    /// "block (an integer from 16 to 256, default 64): what it does".
    pub fn range(&self) -> String {
        let kind = if self.integer { "an integer" } else { "a number" };
        format!("{} ({kind} from {} to {}, default {}): {}", self.name, self.min, self.max, self.default, self.doc)
    }
}

/// Validated knobs of one method: every spec'd name, given or defaulted.
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct Params(BTreeMap<String, f64>);

impl Params {
    /// Every knob of `specs`, defaulted, with `given` over them. A bad value is refused with
    /// that knob's range and meaning only; an unknown name with the knobs' names (a person
    /// who mistyped one needs the names, not every range).
    pub fn parse(method: &str, specs: &[ParamSpec], given: &[(String, String)]) -> Result<Self> {
        let names = || {
            if specs.is_empty() {
                format!("{method} takes no parameters")
            } else {
                format!("{method} takes {}", specs.iter().map(|p| p.name).collect::<Vec<_>>().join(", "))
            }
        };
        let mut values: BTreeMap<String, f64> = specs.iter().map(|p| (p.name.to_owned(), p.default)).collect();
        for (k, v) in given {
            let spec = specs
                .iter()
                .find(|p| p.name == k)
                .ok_or_else(|| Error::Invalid(format!("unknown parameter \"{k}\" for {method}: {}", names())))?;
            let x: f64 = v
                .trim()
                .parse()
                .map_err(|_| Error::Invalid(format!("parameter {k}={v} is not a number: {}", spec.range())))?;
            if !(x >= spec.min && x <= spec.max) || (spec.integer && x.fract() != 0.0) {
                return Err(Error::Invalid(format!("parameter {k}={v} is out of range: {}", spec.range())));
            }
            values.insert(k.clone(), x);
        }
        Ok(Self(values))
    }

    /// The knob `name`; panics when the method's table has no such knob (a typo in Folio's
    /// code: see the module docs).
    pub fn get(&self, name: &str) -> f64 {
        match self.0.get(name) {
            Some(&x) => x,
            None => panic!("no knob \"{name}\" among {:?}", self.0.keys().collect::<Vec<_>>()),
        }
    }

    /// Every knob with its value, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }

    pub fn usize(&self, name: &str) -> usize {
        self.get(name) as usize
    }
}

/// The recent window of the methods that keep it exact beside their sparse part (HiP,
/// MagicPIG): the query's own token at least, outside the budget.
pub(super) const RECENT_WINDOW: ParamSpec = ParamSpec {
    name: "window",
    default: 64.0,
    min: 1.0,
    max: 1_048_576.0,
    integer: true,
    doc: "most recent tokens attended exactly (the query's own at least), outside the budget",
};

/// Parses `key=value` items.
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

/// The budget the registry resolved for a method that has one (its default at least): `None`
/// here is a registry error, not user input.
pub(super) fn required(budget: Option<Budget>) -> Result<Budget> {
    budget.ok_or_else(|| Error::Invalid("internal: a budgeted method was built without its budget".into()))
}
