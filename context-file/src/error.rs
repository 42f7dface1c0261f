//! The crate's error: what is wrong with a context file or its path, said once, with what to
//! do. The engine and the library wrap it in their own errors without rewording it.

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A context file (or its partial folder) that is not what it should be.
    #[error("{path}: {msg}")]
    Context { path: PathBuf, msg: String },

    /// A request that cannot be met (a path that must not be replaced, a bad section).
    #[error("{0}")]
    Invalid(String),

    /// Not a `#[source]`: the message already says it once, and an error chain printed with
    /// its causes (`{:#}`) would say it again ("… (os error 13): Permission denied (os error 13)").
    #[error("{}: {}", path.display(), io_message(error))]
    Io { path: PathBuf, error: std::io::Error },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), error: source }
    }
}

/// An I/O error's message without the "(os error N)" its `Display` appends, lower-cased as
/// part of a sentence ("permission denied").
pub fn io_message(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = match e.raw_os_error() {
        Some(code) => text.strip_suffix(&format!(" (os error {code})")).map(str::to_owned).unwrap_or(text),
        None => text,
    };
    let mut chars = text.chars();
    match (chars.next(), chars.next()) {
        (Some(first), Some(second)) if first.is_uppercase() && second.is_lowercase() => {
            first.to_lowercase().chain(text[first.len_utf8()..].chars()).collect()
        }
        _ => text,
    }
}
