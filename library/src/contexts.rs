//! Contexts and their documents: rows that describe context files, refreshed from the files.
//!
//! A context's row is written only from what the disk says ([`OnDisk`]): the partial folder of
//! a prefill that runs or was interrupted, a finished file, a file that no longer reads, or
//! nothing. Listing re-reads a finished file only when its size or modification time changed
//! (opening one reads its header, tokens and spans: milliseconds, but not for every context on
//! every list).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use folio_context_file::{self as context, ContextFile, DocumentSpan, Header, Pending};
use serde::{Deserialize, Serialize};
use sqlx::{Row, Sqlite, Transaction};

use crate::{Error, Library, Result};

/// Where a context stands, as its file and partial folder say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// A prefill is writing it now (a process holds its partial folder's lock).
    Prefilling,
    /// Its prefill stopped after `layers_done` layers; running the prefill again resumes it.
    Paused,
    Ready,
    /// The file is there but does not read (`problem` says why).
    Damaged,
    /// Neither the file nor a prefill of it is where the library says: moved or deleted.
    Missing,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefilling => "prefilling",
            Self::Paused => "paused",
            Self::Ready => "ready",
            Self::Damaged => "damaged",
            Self::Missing => "missing",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "prefilling" => Self::Prefilling,
            "paused" => Self::Paused,
            "ready" => Self::Ready,
            "damaged" => Self::Damaged,
            // The schema's CHECK allows nothing else.
            _ => Self::Missing,
        }
    }
}

/// The model a context was made with, as its file records it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct ModelInfo {
    pub name: String,
    /// How to load it: a folder or a Hugging Face repo id.
    pub source: String,
    pub architecture: String,
    /// `folio_context_file::Fingerprint` as JSON: equal for models that make the same K/V.
    pub fingerprint: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct ContextInfo {
    pub id: i64,
    /// The file's name without its extension.
    pub name: String,
    pub path: PathBuf,
    pub model: ModelInfo,
    pub tokens: u64,
    pub layers: u64,
    pub layers_done: u64,
    pub kv_dtype: String,
    pub file_bytes: u64,
    pub status: Status,
    /// Why the context is damaged.
    pub problem: Option<String>,
    /// When the file (or the prefill's checkpoint) was last written, RFC 3339 UTC.
    pub saved_at: String,
    pub documents: u64,
    /// A ready context with an interrupted change beside it (documents being added or one
    /// taken out): the file is as it was before the change, which the same change (or the
    /// window's Resume) finishes.
    pub change_pending: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct DocumentInfo {
    pub title: String,
    pub path: String,
    /// The file's type, from its extension.
    pub kind: String,
    pub bytes: u64,
    pub xxh3: String,
    pub token_start: u64,
    pub token_end: u64,
}

/// A file's modification time (ns since the epoch) and size, as last read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    mtime_ns: i64,
    bytes: i64,
}

impl Seen {
    fn of(path: &Path) -> Option<Self> {
        let meta = std::fs::metadata(path).ok()?;
        let mtime = meta.modified().ok()?.duration_since(SystemTime::UNIX_EPOCH).ok()?;
        Some(Self { mtime_ns: i64::try_from(mtime.as_nanos()).ok()?, bytes: i64::try_from(meta.len()).ok()? })
    }
}

/// What the disk says about a context's path.
pub(crate) enum OnDisk {
    Pending(Pending),
    Ready { header: Header, documents: Vec<DocumentSpan>, seen: Seen, saved: SystemTime },
    Damaged(String),
    Missing,
}

impl OnDisk {
    pub(crate) fn read(path: &Path) -> Self {
        match context::pending(path) {
            // An interrupted addition to a file that is still there: the file is what the
            // library describes (it opens and chats as it was; rerunning the addition goes on).
            Ok(Some(p)) if p.base_tokens == 0 || !path.exists() => return Self::Pending(p),
            Ok(_) => {}
            Err(e) => return Self::Damaged(problem(e)),
        }
        let saved = match std::fs::metadata(path).and_then(|m| m.modified()) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Self::Missing,
            Err(e) => return Self::Damaged(e.to_string()),
        };
        match (ContextFile::open(path), Seen::of(path)) {
            (Ok(file), Some(seen)) => {
                Self::Ready { header: file.header().clone(), documents: file.documents().to_vec(), seen, saved }
            }
            (Err(e), _) => Self::Damaged(problem(e)),
            (Ok(_), None) => Self::Missing,
        }
    }
}

