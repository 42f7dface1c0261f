//! Folio's log: what a person attaches to a problem report, as Jan and LM Studio keep one.
//! The engine, the server and the window emit `tracing` events — a model loaded, a context
//! written or opened, an answer, a request served, a job that failed — each with its figures
//! and its duration; this module writes them to a file a day in `$FOLIO_HOME/logs/` (the last
//! [`KEPT_FILES`] kept) and, for the CLI, to stderr when `RUST_LOG` asks (`folio serve` shows
//! its requests there by default: a server's console is its log).
//!
//! What never goes in: the documents' text and the questions' and answers' text. The events
//! carry counts, paths, model names and times only, so a log can be attached as it is.
//!
//! `FOLIO_LOG` sets the file's filter and `RUST_LOG` stderr's (tracing's syntax, e.g.
//! `folio_server=debug`); the file's default is `info`. A log that cannot be written (a
//! read-only home) costs nothing but itself: Folio runs on, and says so once on stderr.

use std::path::PathBuf;

use tracing_appender::non_blocking::WorkerGuard;
use tracing_appender::rolling::{RollingFileAppender, Rotation};
use tracing_subscriber::filter::EnvFilter;
use tracing_subscriber::fmt;
use tracing_subscriber::prelude::*;

/// The folder of the log files, in Folio's home.
pub const LOGS_FOLDER: &str = "logs";
/// Log files are `folio.YYYY-MM-DD.log`.
const FILE_PREFIX: &str = "folio";
const FILE_SUFFIX: &str = "log";
/// Daily files kept: a week of use.
const KEPT_FILES: usize = 7;
/// The file's filter when `FOLIO_LOG` does not say.
const FILE_FILTER: &str = "info";

/// Keeps the file's writer thread alive: dropped at exit, it flushes what is queued.
pub struct Logging {
    _file: Option<WorkerGuard>,
}

/// The folder the log is written to.
pub fn folder() -> Option<PathBuf> {
    folio_library::home().ok().map(|h| h.join(LOGS_FOLDER))
}

/// Starts the log: the daily file always, and stderr (the CLI's; the window has no terminal)
/// with `RUST_LOG`'s filter, else `stderr_default` ("off": a command reports its own errors
/// and prints its own progress).
pub fn start(stderr_default: Option<&str>) -> Logging {
    let filter = |var: &str, default: &str| EnvFilter::try_from_env(var).unwrap_or_else(|_| EnvFilter::new(default));
    let (file, guard) = match file_writer() {
        Ok(appender) => {
            let (writer, guard) = tracing_appender::non_blocking(appender);
            let layer = fmt::layer().with_ansi(false).with_writer(writer).with_filter(filter("FOLIO_LOG", FILE_FILTER));
            (Some(layer), Some(guard))
        }
        Err(why) => {
            eprintln!("warning: no log file: {why}");
            (None, None)
        }
    };
    let stderr = stderr_default.map(|default| {
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_filter(filter("RUST_LOG", default))
    });
    // Only fails when a subscriber is set already (a test harness's): that one keeps the events.
    let _ = tracing_subscriber::registry().with(file).with(stderr).try_init();
    Logging { _file: guard }
}

fn file_writer() -> Result<RollingFileAppender, String> {
    let folder = folder().ok_or("Folio's home folder is unknown")?;
    std::fs::create_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
    RollingFileAppender::builder()
        .rotation(Rotation::DAILY)
        .filename_prefix(FILE_PREFIX)
        .filename_suffix(FILE_SUFFIX)
        .max_log_files(KEPT_FILES)
        .build(&folder)
        .map_err(|e| format!("{}: {e}", folder.display()))
}
