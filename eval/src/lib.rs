//! Folio's yardsticks: how good an attention method's answers are, measured against dense
//! attention — never assumed from its budget.
//!
//! * [`workload`]: synthetic Q/K/V with the structure real heads have (sinks, locality,
//!   needles, long tails, outlier channels), for the methods' tests and
//!   `folio eval attention --synthetic`;
//! * [`probe`]: a method wrapped so that every decode step also runs dense attention on the
//!   same keys and tallies output error, recall of the true top keys, mass and cost;
//! * [`attention`]: every method at every budget through the probe, on a saved context or a
//!   workload (`folio eval attention`);
//! * [`needle`], [`tasks`], [`fidelity`]: answers, not logits — facts planted in long
//!   synthetic documents for the retrieval-trained demo model ([`spec`]: its
//!   `eval_spec.json`), and each method's answers to prompts that read the documents while
//!   they are generated, against dense's (`folio eval needle`, `folio eval fidelity`);
//!   [`ruler`]: the RULER-style suite of the yardstick model (many keys, many values,
//!   near-duplicates, deep chains, counting, frequency, two hops, recitation);
//! * [`sources`]: whether an answer's first source passage holds the fact it copied
//!   (`folio eval sources`);
//! * [`bench`]: speed and memory — decode over a long offloaded context with a model of a
//!   real shape, prefill and reopen, the kernels — each figure beside the limit that binds it,
//!   measured in the same run (`folio bench`).
//!
//! Why a crate of its own (docs/architecture.md): the engine (folio-models) answers questions
//! and is what the window ships; this crate measures it and is what the CLI's `eval` runs and
//! the methods' tests draw their workloads from. Keeping it out keeps the engine's API what a
//! product needs, and makes every figure of docs/performance.md come from code that cannot
//! reach inside the engine.
//!
//! Rules of this crate:
//!
//! * it builds on the public APIs of folio-models (the attention seam, the stores,
//!   generation), folio-kernels and folio-runtime (the device's memory sampler and pool, the
//!   host's memory readings) and never prints: reports are returned as values, or handed to a
//!   callback as a long run makes them, and the CLI renders them;
//! * every measurement is against dense attention on the same keys, and every random input
//!   comes from a seed the report carries, so a figure can be replayed.

pub mod attention;
pub mod bench;
pub mod fidelity;
pub mod needle;
pub mod probe;
pub mod ruler;
pub mod sources;
pub mod spec;
pub mod tasks;
pub mod workload;

pub use spec::EvalSpec;
