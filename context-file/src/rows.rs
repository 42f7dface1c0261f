//! How one K or V row lies in a section: f32, bf16, or fp8 e4m3 codes with one f32 scale per
//! row (the scales in an array after the rows). The one definition of a stored row: the codec
//! writes and reads rows with it, and the engine's kernels read rows in place with it (their
//! CPU references call [`stored_row`]; their GPU fast paths are held to it).
//!
//! Why a per-row scale: K rows of different tokens differ in magnitude by orders (outlier
//! channels, attention sinks), and e4m3 has only 4 exponent bits; scaling each row so its
//! largest element maps to e4m3's largest finite value keeps every row's relative error at the
//! format's 2^-4 step instead of flushing small rows to zero.

/// Largest finite e4m3 value: a row's largest magnitude is scaled to it.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// How rows are held when that is not the dtype they are read in: a context file's sections,
/// read where they lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    F32,
    Bf16,
    /// fp8 e4m3 codes, row after row, then one f32 scale per row from byte `scales` of the
    /// section on (a value is its code times its row's scale).
    Fp8 {
        scales: usize,
    },
}

impl Stored {
    /// Bytes of one row's values (an fp8 row's scale lies apart).
    pub fn row_bytes(self, d: usize) -> usize {
        match self {
            Self::F32 => 4 * d,
            Self::Bf16 => 2 * d,
            Self::Fp8 { .. } => d,
        }
    }

    /// Bytes of a section of `rows` rows, scales included.
    pub fn section_bytes(self, rows: usize, d: usize) -> usize {
        match self {
            Self::Fp8 { scales } => scales + 4 * rows,
            _ => rows * self.row_bytes(d),
        }
    }
}

/// Row `row` of a section stored as `stored` (`d` values a row; little-endian bytes, as the
/// context file and the GPU read them: Folio's targets are little-endian), as f32 into `out`:
/// an fp8 code times its row's scale.
pub fn stored_row(section: &[u8], stored: Stored, row: usize, d: usize, out: &mut [f32]) {
    let raw = &section[row * stored.row_bytes(d)..(row + 1) * stored.row_bytes(d)];
    match stored {
        Stored::F32 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Stored::Bf16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Stored::Fp8 { scales } => {
            let s = &section[scales + 4 * row..scales + 4 * row + 4];
            fp8_row_values(raw, f32::from_le_bytes([s[0], s[1], s[2], s[3]]), out);
        }
    }
}

/// One fp8 row's values into `out`: each of its `codes` times the row's `scale`.
pub fn fp8_row_values(codes: &[u8], scale: f32, out: &mut [f32]) {
    let table = fp8_values();
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = table[c as usize] * scale;
    }
}

/// Encodes one row into `codes` (e4m3 bits, round to nearest even, saturating) and returns its
/// scale (`amax / 448`, or 1 for an all-zero row); `None` when the row holds a NaN or an
/// infinity (fp8 cannot store them, and a scale of one would spoil the row).
pub fn fp8_row(row: &[f32], codes: &mut [u8]) -> Option<f32> {
    // (f32::max skips NaN, so finiteness is checked on the row itself.)
    if !row.iter().all(|x| x.is_finite()) {
        return None;
    }
    let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = if amax > 0.0 { amax / FP8_E4M3_MAX } else { 1.0 };
    codes.iter_mut().zip(row).for_each(|(c, x)| *c = float8::F8E4M3::from_f32(x / scale).to_bits());
    Some(scale)
}

/// Every e4m3 code's value, so decoding a row is a table lookup and a multiply (the conversion
/// goes through f16 in software; a reopen or MagicPIG's host attention decodes millions a step).
pub fn fp8_values() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|c| float8::F8E4M3::from_bits(c as u8).to_f32()))
}
