//! Evaluations that measure answers, not just logits: `needle` asks the retrieval-trained demo
//! model (assets/models/demo) for facts planted in long synthetic documents, the yardstick of
//! whether an attention method keeps what matters (docs/architecture.md); `tasks` builds
//! prompts whose answers read the documents while they are generated, and `fidelity` measures
//! each method's answers to them against dense attention's.

pub mod attention;
pub mod fidelity;
pub mod needle;
pub mod spec;
pub mod tasks;

pub(crate) use attention::argmax;
pub use attention::kl_divergence;
pub use spec::EvalSpec;
