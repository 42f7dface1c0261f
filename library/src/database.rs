//! Where the library lives and how it is opened: WAL, a busy timeout, foreign keys, a quick
//! check before anything is written and the migrations run under a lock file, so that two
//! processes opening a new database at once do not race. The tables' reads and writes are in
//! the sibling modules (`contexts`, `chats`, `rebuild`, `portable`), each an `impl Library`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

use crate::error::{Error, Result};

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
    pub(crate) pool: SqlitePool,
    pub(crate) home: PathBuf,
    pub(crate) db: PathBuf,
    pub(crate) busy_timeout: Duration,
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

    pub(crate) fn err(&self, e: sqlx::Error) -> Error {
        Error::database(&self.db, e, self.busy_timeout)
    }

    /// A transaction that holds the write lock from its start (see the crate rules).
    pub(crate) async fn write(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| self.err(e))
    }
}
