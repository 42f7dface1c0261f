//! `folio library ...`: the library the window shows, from the terminal (list, show, remove,
//! rename, rebuild), and the hook by which `folio prefill` registers what it makes.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use folio_library::{ContextInfo, Library, Status};
use folio_models::context::PrefillCost;
use folio_models::error::human_bytes;
use folio_models::prefill::PrefillMode;
use serde_json::json;

use crate::listing::{Listing, PrefillKeys};

#[derive(Subcommand)]
pub enum LibraryCommand {
    /// Every context in the library, newest first, with its status as its file says.
    List(JsonArg),
    /// One context (by id or file path) with its documents.
    Show(KeyArgs),
    /// Take a context out of the library; --delete-file deletes its file too.
    Remove(RemoveArgs),
    /// Rename a context (its file is renamed in its folder).
    Rename(RenameArgs),
    /// Add a context file made elsewhere (the portable file: prefill on a big GPU, chat on a
    /// laptop): every checksum is verified, then it is copied into the library's contexts
    /// folder (or listed where it is, with --in-place).
    Import(ImportArgs),
    /// Copy a ready context's file to a folder or a new path (atomically; never overwrites).
    Export(ExportArgs),
    /// Add or refresh every context file in the folders (default: the library's contexts
    /// folder) and check every listed context against its file. A database that cannot be
    /// opened is set aside, kept, and a new one made from the files.
    Rebuild(RebuildArgs),
}

