//! A GGUF's tensors → the decoder's weights, by their Hugging Face names.
//!
//! The decoder asks for weights by Hugging Face name ([`crate::model`]); [`gguf_name`] maps
//! each to llama.cpp's. Two things differ beyond names:
//!
//! * llama.cpp's converter permutes the q and k rows of llama-architecture models so that
//!   RoPE rotates interleaved pairs (its "normal" mode); the decoder rotates halves, as
//!   transformers does. [`unpermute_rows`] moves whole rows back — a quantized row is a run of
//!   whole blocks, so this works on any type's bytes without dequantizing;
//! * matrices stay in their file type (`crate::model`'s projections multiply them: Folio's
//!   kernels on CUDA, candle's `QMatMul` on the CPU); F16/BF16/F32 matrices
//!   and every vector are converted to the model's dtype, the same tensors a safetensors
//!   checkpoint gives.

use std::borrow::Cow;

use candle_core::quantized::{QStorage, QTensor};
use candle_core::Device;

use super::{GgufFile, TensorPlace};
use crate::error::Result;

/// llama.cpp's tensor name for a Hugging Face one, or `None` for a name it has no tensor for.
pub fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let name = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}.{kind}"))
}

/// `rows` rows of `row_bytes` each, in llama.cpp's interleaved order for `heads` heads, put back
/// in rotate-half order: within a head, GGUF row `2j + s` is Hugging Face row `s * half + j`.
pub fn unpermute_rows(data: &[u8], heads: usize, rows: usize, row_bytes: usize) -> Vec<u8> {
    let per_head = rows / heads;
    let half = per_head / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for j in 0..half {
            for s in 0..2 {
                let from = (h * per_head + 2 * j + s) * row_bytes;
                let to = (h * per_head + s * half + j) * row_bytes;
                out[to..to + row_bytes].copy_from_slice(&data[from..from + row_bytes]);
            }
        }
    }
    out
}

impl GgufFile {
    /// The bytes of tensor `name` (checked at open to lie inside the file).
    fn bytes(&self, place: &TensorPlace) -> Result<Vec<u8>> {
        use folio_context_file::platform::PositionalIo;
        let file = std::fs::File::open(self.path()).map_err(|e| crate::error::Error::io(self.path(), e))?;
        let mut buf = vec![0u8; place.bytes as usize];
        file.read_exact_at(&mut buf, place.start).map_err(|e| crate::error::Error::io(self.path(), e))?;
        Ok(buf)
    }

    /// Tensor `name` as stored, on `device`.
    pub fn read_tensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        self.read_tensor_rows(name, None, device)
    }

    /// Tensor `name` on `device`, its rows put back in rotate-half order for `heads` heads when
    /// given (llama-architecture q and k).
    pub fn read_tensor_rows(&self, name: &str, unpermute_heads: Option<usize>, device: &Device) -> Result<QTensor> {
        let (data, place) = self.tensor_rows_bytes(name, unpermute_heads)?;
        let storage = QStorage::from_data(Cow::Owned(data), device, place.dtype)?;
        Ok(QTensor::new(storage, place.dims.as_slice())?)
    }

    /// The bytes of tensor `name` as [`GgufFile::read_tensor_rows`] places them, and where it is
    /// described: for a caller that puts the blocks on a device itself.
    pub fn tensor_rows_bytes(&self, name: &str, unpermute_heads: Option<usize>) -> Result<(Vec<u8>, &TensorPlace)> {
        let place = self.tensor(name).ok_or_else(|| crate::error::Error::MissingTensor { name: name.to_owned() })?;
        let mut data = self.bytes(place)?;
        if let Some(heads) = unpermute_heads {
            let rows = place.dims[0];
            if heads == 0 || !rows.is_multiple_of(2 * heads) {
                return Err(self.error(format!("tensor {name} has {rows} rows, not whole heads of {heads}")));
            }
            data = unpermute_rows(&data, heads, rows, place.bytes as usize / rows);
        }
        Ok((data, place))
    }
}
