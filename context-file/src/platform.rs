//! The file operations whose calls differ between operating systems, in one place: reads and
//! writes at an offset, and what a path that is not a regular file is.
//!
//! Why here: context files are read and written at offsets by several crates (the prefill's
//! checkpoints, the loader's weights, the store's rows); with the platform calls behind this
//! module, a port to another system changes one file. Unix has `pread`/`pwrite`
//! (`std::os::unix::fs::FileExt`); Windows reads and writes at an offset through
//! `seek_read`/`seek_write`, which move the file's cursor (Folio never uses a file's cursor and
//! a positional call at once) and may return short counts, so they are looped.
//!
//! The context file's lowest tier reads rows with the page cache bypassed
//! ([`open_unbuffered`]): the rows it keeps are counted by the host budget in its own cache, and
//! a second copy in the page cache would be memory the budget does not see and a disk rate the
//! benchmarks could not measure (a re-read served from memory).

use std::fs::{File, FileType};
use std::io;
use std::path::Path;

/// What reads that bypass the page cache ask of their buffer's address, their offset and their
/// length (O_DIRECT on Linux: the disk's logical block, 512 B or 4 KiB; 4 KiB covers both).
pub const DIRECT_ALIGN: usize = 4096;

/// `path` opened for reading with the page cache bypassed where the system and the file
/// system allow it (O_DIRECT on Linux), and whether they do: a file system that refuses it
/// (tmpfs), at the open or at a first read, gets a plain read-only open. Reads of a file opened unbuffered must use buffers,
/// offsets and lengths that are multiples of [`DIRECT_ALIGN`] ([`read_aligned`] does).
pub fn open_unbuffered(path: &Path) -> io::Result<(File, bool)> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            // Some file systems take the flag and refuse every read: one read tells.
            Ok(file) => match memmap2::MmapMut::map_anon(DIRECT_ALIGN).and_then(|mut b| read_at(&file, &mut b, 0)) {
                Ok(_) => return Ok((file, true)),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            },
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((File::open(path)?, false))
}

/// Reads `need` bytes of `file` from `offset` into `buf` (at least `need` long), where
/// `offset` and `buf.len()` are multiples of [`DIRECT_ALIGN`] and `buf` is aligned to it: the
/// read may stop at the end of the file past `need` (a file's last section is not padded to a
/// block), not before. An end before `need` is `UnexpectedEof`.
pub fn read_aligned(file: &File, buf: &mut [u8], offset: u64, need: usize) -> io::Result<()> {
    let mut got = 0;
    while got < need {
        let n = read_at(file, &mut buf[got..], offset + got as u64)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the file ends {got} bytes after offset {offset}, before the {need} bytes asked"),
            ));
        }
        got += n;
    }
    Ok(())
}

/// One positional read (it may be short); interrupted reads are retried.
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    loop {
        #[cfg(unix)]
        let r = std::os::unix::fs::FileExt::read_at(file, buf, offset);
        #[cfg(windows)]
        let r = std::os::windows::fs::FileExt::seek_read(file, buf, offset);
        match r {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

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
    use super::{open_unbuffered, read_aligned, special, PositionalIo, Special, DIRECT_ALIGN};
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

    /// Aligned reads through an unbuffered open give the file's bytes, also across its unaligned
    /// end; a read wanting bytes past the end is `UnexpectedEof`.
    #[test]
    fn unbuffered_aligned_reads_give_the_files_bytes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..3 * DIRECT_ALIGN + 100).map(|_| rng.random()).collect();
        std::fs::write(&path, &bytes).unwrap();
        let (file, _) = open_unbuffered(&path).unwrap();
        // An anonymous map: page-aligned, as unbuffered reads want.
        let mut map = memmap2::MmapMut::map_anon(2 * DIRECT_ALIGN).unwrap();
        let buf = &mut map[..];
        read_aligned(&file, buf, DIRECT_ALIGN as u64, 2 * DIRECT_ALIGN).unwrap();
        assert_eq!(buf[..], bytes[DIRECT_ALIGN..3 * DIRECT_ALIGN]);
        read_aligned(&file, buf, 2 * DIRECT_ALIGN as u64, DIRECT_ALIGN + 100).unwrap();
        assert_eq!(buf[..DIRECT_ALIGN + 100], bytes[2 * DIRECT_ALIGN..]);
        let err = read_aligned(&file, buf, 2 * DIRECT_ALIGN as u64, DIRECT_ALIGN + 101).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
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