/// A context reader's message without the path it starts with (the row shows the path).
fn problem(e: folio_context_file::Error) -> String {
    match e {
        folio_context_file::Error::Context { msg, .. } => msg,
        other => other.to_string(),
    }
}

/// `path` made absolute with its folder resolved (the file itself may not exist yet).
pub(crate) fn absolute(path: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(path).map_err(|e| Error::io(path, e))?;
    match (abs.parent().map(Path::canonicalize), abs.file_name()) {
        (Some(Ok(dir)), Some(name)) => Ok(dir.join(name)),
        _ => Ok(abs),
    }
}

fn rfc3339(t: SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(t).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The type shown for a document: what the reader took it for, as the context file keeps it
/// (the staging sheet's name too); for a file made before it was kept, its extension,
/// lowercased ("text" without one).
fn document_kind(doc: &DocumentSpan) -> String {
    if !doc.kind.is_empty() {
        return doc.kind.clone();
    }
    Path::new(&doc.path).extension().map_or_else(|| "text".to_owned(), |e| e.to_string_lossy().to_lowercase())
}

/// Longest name a context (its file's name without the extension) may have.
const MAX_NAME_CHARS: usize = 200;

/// The setting holding context `id`'s default method (a `MethodChoice` as JSON): what a new
/// chat over it starts with in the window, and what the local server answers with when a
/// request names no method.
pub fn context_method_key(id: i64) -> String {
    format!("context.{id}.method")
}

/// `name` trimmed, if it can name a context file: 1 to [`MAX_NAME_CHARS`] characters, no path
/// separator, no control character (a newline in a file name breaks every list and script that
/// reads names line by line), no leading '.' (a hidden file).
pub fn context_name(name: &str) -> Result<&str> {
    let name = name.trim();
    if name.is_empty()
        || name.starts_with('.')
        || name.contains(['/', '\\'])
        || name.chars().any(char::is_control)
        || name.chars().count() > MAX_NAME_CHARS
    {
        return Err(Error::Refused(format!(
            "{name:?} cannot name a context file: use 1 to {MAX_NAME_CHARS} characters, without '/', control \
             characters (a line break, a tab) or a leading '.'"
        )));
    }
    Ok(name)
}

const CONTEXT_COLUMNS: &str = "c.id, c.path, c.tokens, c.layers, c.layers_done, c.kv_dtype, c.file_bytes, c.status, \
     c.problem, c.saved_at, m.name, m.source, m.architecture, m.fingerprint, \
     (SELECT COUNT(*) FROM documents d WHERE d.context_id = c.id) AS documents";

fn context_row(r: &sqlx::sqlite::SqliteRow) -> ContextInfo {
    let path = PathBuf::from(r.get::<String, _>("path"));
    let u = |name: &str| r.get::<i64, _>(name).max(0) as u64;
    let status = Status::parse(r.get("status"));
    ContextInfo {
        id: r.get("id"),
        name: path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
        model: ModelInfo {
            name: r.get("name"),
            source: r.get("source"),
            architecture: r.get("architecture"),
            fingerprint: r.get("fingerprint"),
        },
        tokens: u("tokens"),
        layers: u("layers"),
        layers_done: u("layers_done"),
        kv_dtype: r.get("kv_dtype"),
        file_bytes: u("file_bytes"),
        status,
        problem: r.get("problem"),
        saved_at: r.get("saved_at"),
        documents: u("documents"),
        change_pending: status == Status::Ready && context::partial_dir(&path).exists(),
        path,
    }
}

impl Library {
    /// Adds the context at `path` to the library, or refreshes its row: a context file, or the
    /// output of a prefill that has started (its partial folder holds a checkpoint).
    pub async fn add_context(&self, path: &Path) -> Result<ContextInfo> {
        let path = absolute(path)?;
        match self.store(&path, OnDisk::read(&path), true).await? {
            Some(id) => self.context(id).await,
            None => Err(Error::Refused(match OnDisk::read(&path) {
                OnDisk::Damaged(why) => format!("{}: {why}", path.display()),
                _ => format!("{}: there is no context file or prefill there", path.display()),
            })),
        }
    }

    /// Every context, newest first, each brought up to date with its file.
    pub async fn contexts(&self) -> Result<Vec<ContextInfo>> {
        let rows = sqlx::query("SELECT id, path, status, seen_mtime_ns, seen_bytes FROM contexts")
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        for r in rows {
            self.refresh(&PathBuf::from(r.get::<String, _>("path")), &r).await?;
        }
        let sql = format!("SELECT {CONTEXT_COLUMNS} FROM contexts c JOIN models m ON m.id = c.model_id ORDER BY c.saved_at DESC, c.id DESC");
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await.map_err(|e| self.err(e))?;
        Ok(rows.iter().map(context_row).collect())
    }

    /// One context, brought up to date with its file.
    pub async fn context(&self, id: i64) -> Result<ContextInfo> {
        let r = sqlx::query("SELECT id, path, status, seen_mtime_ns, seen_bytes FROM contexts WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?
            .ok_or_else(|| not_found(&id.to_string()))?;
        self.refresh(&PathBuf::from(r.get::<String, _>("path")), &r).await?;
        let sql = format!("SELECT {CONTEXT_COLUMNS} FROM contexts c JOIN models m ON m.id = c.model_id WHERE c.id = ?");
        let row = sqlx::query(&sql).bind(id).fetch_one(&self.pool).await.map_err(|e| self.err(e))?;
        Ok(context_row(&row))
    }

    /// The models that made the library's contexts (a model row lives as long as a context
    /// of it), with how many contexts each made, most used first: what the window offers to
    /// load.
    pub async fn models(&self) -> Result<Vec<(ModelInfo, u64)>> {
        let rows = sqlx::query(
            "SELECT m.name, m.source, m.architecture, m.fingerprint, \
             (SELECT COUNT(*) FROM contexts c WHERE c.model_id = m.id) AS contexts \
             FROM models m ORDER BY contexts DESC, m.name",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(rows
            .iter()
            .map(|r| {
                let model = ModelInfo {
                    name: r.get("name"),
                    source: r.get("source"),
                    architecture: r.get("architecture"),
                    fingerprint: r.get("fingerprint"),
                };
                (model, r.get::<i64, _>("contexts").max(0) as u64)
            })
            .collect())
    }

    /// The id of the context named by `key`: its id, or its file's path.
    pub async fn find(&self, key: &str) -> Result<i64> {
        let by_path = absolute(Path::new(key)).ok().map(|p| p.to_string_lossy().into_owned());
        let id: Option<i64> = sqlx::query_scalar("SELECT id FROM contexts WHERE CAST(id AS TEXT) = ? OR path = ?")
            .bind(key)
            .bind(by_path)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        id.ok_or_else(|| not_found(key))
    }

    /// A context's documents, in their order in the context.
    pub async fn documents(&self, id: i64) -> Result<Vec<DocumentInfo>> {
        let rows = sqlx::query(
            "SELECT title, path, kind, bytes, xxh3, token_start, token_end FROM documents \
             WHERE context_id = ? ORDER BY position",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(rows
            .iter()
            .map(|r| DocumentInfo {
                title: r.get("title"),
                path: r.get("path"),
                kind: r.get("kind"),
                bytes: r.get::<i64, _>("bytes").max(0) as u64,
                xxh3: r.get("xxh3"),
                token_start: r.get::<i64, _>("token_start").max(0) as u64,
                token_end: r.get::<i64, _>("token_end").max(0) as u64,
            })
            .collect())
    }

    /// Takes a context out of the library (its documents and chats with it). With
    /// `delete_files`, its context file and any interrupted prefill of it are deleted first;
    /// a prefill that runs now is never deleted under it.
    pub async fn remove_context(&self, id: i64, delete_files: bool) -> Result<ContextInfo> {
        let info = self.context(id).await?;
        if delete_files {
            if info.status == Status::Prefilling {
                return Err(Error::Refused(format!(
                    "{} is being prefilled right now: stop its prefill first, then delete it",
                    info.path.display()
                )));
            }
            let partial = context::partial_dir(&info.path);
            match std::fs::remove_dir_all(&partial) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&partial, e)),
                _ => {}
            }
            match std::fs::remove_file(&info.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&info.path, e)),
                _ => {}
            }
        }
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM contexts WHERE id = ?").bind(id).execute(&mut *tx).await.map_err(|e| self.err(e))?;
        sqlx::query("DELETE FROM models WHERE NOT EXISTS (SELECT 1 FROM contexts c WHERE c.model_id = models.id)")
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(info)
    }

    /// Renames a context: its file is renamed in its folder (the file is the source of truth,
    /// so a rebuilt library keeps the name), keeping its extension.
    pub async fn rename_context(&self, id: i64, name: &str) -> Result<ContextInfo> {
        let name = context_name(name)?;
        let info = self.context(id).await?;
        if info.status != Status::Ready {
            return Err(Error::Refused(format!(
                "{} is {}: only a ready context can be renamed",
                info.path.display(),
                info.status.as_str()
            )));
        }
        let mut file = std::ffi::OsString::from(name);
        if let Some(ext) = info.path.extension() {
            file.push(".");
            file.push(ext);
        }
        let to = info.path.with_file_name(file);
        if context::partial_dir(&info.path).exists() {
            return Err(Error::Refused(format!(
                "a change to {} was interrupted: finish it (Resume in the window, or `folio prefill --context \
                 {}`) or delete {} first",
                info.path.display(),
                info.path.display(),
                context::partial_dir(&info.path).display()
            )));
        }
        if to.exists() || context::partial_dir(&to).exists() {
            return Err(Error::Refused(format!("{} already exists: pick another name", to.display())));
        }
        let taken: Option<i64> = sqlx::query_scalar("SELECT id FROM contexts WHERE path = ?")
            .bind(to.to_string_lossy())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        if let Some(other) = taken {
            return Err(Error::Refused(format!(
                "the library lists context {other} at {} (its file is missing): remove it or pick another name",
                to.display()
            )));
        }
        folio_context_file::atomic::rename_no_replace(&info.path, &to).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                Error::Refused(format!("{} already exists: pick another name", to.display()))
            }
            _ => Error::io(&info.path, e),
        })?;
        let moved = sqlx::query("UPDATE contexts SET path = ? WHERE id = ?")
            .bind(to.to_string_lossy())
            .bind(id)
            .execute(&self.pool)
            .await;
        if let Err(e) = moved {
            // Put the file back where the library says it is.
            let _ = std::fs::rename(&to, &info.path);
            return Err(self.err(e));
        }
        self.context(id).await
    }

    /// Forgets the context at `path` if nothing of it is on disk (a prefill that failed before
    /// its first layer leaves nothing to resume); `true` if it was forgotten.
    pub async fn forget_if_gone(&self, path: &Path) -> Result<bool> {
        let path = absolute(path)?;
        if !matches!(OnDisk::read(&path), OnDisk::Missing) {
            return Ok(false);
        }
        let done = sqlx::query("DELETE FROM contexts WHERE path = ?")
            .bind(path.to_string_lossy())
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected() > 0)
    }

    /// Brings one row up to date, re-reading its file only when needed.
    async fn refresh(&self, path: &Path, row: &sqlx::sqlite::SqliteRow) -> Result<()> {
        let stored = match (row.get::<Option<i64>, _>("seen_mtime_ns"), row.get::<Option<i64>, _>("seen_bytes")) {
            (Some(mtime_ns), Some(bytes)) => Some(Seen { mtime_ns, bytes }),
            _ => None,
        };
        let unchanged = Status::parse(row.get("status")) == Status::Ready
            && stored.is_some()
            && Seen::of(path) == stored
            && !context::partial_dir(path).exists();
        if !unchanged {
            // Refreshing never re-creates a row another process removed meanwhile.
            self.store(path, OnDisk::read(path), false).await?;
        }
        Ok(())
    }

    /// Writes what the disk says about `path` into its row (created if `create`); the row's
    /// id, or `None` when there is no row (and nothing to describe, or `create` is false).
    pub(crate) async fn store(&self, path: &Path, disk: OnDisk, create: bool) -> Result<Option<i64>> {
        let key = path.to_string_lossy().into_owned();
        let mut tx = self.write().await?;
        let exists: Option<i64> = sqlx::query_scalar("SELECT id FROM contexts WHERE path = ?")
            .bind(&key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        if exists.is_none() && !create {
            return Ok(None);
        }
        let id = match disk {
            OnDisk::Pending(p) => {
                let status = if p.running { Status::Prefilling } else { Status::Paused };
                let row = Described { header: &p.header, documents: &p.documents, status, layers_done: p.layers_done };
                Some(self.upsert(&mut tx, &key, &row, rfc3339(p.updated), None).await?)
            }
            OnDisk::Ready { header, documents, seen, saved } => {
                let row = Described {
                    header: &header,
                    documents: &documents,
                    status: Status::Ready,
                    layers_done: header.layers,
                };
                Some(self.upsert(&mut tx, &key, &row, rfc3339(saved), Some(seen)).await?)
            }
            OnDisk::Damaged(why) => self.mark(&mut tx, &key, Status::Damaged, Some(why)).await?,
            OnDisk::Missing => self.mark(&mut tx, &key, Status::Missing, None).await?,
        };
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(id)
    }

    async fn mark(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        path: &str,
        status: Status,
        problem: Option<String>,
    ) -> Result<Option<i64>> {
        sqlx::query_scalar(
            "UPDATE contexts SET status = ?, problem = ?, seen_mtime_ns = NULL, seen_bytes = NULL WHERE path = ? \
             RETURNING id",
        )
        .bind(status.as_str())
        .bind(problem)
        .bind(path)
        .fetch_optional(&mut **tx)
        .await
        .map_err(|e| self.err(e))
    }

    async fn upsert(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        path: &str,
        d: &Described<'_>,
        saved_at: String,
        seen: Option<Seen>,
    ) -> Result<i64> {
        let model = &d.header.model;
        let fingerprint = serde_json::to_string(&model.fingerprint).expect("a fingerprint serialises");
        let model_id: i64 = sqlx::query_scalar(
            "INSERT INTO models (source, name, architecture, fingerprint) VALUES (?, ?, ?, ?) \
             ON CONFLICT (source, fingerprint) DO UPDATE SET name = excluded.name RETURNING id",
        )
        .bind(&model.source)
        .bind(&model.name)
        .bind(&model.fingerprint.architecture)
        .bind(fingerprint)
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| self.err(e))?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO contexts (path, model_id, tokens, layers, layers_done, kv_dtype, file_bytes, status, problem, \
             saved_at, seen_mtime_ns, seen_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?) \
             ON CONFLICT (path) DO UPDATE SET model_id = excluded.model_id, tokens = excluded.tokens, \
             layers = excluded.layers, layers_done = excluded.layers_done, kv_dtype = excluded.kv_dtype, \
             file_bytes = excluded.file_bytes, status = excluded.status, problem = NULL, saved_at = excluded.saved_at, \
             seen_mtime_ns = excluded.seen_mtime_ns, seen_bytes = excluded.seen_bytes RETURNING id",
        )
        .bind(path)
        .bind(model_id)
        .bind(d.header.tokens as i64)
        .bind(d.header.layers as i64)
        .bind(d.layers_done as i64)
        .bind(d.header.kv_dtype.name())
        .bind(d.header.file_bytes as i64)
        .bind(d.status.as_str())
        .bind(saved_at)
        .bind(seen.map(|s| s.mtime_ns))
        .bind(seen.map(|s| s.bytes))
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| self.err(e))?;
        sqlx::query("DELETE FROM documents WHERE context_id = ?")
            .bind(id)
            .execute(&mut **tx)
            .await
            .map_err(|e| self.err(e))?;
        for (position, doc) in d.documents.iter().enumerate() {
            sqlx::query(
                "INSERT INTO documents (context_id, position, title, path, kind, bytes, xxh3, token_start, token_end) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            )
            .bind(id)
            .bind(position as i64)
            .bind(&doc.title)
            .bind(&doc.path)
            .bind(document_kind(doc))
            .bind(doc.bytes as i64)
            .bind(&doc.xxh3)
            .bind(doc.start as i64)
            .bind(doc.end as i64)
            .execute(&mut **tx)
            .await
            .map_err(|e| self.err(e))?;
        }
        // A model no context names any more (the file now says another) goes.
        sqlx::query("DELETE FROM models WHERE NOT EXISTS (SELECT 1 FROM contexts c WHERE c.model_id = models.id)")
            .execute(&mut **tx)
            .await
            .map_err(|e| self.err(e))?;
        Ok(id)
    }
}

/// The parts of a context's row its file (or prefill) gives.
struct Described<'a> {
    header: &'a Header,
    documents: &'a [DocumentSpan],
    status: Status,
    layers_done: usize,
}

fn not_found(key: &str) -> Error {
    Error::NotFound(format!("no context \"{key}\" in the library: `folio library list` shows its ids and paths"))
}
