//! The library's errors: each says what is wrong with which file and what to do, as the CLI
//! prints them and the window shows them.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// SQLite's primary result codes the library tells apart (the low byte of an extended code).
const SQLITE_BUSY: i64 = 5;
const SQLITE_LOCKED: i64 = 6;
const SQLITE_CORRUPT: i64 = 11;
const SQLITE_NOTADB: i64 = 26;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("there is no data folder for Folio on this system: set FOLIO_HOME to a folder")]
    NoHome,
    #[error(
        "the library {} cannot be opened: {detail}; `folio library rebuild` re-creates it from the context \
         files (the damaged database is kept beside it)",
        path.display()
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error(
        "the library {} is busy: another Folio process kept it locked for {waited:?} or more; let its command finish \
         or close the other Folio window, then try again",
        path.display()
    )]
    Busy { path: PathBuf, waited: std::time::Duration },
    #[error(
        "the library {} was written by a newer Folio (it has schema version {version}; this Folio knows up to \
         {known}): update Folio, or set FOLIO_HOME to another folder",
        path.display()
    )]
    Newer { path: PathBuf, version: i64, known: i64 },
    /// Nothing in the library by that id or path (the message names it).
    #[error("{0}")]
    NotFound(String),
    /// The change would lose or break something (the message says what and what to do).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Context(#[from] folio_context_file::Error),
    /// Not a `#[source]`, as `folio_context_file::Error::Io`: the message says it once.
    #[error("{}: {}", path.display(), folio_context_file::io_message(error))]
    Io { path: PathBuf, error: std::io::Error },
    #[error("library {}: {source}", path.display())]
    Database { path: PathBuf, source: sqlx::Error },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), error: source }
    }

    /// `source` from the database at `path`, told apart into a damaged file, a lock held too
    /// long, and the rest.
    pub(crate) fn database(path: &std::path::Path, source: sqlx::Error, waited: std::time::Duration) -> Self {
        let code = match &source {
            sqlx::Error::Database(e) => e.code().and_then(|c| c.parse::<i64>().ok()).map(|c| c & 0xff),
            _ => None,
        };
        match code {
            Some(SQLITE_CORRUPT | SQLITE_NOTADB) => Self::Corrupt { path: path.to_owned(), detail: source.to_string() },
            Some(SQLITE_BUSY | SQLITE_LOCKED) => Self::Busy { path: path.to_owned(), waited },
            _ => Self::Database { path: path.to_owned(), source },
        }
    }
}
