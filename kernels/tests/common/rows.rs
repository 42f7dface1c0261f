//! Host rows as a context file lays them out, for the tests that read rows where they lie
//! (kernels' select, method-kernels' hip and magicpig): page-aligned bytes and a stored section.

use candle_core::DType;
use folio_kernels::select::Stored;

/// Page-aligned bytes (the alignment of a memory-mapped file, which a GPU registers in place).
pub struct PageAligned {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl PageAligned {
    pub const PAGE: usize = 4096;

    pub fn new(bytes: &[u8]) -> Self {
        let mut buf = vec![0u8; bytes.len().next_multiple_of(Self::PAGE) + Self::PAGE];
        let start = (Self::PAGE - buf.as_ptr() as usize % Self::PAGE) % Self::PAGE;
        buf[start..start + bytes.len()].copy_from_slice(bytes);
        Self { buf, start, len: bytes.len() }
    }
}

impl AsRef<[u8]> for PageAligned {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// A section of `rows` rows stored as fp8 (scales after the codes), bf16 or f32, and each
/// stored value as the context file decodes it.
pub fn stored_section(values: &[f32], d: usize, kind: DType) -> (Vec<u8>, Stored, Vec<f32>) {
    let rows = values.len() / d;
    match kind {
        DType::F8E4M3 => {
            let scales = (rows * d).next_multiple_of(8);
            let (mut bytes, mut decoded) = (vec![0u8; scales + 4 * rows], Vec::with_capacity(values.len()));
            for (r, row) in values.chunks_exact(d).enumerate() {
                let codes = &mut bytes[r * d..(r + 1) * d];
                let scale = folio_kernels::encode::fp8_row(row, codes).expect("finite rows");
                decoded.extend(codes.iter().map(|&c| float8::F8E4M3::from_bits(c).to_f32() * scale));
                bytes[scales + 4 * r..scales + 4 * r + 4].copy_from_slice(&scale.to_le_bytes());
            }
            (bytes, Stored::Fp8 { scales }, decoded)
        }
        DType::BF16 => {
            let b: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (b.iter().flat_map(|x| x.to_le_bytes()).collect(), Stored::Bf16, b.iter().map(|x| x.to_f32()).collect())
        }
        _ => (values.iter().flat_map(|x| x.to_le_bytes()).collect(), Stored::F32, values.to_vec()),
    }
}
