//! Evaluations that measure answers, not just logits: `needle` asks the retrieval-trained demo
//! model (assets/models/demo) for facts planted in long synthetic documents, the yardstick of
//! whether an attention method keeps what matters (docs/architecture.md).

pub mod attention;
pub mod needle;
pub mod spec;
