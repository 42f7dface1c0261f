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
mod database;
mod error;
mod portable;
mod rebuild;

pub use chats::{ChatInfo, MessageRow, NewMessage};
pub use contexts::{context_method_key, context_name, ContextInfo, DocumentInfo, ModelInfo, Status};
pub use database::{home, Library, BUSY_TIMEOUT, CONTEXTS_FOLDER, DATABASE_FILE};
pub use error::{Error, Result};
pub use rebuild::RebuildReport;
