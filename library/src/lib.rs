//! Folio's library: one SQLite file listing what the app knows — the models that made
//! contexts, the context files and their documents, chats and their messages, and settings.
//! The window and the CLI (`folio library ...`, `folio prefill`) both read and write it through
//! this crate, at the same time if need be.
//!
//! # Rules
//!
//! * **Context files are the source of truth.** A context's model, tokens, documents and status
//!   are what its file (or its prefill's partial folder) says; the rows describe the files so a
//!   list needs no file opened. [`Library::contexts`] re-reads a file whose size or modification
//!   time changed, and [`Library::rebuild`] re-creates the rows from a folder of files. Only
//!   chats, messages and settings live in the database alone.
//! * **Nothing is lost.** Every change is one transaction. A database that cannot be read is
//!   never migrated or overwritten: opening it fails with [`Error::Corrupt`], and only
//!   [`Library::rebuild_damaged`] (`folio library rebuild`) sets it aside — kept, renamed — to
//!   start a new one. Deleting a context's file is a separate, explicit choice from removing its
//!   row.
//! * **Many processes, one file.** WAL journaling, so a reader never waits for a writer; a busy
//!   timeout, so two writers wait for each other rather than fail; `BEGIN IMMEDIATE` for
//!   read-then-write transactions, so they take the write lock before reading and never fail
//!   halfway with a stale snapshot. A lock file serialises migrations between processes that
//!   open a new database at once.
//! * **Foreign keys on**: removing a context removes its documents and chats; a model stays
//!   while a context names it.
//! * **No Tauri, no terminal.** Errors carry the whole message ([`Error`]); progress and output
//!   are the caller's.
//!
//! # Why SQLite, and what was rejected
//!
//! A JSON index file was the alternative: simple, but two processes writing it lose each
//! other's changes, and a chat history grows past what one rewrite per message should cost.
//! SQLite gives transactions, concurrent readers and migrations in one file, through sqlx
//! (the stack's choice) with the schema in `migrations/` embedded at build time. Keeping K/V
//! bytes or document text in the database was rejected: gigabytes per context belong in the
//! memory-mapped context files, and a damaged database must never cost a prefill.
//!
//! # Where it lives
//!
//! `$FOLIO_HOME/library.sqlite3` when `FOLIO_HOME` is set (tests, portable installs), else
//! `folio/` in the platform's data folder (`~/.local/share/folio` on Linux). New contexts made
//! by the window go to `contexts/` beside it; a context file can live anywhere.

mod chats;
mod contexts;
mod error;
mod portable;
mod rebuild;

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

pub use chats::{ChatInfo, MessageRow, NewMessage};
pub use contexts::{context_name, ContextInfo, DocumentInfo, ModelInfo, Status};
pub use error::{Error, Result};
pub use rebuild::RebuildReport;

/// The database's file name in the Folio home folder.
pub const DATABASE_FILE: &str = "library.sqlite3";
/// Where the window puts the contexts it makes, in the Folio home folder.
pub const CONTEXTS_FOLDER: &str = "contexts";
/// Held while a process opens (and migrates) the database.
const OPEN_LOCK_FILE: &str = "library.lock";
/// How long a write waits for another process's write before [`Error::Busy`].
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections per process: the window reads while a job writes; SQLite allows one writer.
const MAX_CONNECTIONS: u32 = 4;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Folio's home folder: `FOLIO_HOME`, else `folio/` in the platform's data folder.
pub fn home() -> Result<PathBuf> {
    match std::env::var_os("FOLIO_HOME").filter(|h| !h.is_empty()) {
        Some(h) => Ok(PathBuf::from(h)),
        None => dirs::data_dir().map(|d| d.join("folio")).ok_or(Error::NoHome),
    }
}

/// An open library. Cheap to clone (a connection pool); every method is one transaction.
#[derive(Clone)]
pub struct Library {
    pool: SqlitePool,
    home: PathBuf,
    db: PathBuf,
    busy_timeout: Duration,
}

impl Library {
    /// The library in [`home`].
    pub async fn open_default() -> Result<Self> {
        Self::open(&home()?).await
    }

    /// The library in the home folder `home`, created (with the folder) if missing and migrated
    /// to this Folio's schema. A file that is not a readable database is [`Error::Corrupt`] and
    /// stays as it is.
    pub async fn open(home: &Path) -> Result<Self> {
        Self::open_with(home, BUSY_TIMEOUT).await
    }

    /// [`Library::open`] with another wait for a lock held by another process.
    pub async fn open_with(home: &Path, busy_timeout: Duration) -> Result<Self> {
        std::fs::create_dir_all(home).map_err(|e| Error::io(home, e))?;
        let db = home.join(DATABASE_FILE);
        let lock_path = home.join(OPEN_LOCK_FILE);
        let lock = std::fs::File::create(&lock_path).map_err(|e| Error::io(&lock_path, e))?;
        // Blocking, but only for as long as another process takes to open and migrate.
        <std::fs::File as fs4::FileExt>::lock(&lock).map_err(|e| Error::io(&lock_path, e))?;
        let options = SqliteConnectOptions::new()
            .filename(&db)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // With WAL, NORMAL loses no committed transaction on a process crash (only on power
            // loss, the last few): the library can be rebuilt, a prefill cannot.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(busy_timeout);
        let busy = busy_timeout;
        let pool = SqlitePoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .connect_with(options)
            .await
            .map_err(|e| Error::database(&db, e, busy))?;
        let check: String = sqlx::query_scalar("PRAGMA quick_check")
            .fetch_one(&pool)
            .await
            .map_err(|e| Error::database(&db, e, busy))?;
        if check != "ok" {
            pool.close().await;
            return Err(Error::Corrupt { path: db, detail: check });
        }
        if let Err(e) = MIGRATOR.run(&pool).await {
            pool.close().await;
            return Err(match e {
                MigrateError::VersionMissing(version) => {
                    Error::Newer { path: db, version, known: MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0) }
                }
                MigrateError::Execute(e) => Error::database(&db, e, busy),
                other => Error::Corrupt { path: db, detail: other.to_string() },
            });
        }
        drop(lock);
        Ok(Self { pool, home: home.to_owned(), db, busy_timeout })
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    /// The database file.
    pub fn database(&self) -> &Path {
        &self.db
    }

    /// Where the window saves new contexts.
    pub fn contexts_folder(&self) -> PathBuf {
        self.home.join(CONTEXTS_FOLDER)
    }

    /// Closes the connections (a process exiting does the same).
    pub async fn close(self) {
        self.pool.close().await;
    }

    /// A setting's JSON value, `None` when it was never set.
    pub async fn setting(&self, key: &str) -> Result<Option<serde_json::Value>> {
        let text: Option<String> = sqlx::query_scalar("SELECT value FROM settings WHERE key = ?")
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        text.map(|t| {
            serde_json::from_str(&t).map_err(|e| Error::Corrupt {
                path: self.db.clone(),
                detail: format!("setting \"{key}\" is not JSON: {e}"),
            })
        })
        .transpose()
    }

    pub async fn set_setting(&self, key: &str, value: &serde_json::Value) -> Result<()> {
        sqlx::query(
            "INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        )
        .bind(key)
        .bind(value.to_string())
        .execute(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    fn err(&self, e: sqlx::Error) -> Error {
        Error::database(&self.db, e, self.busy_timeout)
    }

    /// A transaction that holds the write lock from its start (see the crate rules).
    async fn write(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| self.err(e))
    }
}
