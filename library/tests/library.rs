//! The library over a real SQLite file and real context files made by the demo model:
//! migrations from empty, statuses that follow the files (ready, paused, prefilling, damaged,
//! missing), a rebuild from the files equal to the library that made them, and the errors of a
//! damaged, locked or newer database.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{DType, Device};
use folio_library::{ChatInfo, ContextInfo, Error, Library, NewMessage, Status};
use folio_models::context::{self, BuildOptions, DocumentText, KvDtype};
use folio_models::Engine;

fn engine() -> Engine {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/models/demo");
    Engine::load(demo.to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

fn document(title: &str, text: &str) -> DocumentText {
    DocumentText {
        title: title.into(),
        path: format!("/docs/{title}"),
        text: text.into(),
        bytes: text.len() as u64,
        xxh3: context::format::checksum(text.as_bytes()),
        kind: "text".into(),
        parts: Vec::new(),
    }
}

fn docs() -> Vec<DocumentText> {
    vec![
        document("notes.md", "the secret code of amber falcon is 4 1 7 ."),
        document("records.txt", "the access code of cobalt heron is 9 9 2 ."),
    ]
}

/// Prefills `docs` into `out`; with `stop_after`, cancels once that many layers are done.
fn prefill(e: &Engine, docs: &[DocumentText], out: &Path, stop_after: Option<usize>) {
    let plan = e.plan_context(docs, None, Some("25 Nov 2026".into())).unwrap();
    let opts = BuildOptions::new(KvDtype::Bf16);
    let mut on_progress = |p: &context::Progress| match stop_after {
        Some(n) if p.layer >= n => ControlFlow::Break(()),
        _ => ControlFlow::Continue(()),
    };
    let result = context::build(&e.model, e.stamp().unwrap(), &plan, out, &opts, &mut on_progress);
    assert_eq!(result.is_ok(), stop_after.is_none(), "{:?}", result.err());
}

/// A context's row without its id (which depends on the order rows were added).
fn described(c: &ContextInfo) -> ContextInfo {
    ContextInfo { id: 0, ..c.clone() }
}

#[tokio::test]
async fn a_new_library_is_migrated_with_wal_and_foreign_keys() {
    let home = tempfile::tempdir().unwrap();
    let lib = Library::open(home.path()).await.unwrap();
    assert!(lib.database().is_file());
    assert!(lib.contexts().await.unwrap().is_empty());
    lib.set_setting("attention", &serde_json::json!({"method": "hip"})).await.unwrap();
    lib.close().await;
    // Reopening runs no migration again and keeps what was written.
    let lib = Library::open(home.path()).await.unwrap();
    assert_eq!(lib.setting("attention").await.unwrap(), Some(serde_json::json!({"method": "hip"})));
    assert_eq!(lib.setting("never set").await.unwrap(), None);
    lib.close().await;

    let url = format!("sqlite://{}", home.path().join(folio_library::DATABASE_FILE).display());
    let raw = sqlx::SqlitePool::connect(&url).await.unwrap();
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(&raw).await.unwrap();
    assert_eq!(mode, "wal");
    let migrations: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations").fetch_one(&raw).await.unwrap();
    assert_eq!(migrations, 2);
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE '\\_%' ESCAPE '\\' ORDER BY name",
    )
    .fetch_all(&raw)
    .await
    .unwrap();
    assert_eq!(tables, ["chats", "contexts", "documents", "messages", "models", "settings"]);
}

#[tokio::test]
async fn contexts_follow_their_files() {
    let (home, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let e = engine();
    let out = dir.path().join("notes.folio");
    prefill(&e, &docs(), &out, None);
    let lib = Library::open(home.path()).await.unwrap();
    let c = lib.add_context(&out).await.unwrap();
    let file = context::ContextFile::open(&out).unwrap();
    assert_eq!((c.name.as_str(), c.status, c.problem.as_deref()), ("notes", Status::Ready, None));
    assert_eq!((c.tokens, c.layers_done, c.documents), (file.tokens().len() as u64, c.layers, 2));
    assert_eq!((c.file_bytes, c.kv_dtype.as_str()), (file.header().file_bytes, "bf16"));
    assert_eq!((c.model.name.as_str(), c.model.architecture.as_str()), ("demo", "llama"));
    assert_eq!(lib.models().await.unwrap(), [(c.model.clone(), 1)]);
    assert!(!c.change_pending);
    let docs = lib.documents(c.id).await.unwrap();
    let spans: Vec<_> = docs.iter().map(|d| (d.title.as_str(), d.kind.as_str(), d.token_start, d.token_end)).collect();
    let want: Vec<_> = file
        .documents()
        .iter()
        .zip(["text", "text"]) // what the reader named them (`document` says text), as staging does
        .map(|(d, kind)| (d.title.as_str(), kind, d.start as u64, d.end as u64))
        .collect();
    assert_eq!(spans, want);
    drop(file);
    assert_eq!(lib.find(&c.id.to_string()).await.unwrap(), c.id);
    assert_eq!(lib.find(out.to_str().unwrap()).await.unwrap(), c.id);
    assert!(lib.find("42").await.unwrap_err().to_string().contains("folio library list"));

    // Moved behind the library's back: missing; back: ready again.
    let moved = dir.path().join("elsewhere.bin");
    std::fs::rename(&out, &moved).unwrap();
    assert_eq!(lib.context(c.id).await.unwrap().status, Status::Missing);
    std::fs::rename(&moved, &out).unwrap();
    assert_eq!(lib.context(c.id).await.unwrap().status, Status::Ready);

    // A damaged header: damaged, with the reader's reason.
    let good = std::fs::read(&out).unwrap();
    let mut bad = good.clone();
    bad[40] ^= 0xff;
    std::fs::write(&out, &bad).unwrap();
    let damaged = lib.context(c.id).await.unwrap();
    assert_eq!(damaged.status, Status::Damaged);
    assert!(damaged.problem.as_deref().unwrap().contains("header is corrupted"), "{damaged:?}");
    std::fs::write(&out, &good).unwrap();
    assert_eq!(lib.context(c.id).await.unwrap().status, Status::Ready);

    // Rename renames the file; remove keeps it unless asked.
    let renamed = lib.rename_context(c.id, "amber and cobalt").await.unwrap();
    assert_eq!(renamed.path, dir.path().join("amber and cobalt.folio"));
    assert!(renamed.path.is_file() && !out.exists());
    for bad_name in ["", "a/b", ".hidden"] {
        assert!(matches!(lib.rename_context(c.id, bad_name).await, Err(Error::Refused(_))), "{bad_name:?}");
    }
    lib.remove_context(c.id, false).await.unwrap();
    assert!(lib.contexts().await.unwrap().is_empty() && renamed.path.is_file());
    assert!(lib.models().await.unwrap().is_empty(), "a model row lives as long as its contexts");
    let again = lib.add_context(&renamed.path).await.unwrap();
    lib.remove_context(again.id, true).await.unwrap();
    assert!(!renamed.path.exists());
    assert!(lib.add_context(&renamed.path).await.unwrap_err().to_string().contains("no context file or prefill"));
}

#[tokio::test]
async fn an_interrupted_prefill_is_listed_paused_and_a_running_one_prefilling() {
    let (home, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let e = engine();
    let out = dir.path().join("big.folio");
    prefill(&e, &docs(), &out, Some(1));
    let lib = Library::open(home.path()).await.unwrap();
    let c = lib.add_context(&out).await.unwrap();
    assert_eq!((c.status, c.layers_done, c.documents), (Status::Paused, 1, 2), "{c:?}");
    assert!(c.layers > 1);

    // A process holding the partial folder's lock is a prefill running now.
    let lock = std::fs::File::open(context::partial_dir(&out).join("lock")).unwrap();
    <std::fs::File as fs4::FileExt>::lock(&lock).unwrap();
    assert_eq!(lib.context(c.id).await.unwrap().status, Status::Prefilling);
    assert!(matches!(lib.remove_context(c.id, true).await, Err(Error::Refused(_))));
    drop(lock);

    // Resumed to the end: ready, same row.
    prefill(&e, &docs(), &out, None);
    let done = lib.context(c.id).await.unwrap();
    assert_eq!((done.status, done.layers_done), (Status::Ready, done.layers));
}

#[tokio::test]
async fn rebuild_from_the_files_equals_the_library_that_made_them() {
    let (made, rebuilt, dir) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let e = engine();
    let paths = [dir.path().join("a.folio"), dir.path().join("b.folio"), dir.path().join("c.folio")];
    prefill(&e, &docs(), &paths[0], None);
    prefill(&e, &docs()[..1], &paths[1], None);
    prefill(&e, &docs()[1..], &paths[2], Some(1));
    std::fs::write(dir.path().join("notes.txt"), "not a context").unwrap();
    std::fs::write(dir.path().join("broken.folio"), b"FOLIOCTX and then nothing").unwrap();

    let a = Library::open(made.path()).await.unwrap();
    // Added in another order than the rebuild's (sorted by path).
    for p in paths.iter().rev() {
        a.add_context(p).await.unwrap();
    }
    let b = Library::open(rebuilt.path()).await.unwrap();
    let report = b.rebuild(&[dir.path().to_owned()]).await.unwrap();
    assert_eq!(report.added.len(), 3);
    assert_eq!(report.skipped.len(), 1, "{report:?}");
    assert!(
        report.skipped[0].0.ends_with("broken.folio") && report.skipped[0].1.contains("not a Folio context file"),
        "{report:?}"
    );

    let (from_a, from_b) = (a.contexts().await.unwrap(), b.contexts().await.unwrap());
    let described = |cs: &[ContextInfo]| {
        let mut v: Vec<ContextInfo> = cs.iter().map(described).collect();
        v.sort_by(|x, y| x.path.cmp(&y.path));
        v
    };
    assert_eq!(described(&from_a), described(&from_b));
    for (x, y) in from_a.iter().zip(&from_b) {
        let (dx, dy) = (
            a.documents(x.id).await.unwrap(),
            b.documents(b.find(x.path.to_str().unwrap()).await.unwrap()).await.unwrap(),
        );
        assert_eq!(dx, dy, "{:?} vs {:?}", x.path, y.path);
    }

    // A second rebuild refreshes; a file deleted since is reported missing.
    std::fs::remove_file(&paths[1]).unwrap();
    let report = b.rebuild(&[dir.path().to_owned()]).await.unwrap();
    assert_eq!((report.added.len(), report.refreshed.len()), (0, 2));
    assert_eq!(report.missing, [paths[1].clone()]);
}

#[tokio::test]
async fn a_damaged_database_is_refused_then_set_aside_by_rebuild() {
    let home = tempfile::tempdir().unwrap();
    let db = home.path().join(folio_library::DATABASE_FILE);
    let garbage = b"this is not a database, and a library must not overwrite it".repeat(100);
    std::fs::write(&db, &garbage).unwrap();
    let err = Library::open(home.path()).await.err().expect("a damaged database is refused");
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("folio library rebuild"), "{err}");
    assert_eq!(std::fs::read(&db).unwrap(), garbage, "the damaged file is left as it was");

    let (lib, aside) = Library::rebuild_damaged(home.path()).await.unwrap();
    assert_eq!(std::fs::read(&aside).unwrap(), garbage, "kept, renamed");
    assert!(lib.contexts().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_locked_database_says_busy_and_a_newer_one_says_so() {
    let home = tempfile::tempdir().unwrap();
    let lib = Library::open(home.path()).await.unwrap();
    lib.close().await;
    let url = format!("sqlite://{}", home.path().join(folio_library::DATABASE_FILE).display());
    let raw = sqlx::SqlitePool::connect(&url).await.unwrap();
    let mut holder = raw.begin_with("BEGIN IMMEDIATE").await.unwrap();
    sqlx::query("INSERT INTO settings (key, value) VALUES ('x', '1')").execute(&mut *holder).await.unwrap();
    let other = Library::open_with(home.path(), Duration::from_millis(200)).await.unwrap();
    let err = other.set_setting("y", &serde_json::json!(2)).await.unwrap_err();
    assert!(matches!(err, Error::Busy { .. }), "{err:?}");
    assert!(err.to_string().contains("another Folio process"), "{err}");
    holder.commit().await.unwrap();
    other.set_setting("y", &serde_json::json!(2)).await.unwrap();
    other.close().await;

    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (99990101000000, 'from the future', 1, x'00', 0)",
    )
    .execute(&raw)
    .await
    .unwrap();
    let err = Library::open(home.path()).await.err().expect("a newer schema is refused");
    assert!(matches!(err, Error::Newer { .. }) && err.to_string().contains("newer Folio"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handles_write_at_once() {
    let (home, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out: PathBuf = dir.path().join("shared.folio");
    prefill(&engine(), &docs(), &out, None);
    let (a, b) = (Library::open(home.path()).await.unwrap(), Library::open(home.path()).await.unwrap());
    let writer = |lib: Library, tag: &'static str| {
        let out = out.clone();
        tokio::spawn(async move {
            for i in 0..40 {
                lib.set_setting(&format!("{tag}{i}"), &serde_json::json!(i)).await.unwrap();
                lib.add_context(&out).await.unwrap();
                lib.contexts().await.unwrap();
            }
        })
    };
    let (x, y) = (writer(a.clone(), "a"), writer(b.clone(), "b"));
    x.await.unwrap();
    y.await.unwrap();
    assert_eq!(a.contexts().await.unwrap().len(), 1);
    assert_eq!(b.setting("a39").await.unwrap(), Some(serde_json::json!(39)));
}

/// An interrupted addition to a saved context leaves the context ready as it was (its file
/// still opens and chats); the library does not hide it as paused.
#[tokio::test]
async fn an_interrupted_addition_leaves_the_context_ready() {
    let (home, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let e = engine();
    let out = dir.path().join("grown.folio");
    prefill(&e, &docs()[..1], &out, None);
    let lib = Library::open(home.path()).await.unwrap();
    let before = lib.add_context(&out).await.unwrap();
    let base = context::ContextFile::open(&out).unwrap();
    let plan = e.plan_append(&base, &docs()[1..]).unwrap();
    let opts = BuildOptions::new(KvDtype::Bf16);
    let mut stop =
        |p: &context::Progress| if p.layer >= 1 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) };
    assert!(context::append(&e.model, e.stamp().unwrap(), &base, &plan, &out, &opts, &mut stop).is_err());
    assert!(context::partial_dir(&out).join("checkpoint.json").is_file());
    let now = lib.context(before.id).await.unwrap();
    assert_eq!((now.status, now.tokens, now.documents), (Status::Ready, before.tokens, 1), "{now:?}");
    assert!(
        matches!(lib.rename_context(before.id, "other").await, Err(Error::Refused(m)) if m.contains("interrupted"))
    );
}

/// The portable file: an export is a verified, identical copy that never overwrites; an import
/// verifies every checksum (a broken copy is refused, naming the damaged section) and copies
/// the file into the library's folder under a free name.
#[tokio::test]
async fn export_and_import_carry_a_context_between_libraries() {
    let (a_home, b_home, dir) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let e = engine();
    let made = dir.path().join("made.folio");
    prefill(&e, &docs(), &made, None);
    let a = Library::open(a_home.path()).await.unwrap();
    let c = a.add_context(&made).await.unwrap();
    let carried = dir.path().join("usb");
    std::fs::create_dir(&carried).unwrap();
    let copy = a.export(c.id, &carried).await.unwrap();
    assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&made).unwrap());
    assert!(matches!(a.export(c.id, &carried).await, Err(Error::Refused(m)) if m.contains("already exists")));

    let b = Library::open(b_home.path()).await.unwrap();
    let imported = b.import(&copy, true).await.unwrap();
    assert_eq!(imported.path, b.contexts_folder().join("made.folio"));
    assert_eq!(
        described(&ContextInfo { path: made.clone(), saved_at: String::new(), ..imported.clone() }),
        described(&ContextInfo { saved_at: String::new(), ..c.clone() })
    );
    let again = b.import(&copy, true).await.unwrap();
    assert_eq!(again.path, b.contexts_folder().join("made (2).folio"));

    // A copy damaged on the way is refused and listed nowhere.
    let mut bytes = std::fs::read(&copy).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0xff;
    let broken = dir.path().join("broken.folio");
    std::fs::write(&broken, &bytes).unwrap();
    let err = b.import(&broken, true).await.unwrap_err().to_string();
    assert!(err.contains("corrupted"), "{err}");
    assert_eq!(b.contexts().await.unwrap().len(), 2);
}

/// Chats over a context and over the bare model: messages appended in order with their
/// details, listed newest first, searched by title or content, renamed, forked and truncated at
/// whole turns, settings kept; removing the context removes its chats; a deleted chat is gone.
#[tokio::test]
async fn chats_keep_their_messages_and_settings() {
    let (home, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let e = engine();
    let out = dir.path().join("notes.folio");
    prefill(&e, &docs(), &out, None);
    let lib = Library::open(home.path()).await.unwrap();
    let ctx = lib.add_context(&out).await.unwrap();
    let over = lib.create_chat(Some(ctx.id), "  \nwhat is the code of amber falcon?\nmore").await.unwrap();
    assert_eq!(
        (over.title.as_str(), over.context_name.as_deref(), over.messages),
        ("what is the code of amber falcon?", Some("notes"), 0)
    );
    let details = serde_json::json!({"method": {"method": "hip", "budget": "10%"}, "first_token_s": 0.1});
    let turn = |q: &'static str, a: &'static str| {
        [
            NewMessage { role: "user", content: q, details: None },
            NewMessage { role: "assistant", content: a, details: Some(&details) },
        ]
    };
    lib.append_messages(over.id, &turn("what is the code?", "4 8 1 5 2")).await.unwrap();
    let after = lib.append_messages(over.id, &turn("and the market?", "closed on sunday")).await.unwrap();
    assert_eq!(after.messages, 4);
    let bare = lib.create_chat(None, "hello").await.unwrap();
    assert_eq!(bare.context_name, None);
    let msgs = lib.messages(over.id).await.unwrap();
    let roles: Vec<(u64, &str, &str)> =
        msgs.iter().map(|m| (m.position, m.role.as_str(), m.content.as_str())).collect();
    assert_eq!(
        roles,
        [
            (0, "user", "what is the code?"),
            (1, "assistant", "4 8 1 5 2"),
            (2, "user", "and the market?"),
            (3, "assistant", "closed on sunday")
        ]
    );
    assert_eq!(msgs[1].details.as_ref(), Some(&details));
    let compared = serde_json::json!({"method": "hip", "comparison": {"mean_kl": 0.01}});
    lib.set_message_details(over.id, 3, &compared).await.unwrap();
    assert_eq!(lib.messages(over.id).await.unwrap()[3].details.as_ref(), Some(&compared));
    assert!(lib.set_message_details(over.id, 9, &compared).await.unwrap_err().to_string().contains("no message 9"));
    assert!(lib.append_messages(over.id, &[NewMessage { role: "system", content: "x", details: None }]).await.is_err());

    // Newest first; search by content and title; LIKE's wildcards are taken literally.
    let ids = |list: Vec<ChatInfo>| list.iter().map(|c| c.id).collect::<Vec<_>>();
    assert_eq!(ids(lib.chats(None).await.unwrap()), [bare.id, over.id]);
    assert_eq!(ids(lib.chats(Some("SUNDAY")).await.unwrap()), [over.id]);
    assert_eq!(ids(lib.chats(Some("hello")).await.unwrap()), [bare.id]);
    assert!(lib.chats(Some("%")).await.unwrap().is_empty());

    lib.set_chat_settings(over.id, &serde_json::json!({"method": "magicpig"})).await.unwrap();
    let renamed = lib.rename_chat(over.id, "amber falcon").await.unwrap();
    assert_eq!(
        (renamed.title.as_str(), renamed.settings.clone()),
        ("amber falcon", Some(serde_json::json!({"method": "magicpig"})))
    );
    assert!(lib.rename_chat(over.id, "   ").await.is_err());
    let fork = lib.fork_chat(over.id, 2).await.unwrap();
    assert_eq!((fork.messages, fork.context_id, fork.title.as_str()), (2, Some(ctx.id), "amber falcon (fork)"));
    assert_eq!(fork.settings, renamed.settings);
    assert!(lib.fork_chat(over.id, 3).await.unwrap_err().to_string().contains("whole turns"));
    assert_eq!(lib.truncate_chat(over.id, 2).await.unwrap().messages, 2);
    assert_eq!(lib.messages(fork.id).await.unwrap().len(), 2, "a fork is its own copy");

    lib.delete_chat(bare.id).await.unwrap();
    assert!(lib.chat(bare.id).await.unwrap_err().to_string().contains("no chat"));
    lib.remove_context(ctx.id, false).await.unwrap();
    assert!(lib.chats(None).await.unwrap().is_empty(), "a context's chats go with it");
    assert!(lib.create_chat(Some(ctx.id), "x").await.unwrap_err().to_string().contains("no context"));
}
