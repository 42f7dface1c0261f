//! A file's path as the context file and the library store it: a string that gives back the
//! operating system's exact path, whatever bytes it holds.
//!
//! Why: a Unix file name is bytes, not text; `bad-\xff\xfe-name.txt` is a real name. Stored
//! lossily (U+FFFD for each bad byte) it no longer names the file, so a later removal or resume
//! that reads the context's documents again could not find it. Every path that is valid UTF-8
//! (all but a few) is stored as itself; in one that is not, each byte that is not part of valid
//! UTF-8 is stored as the character U+10FF00 + byte (Supplementary Private Use Area-B, which no
//! script uses; a name that already holds U+10FF80..U+10FFFF is stored as is and read back as
//! those bytes — a name no one makes). JSON, SQLite and the window carry it as ordinary text;
//! a person sees those characters as the replacement glyph their font draws for unassigned
//! private-use characters, as they would see U+FFFD.

use std::path::{Path, PathBuf};

/// Where the escaped bytes start: U+10FF00 + a byte from 0x80 to 0xFF.
const ESCAPE_BASE: u32 = 0x10_FF00;
/// The lowest byte that can be escaped: bytes under 0x80 are always valid UTF-8.
const FIRST_ESCAPED: u32 = 0x80;

/// `path` as stored: itself when it is UTF-8, else with its stray bytes escaped.
pub fn to_stored(path: &Path) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        escape_bytes(path.as_os_str().as_bytes())
    }
    #[cfg(not(unix))]
    {
        path.to_string_lossy().into_owned()
    }
}

/// The path a stored string names: its escaped bytes put back.
pub fn from_stored(stored: &str) -> PathBuf {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStringExt;
        PathBuf::from(std::ffi::OsString::from_vec(unescape_bytes(stored)))
    }
    #[cfg(not(unix))]
    {
        PathBuf::from(stored)
    }
}

/// `bytes` as a string: valid UTF-8 runs as they are, each other byte escaped.
pub fn escape_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for &b in chunk.invalid() {
            out.push(char::from_u32(ESCAPE_BASE + u32::from(b)).expect("U+10FF80..U+10FFFF are characters"));
        }
    }
    out
}

/// The bytes [`escape_bytes`] was given.
pub fn unescape_bytes(stored: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(stored.len());
    let mut utf8 = [0u8; 4];
    for c in stored.chars() {
        match u32::from(c).checked_sub(ESCAPE_BASE) {
            Some(b) if b >= FIRST_ESCAPED => out.push(b as u8),
            _ => out.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{escape_bytes, unescape_bytes};
    use rand::{Rng, SeedableRng};

    /// Fresh random byte strings — valid UTF-8 of every width, stray continuation bytes,
    /// truncated sequences, 0xFF — come back byte for byte, and valid UTF-8 is stored as itself.
    #[test]
    fn any_bytes_come_back_and_utf8_is_kept_as_is() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let pieces: [&[u8]; 8] =
            [b"report", "é".as_bytes(), "日本".as_bytes(), "😀".as_bytes(), b"\xff", b"\xfe\x80", b"\xe6\x97", b"/"];
        for _ in 0..2000 {
            let bytes: Vec<u8> =
                (0..rng.random_range(0..20)).flat_map(|_| pieces[rng.random_range(0..pieces.len())].to_vec()).collect();
            let stored = escape_bytes(&bytes);
            assert_eq!(unescape_bytes(&stored), bytes);
            if let Ok(text) = std::str::from_utf8(&bytes) {
                assert_eq!(stored, text);
            }
        }
    }
}
