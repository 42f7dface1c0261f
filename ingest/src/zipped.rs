//! ZIP containers (DOCX, ODT, EPUB) read one entry at a time under the unzipped size and ratio
//! limits: an entry's declared size is not trusted (bombs lie), the bytes actually inflated are
//! counted as they come.

use std::cell::Cell;
use std::io::{Cursor, Read};

use crate::limits::{bytes, Budget, Limit, LimitHit};
use crate::{Format, Refusal};

/// Bytes inflated between two checks of the clock.
const READ_CHUNK: usize = 64 << 10;

pub(crate) struct Container<'a, 'l> {
    zip: zip::ZipArchive<Cursor<&'a [u8]>>,
    format: Format,
    budget: &'a Budget<'l>,
    /// Bytes unpacked so far from this container.
    unpacked: Cell<u64>,
}

impl<'a, 'l> Container<'a, 'l> {
    pub fn open(bytes: &'a [u8], format: Format, budget: &'a Budget<'l>) -> Result<Self, Refusal> {
        let zip = zip::ZipArchive::new(Cursor::new(bytes))
            .map_err(|e| Refusal::damaged(format, format!("not a readable ZIP container ({e})")))?;
        Ok(Self { zip, format, budget, unpacked: Cell::new(0) })
    }

    /// The entry `name` as UTF-8 text, or `None` when the container has no such entry.
    pub fn text(&mut self, name: &str) -> Result<Option<String>, Refusal> {
        let limits = self.budget.limits;
        let mut entry = match self.zip.by_name(name) {
            Ok(e) => e,
            Err(zip::result::ZipError::FileNotFound) => return Ok(None),
            Err(e) => return Err(Refusal::damaged(self.format, format!("cannot unpack {name}: {e}"))),
        };
        let compressed = entry.compressed_size().max(1);
        let mut data = Vec::new();
        let mut chunk = vec![0u8; READ_CHUNK];
        loop {
            self.budget.tick()?;
            let n = entry
                .read(&mut chunk)
                .map_err(|e| Refusal::damaged(self.format, format!("cannot unpack {name}: {e}")))?;
            if n == 0 {
                break;
            }
            data.extend_from_slice(&chunk[..n]);
            let total = self.unpacked.get() + n as u64;
            self.unpacked.set(total);
            if total > limits.unzipped_bytes {
                return Err(LimitHit::new(
                    Limit::UnzippedSize,
                    format!("it unpacks to more than {}", bytes(limits.unzipped_bytes)),
                )
                .into());
            }
            let grown = data.len() as u64;
            if grown > crate::limits::RATIO_FLOOR_BYTES && grown / compressed > limits.ratio {
                return Err(LimitHit::new(
                    Limit::Ratio,
                    format!(
                        "{name} unpacks to over {}× its packed size of {} (a zip bomb?)",
                        limits.ratio,
                        bytes(compressed)
                    ),
                )
                .into());
            }
        }
        String::from_utf8(data)
            .map(Some)
            .map_err(|_| Refusal::damaged(self.format, format!("{name} is not UTF-8 text")))
    }

    /// The entry `name`, which the format requires.
    pub fn required(&mut self, name: &str) -> Result<String, Refusal> {
        self.text(name)?.ok_or_else(|| Refusal::damaged(self.format, format!("it has no {name}")))
    }
}