#[derive(Args)]
pub struct JsonArg {
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct KeyArgs {
    /// The context's id (from `folio library list`) or its file's path.
    context: String,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RemoveArgs {
    context: String,
    /// Also delete the context file and any interrupted prefill of it.
    #[arg(long)]
    delete_file: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RenameArgs {
    context: String,
    /// The new name (the file keeps its folder and extension).
    name: String,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ImportArgs {
    file: PathBuf,
    /// List it where it is instead of copying it into the library's folder.
    #[arg(long)]
    in_place: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ExportArgs {
    context: String,
    /// A folder, or the path of the copy.
    dest: PathBuf,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RebuildArgs {
    folders: Vec<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// The CLI's async runtime: one thread, for the library's queries.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")
}

pub fn library(cmd: LibraryCommand) -> Result<()> {
    let rt = runtime()?;
    rt.block_on(async {
        if let LibraryCommand::Rebuild(a) = cmd {
            return rebuild(a).await;
        }
        let lib = Library::open_default().await?;
        match cmd {
            LibraryCommand::List(a) => list(&lib, a.json).await,
            LibraryCommand::Show(a) => show(&lib, &a.context, a.json).await,
            LibraryCommand::Remove(a) => {
                let id = lib.find(&a.context).await?;
                let info = lib.remove_context(id, a.delete_file).await?;
                if a.json {
                    println!("{}", json!({ "removed": info, "file_deleted": a.delete_file }));
                } else if a.delete_file {
                    println!("removed {} and deleted {}", info.name, info.path.display());
                } else {
                    println!("removed {} from the library (the file stays at {})", info.name, info.path.display());
                }
                Ok(())
            }
            LibraryCommand::Rename(a) => {
                let id = lib.find(&a.context).await?;
                let info = lib.rename_context(id, &a.name).await?;
                if a.json {
                    println!("{}", json!({ "renamed": info }));
                } else {
                    println!("renamed to {} ({})", info.name, info.path.display());
                }
                Ok(())
            }
            LibraryCommand::Import(a) => {
                let info = lib.import(&a.file, !a.in_place).await?;
                if a.json {
                    println!("{}", json!({ "imported": info }));
                } else {
                    println!("imported {} ({} tokens, verified) as {}", info.name, info.tokens, info.path.display());
                }
                Ok(())
            }
            LibraryCommand::Export(a) => {
                let id = lib.find(&a.context).await?;
                let to = lib.export(id, &a.dest).await?;
                if a.json {
                    println!("{}", json!({ "exported": to }));
                } else {
                    println!("exported to {}", to.display());
                }
                Ok(())
            }
            LibraryCommand::Rebuild(_) => unreachable!("handled above"),
        }
    })
}

async fn list(lib: &Library, as_json: bool) -> Result<()> {
    let contexts = lib.contexts().await?;
    if as_json {
        println!("{}", json!({ "library": lib.database(), "contexts": contexts }));
        return Ok(());
    }
    if contexts.is_empty() {
        println!("the library {} lists no contexts yet: `folio prefill` adds them", lib.database().display());
        return Ok(());
    }
    println!(
        "{:>4}  {:<24} {:<18} {:>10} {:>5} {:>10}  {:<12} SAVED",
        "ID", "NAME", "STATUS", "TOKENS", "DOCS", "SIZE", "MODEL"
    );
    for c in &contexts {
        println!(
            "{:>4}  {:<24} {:<18} {:>10} {:>5} {:>10}  {:<12} {}",
            c.id,
            c.name,
            status_text(c),
            c.tokens,
            c.documents,
            human_bytes(c.file_bytes),
            c.model.name,
            c.saved_at
        );
    }
    Ok(())
}

/// "ready", "paused at layer 3/8", "damaged: why".
fn status_text(c: &ContextInfo) -> String {
    match c.status {
        Status::Paused | Status::Prefilling => {
            format!("{} {}/{}", c.status.as_str(), c.layers_done, c.layers)
        }
        s => s.as_str().to_owned(),
    }
}

async fn show(lib: &Library, key: &str, as_json: bool) -> Result<()> {
    let id = lib.find(key).await?;
    let c = lib.context(id).await?;
    let docs = lib.documents(id).await?;
    if as_json {
        println!("{}", json!({ "context": c, "documents": docs }));
        return Ok(());
    }
    println!("context      {} (id {})", c.name, c.id);
    println!("file         {} ({})", c.path.display(), human_bytes(c.file_bytes));
    println!("status       {}", status_text(&c));
    if let Some(why) = &c.problem {
        println!("problem      {why}");
    }
    println!("model        {} ({}; load with --model {})", c.model.name, c.model.architecture, c.model.source);
    println!("tokens       {} in {} layers, {} K/V", c.tokens, c.layers, c.kv_dtype);
    println!("saved        {}", c.saved_at);
    println!("documents    {}", docs.len());
    for d in &docs {
        println!("  {:>9} tokens  {:<5} {:>10}  {}", d.token_end - d.token_start, d.kind, human_bytes(d.bytes), d.path);
    }
    match c.status {
        Status::Paused => println!("resume       run the same `folio prefill` again"),
        Status::Missing => println!("missing      the file is gone: put it back, or `folio library remove {}`", c.id),
        _ => {}
    }
    Ok(())
}

async fn rebuild(a: RebuildArgs) -> Result<()> {
    let (lib, set_aside, report) = Library::rebuild_home(&folio_library::home()?, &a.folders).await?;
    if a.json {
        println!("{}", json!({ "library": lib.database(), "set_aside": set_aside, "report": report }));
        return Ok(());
    }
    if let Some(aside) = &set_aside {
        println!("the damaged library was set aside as {}", aside.display());
    }
    let names = |ps: &[PathBuf]| ps.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    println!(
        "{}: {} added, {} refreshed, {} missing, {} skipped",
        lib.database().display(),
        report.added.len(),
        report.refreshed.len(),
        report.missing.len(),
        report.skipped.len()
    );
    if !report.missing.is_empty() {
        println!("missing: {}", names(&report.missing));
    }
    for (p, why) in &report.skipped {
        println!("skipped {}: {why}", p.display());
    }
    Ok(())
}

/// How `folio prefill` keeps the library up to date ([`Listing`]), on a runtime of its own;
/// `None` (with a warning) when the library cannot be opened: it never costs the prefill.
pub(crate) fn listing(keys: PrefillKeys, changes_a_file: bool) -> Option<Listing> {
    let attempt = || -> Result<Listing> {
        let rt = runtime()?;
        let lib = rt.block_on(Library::open_default())?;
        Ok(Listing::new(lib, Box::new(move |f| rt.block_on(f)), Some(keys), changes_a_file))
    };
    attempt().map_err(|e| warn(&e)).ok()
}

/// Each of `modes` with the last cost of its kind under `keys` (none where the library has
/// none, or cannot be read).
pub(crate) fn stored_costs(keys: &PrefillKeys, modes: Vec<PrefillMode>) -> Vec<(PrefillMode, Option<PrefillCost>)> {
    let unknown: Vec<_> = modes.iter().map(|m| (*m, None)).collect();
    let Ok(rt) = runtime() else { return unknown };
    rt.block_on(async {
        let lib = Library::open_default().await.ok()?;
        keys.read_all(&lib, modes).await.ok()
    })
    .unwrap_or(unknown)
}

fn warn(e: &anyhow::Error) {
    eprintln!("warning: the library was not updated ({e:#}); `folio library rebuild` adds the context later");
}
