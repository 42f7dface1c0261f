//! The token embedding table and where it lives.
//!
//! A decode step reads one row of the table (7 KiB for a 7B model in bf16) and a prefill chunk
//! one row a token, yet on the device the whole table holds 1 GiB of a 7B model's memory: a
//! twelfth of a 12 GiB card, for reads the host link carries in microseconds. So on a GPU the
//! table is page-locked host memory mapped into the device's address space ([`HostRows`]) and the
//! GPU gathers the rows it needs over the link, as it gathers an offloaded context's K/V rows —
//! no copy through the CPU, no synchronisation. It stays on the device where the LM head
//! multiplies by the table itself (a tied head in the model's dtype), for a dtype host rows
//! do not hold (f16) or rows the gather cannot read 16 bytes at a time, and where the system
//! refuses to page-lock the table or the host budget cannot hold it (it is then where it was,
//! and the census says so).

use candle_core::{DType, Device, Tensor};
use folio_kernels::select::HostRows;
use folio_kernels::Positions;
use folio_runtime::host_budget::{self, Hold};

use crate::error::Result;

/// The gather reads rows in loads of this many bytes.
const GATHER_LOAD_BYTES: usize = 16;

/// Whether the embedding table (rows of `hidden` values) of a model on `device` in `dtype`
/// lives in host memory.
pub fn embedding_on_host(device: &Device, dtype: DType, hidden: usize, head_is_table: bool) -> bool {
    device.is_cuda()
        && matches!(dtype, DType::F32 | DType::BF16)
        && (hidden * dtype.size_in_bytes()).is_multiple_of(GATHER_LOAD_BYTES)
        && !head_is_table
}

/// The table `[vocab, hidden]`: a tensor on the model's device, or rows in host memory.
pub enum Embedding {
    Here(Tensor),
    /// With the host budget's hold on its bytes.
    Host(HostRows, Hold),
}

impl Embedding {
    /// `table` (on `device`) kept there, or moved to host memory when [`embedding_on_host`].
    pub fn place(table: Tensor, device: &Device, head_is_table: bool) -> Result<Self> {
        let (vocab, hidden) = table.dims2()?;
        if !embedding_on_host(device, table.dtype(), hidden, head_is_table) {
            return Ok(Self::Here(table));
        }
        // Page-locked memory can be refused (a locked-memory limit, the host budget): the table
        // then stays, and the log says why the device holds more than the plan counted.
        let bytes = table.elem_count() * table.dtype().size_in_bytes();
        let placed =
            host_budget::hold(bytes as u64, "the embedding table").map_err(|e| e.to_string()).and_then(|hold| {
                Ok((HostRows::new(device, table.dtype(), 1, vocab, hidden).map_err(|e| e.to_string())?, hold))
            });
        let (mut rows, hold) = match placed {
            Ok(placed) => placed,
            Err(e) => {
                tracing::warn!(%e, bytes, "the embedding table stays in device memory: host memory could not be page-locked");
                return Ok(Self::Here(table));
            }
        };
        rows.write(0, &table.unsqueeze(0)?)?;
        Ok(Self::Host(rows, hold))
    }

    /// Rows `ids` (each below the vocabulary size: the caller checks) as `[t, hidden]` on
    /// `device`.
    pub fn rows(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let idx = Tensor::new(ids, device)?;
        Ok(match self {
            Self::Here(t) => t.index_select(&idx, 0)?,
            Self::Host(rows, _) => rows.gather(&idx.unsqueeze(0)?, 1, None, Positions::Trusted)?.squeeze(0)?,
        })
    }

    /// Values in the table.
    pub fn values(&self) -> usize {
        match self {
            Self::Here(t) => t.elem_count(),
            Self::Host(rows, _) => rows.len() * rows.dim(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Self::Here(t) => t.dtype(),
            Self::Host(rows, _) => rows.dtype(),
        }
    }

    /// Bytes of the table, wherever it is.
    pub fn bytes(&self) -> u64 {
        (self.values() * self.dtype().size_in_bytes()) as u64
    }

    pub fn on_host(&self) -> bool {
        matches!(self, Self::Host(..))
    }
}
