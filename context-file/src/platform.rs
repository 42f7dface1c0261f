//! The file operations whose calls differ between operating systems, in one place: reads and
//! writes at an offset, and what a path that is not a regular file is.
//!
//! Why here: context files are read and written at offsets by several crates (the prefill's
//! checkpoints, the loader's weights, the store's rows); with the platform calls behind this
//! module, a port to another system changes one file. Unix has `pread`/`pwrite`
//! (`std::os::unix::fs::FileExt`); Windows reads and writes at an offset through
//! `seek_read`/`seek_write`, which move the file's cursor (Folio never uses a file's cursor and
//! a positional call at once) and may return short counts, so they are looped.

use std::fs::{File, FileType};
use std::io;

/// Reads and writes at an offset, whole.
pub trait PositionalIo {
    /// Fills `buf` from `offset`; an early end of file is an `UnexpectedEof` error.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`.
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
}

#[cfg(unix)]
impl PositionalIo for File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, buf, offset)
    }
}

#[cfg(windows)]
impl PositionalIo for File {
    fn read_exact_at(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        use std::os::windows::fs::FileExt;
        while !buf.is_empty() {
            match self.seek_read(buf, offset) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_all_at(&self, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
        use std::os::windows::fs::FileExt;
        while !buf.is_empty() {
            match self.seek_write(buf, offset) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    buf = &buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// What a path that is not a regular file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    Folder,
    Link,
    Device,
    NamedPipe,
    Socket,
    Other,
}

impl Special {
    /// The words a person reads ("a named pipe").
    pub fn words(self) -> &'static str {
        match self {
            Special::Folder => "a folder",
            Special::Link => "a symbolic link",
            Special::Device => "a device",
            Special::NamedPipe => "a named pipe",
            Special::Socket => "a socket",
            Special::Other => "a special file",
        }
    }
}

/// `None` for a regular file, else what it is.
pub fn special(t: &FileType) -> Option<Special> {
    if t.is_file() {
        return None;
    }
    if t.is_dir() {
        return Some(Special::Folder);
    }
    if t.is_symlink() {
        return Some(Special::Link);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_char_device() || t.is_block_device() {
            return Some(Special::Device);
        }
        if t.is_fifo() {
            return Some(Special::NamedPipe);
        }
        if t.is_socket() {
            return Some(Special::Socket);
        }
    }
    Some(Special::Other)
}

#[cfg(test)]
mod tests {
    use super::{special, PositionalIo, Special};
    use rand::{Rng, SeedableRng};

    /// Writes at random offsets, read back at random offsets, equal a plain in-memory copy
    /// (the reference); a read past the end is `UnexpectedEof`.
    #[test]
    fn positional_reads_and_writes_match_a_plain_buffer() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        let mut reference = vec![0u8; 4096];
        file.write_all_at(&reference, 0).unwrap();
        for _ in 0..200 {
            let at = rng.random_range(0..4000);
            let n = rng.random_range(1..=4096 - at);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            file.write_all_at(&bytes, at as u64).unwrap();
            reference[at..at + n].copy_from_slice(&bytes);
            let (from, len) = (rng.random_range(0..4096), rng.random_range(0..64));
            let mut got = vec![0u8; len];
            match file.read_exact_at(&mut got, from as u64) {
                Ok(()) => assert_eq!(got, reference[from..from + len]),
                Err(e) => {
                    assert!(from + len > 4096, "{e}");
                    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
                }
            }
        }
    }

    #[test]
    fn special_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        assert_eq!(special(&std::fs::metadata(&file).unwrap().file_type()), None);
        assert_eq!(special(&std::fs::metadata(dir.path()).unwrap().file_type()), Some(Special::Folder));
        #[cfg(unix)]
        assert_eq!(special(&std::fs::metadata("/dev/null").unwrap().file_type()), Some(Special::Device));
    }
}
