//! The library through the `folio` binary: `folio prefill` lists what it makes (unless
//! `--no-library`), `folio library list|show|rename|remove|rebuild` read and edit it, a damaged
//! database is refused with what to do, and the CLI and the window's backend (the
//! folio-library crate, in this process) use one database at once. Real SQLite files, real
//! processes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use folio_library::{Library, Status};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn demo() -> String {
    root().join("assets/models/demo").display().to_string()
}

fn samples() -> String {
    root().join("assets/samples").display().to_string()
}

/// `folio ARGS` with the library in `home`.
fn folio(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_folio"))
        .args(args)
        .args(["--device", "cpu"])
        .env("FOLIO_HOME", home)
        .output()
        .expect("run folio")
}

fn ok_json(out: Output) -> Value {
    assert!(out.status.success(), "folio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn err_text(out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "expected a clean error: {stderr}");
    stderr
}

fn prefill(home: &Path, out: &Path, extra: &[&str]) -> Value {
    let (o, m, d) = (out.display().to_string(), demo(), samples());
    let mut args = vec!["prefill", "--model", &m, "--docs", &d, "--out", &o, "--json"];
    args.extend_from_slice(extra);
    ok_json(folio(home, &args))
}

fn list(home: &Path) -> Vec<Value> {
    ok_json(folio(home, &["library", "list", "--json"]))["contexts"].as_array().unwrap().clone()
}

#[test]
fn prefill_lists_its_context_and_the_library_commands_read_and_edit_it() {
    let (home, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let h = home.path();
    let listed = work.path().join("samples.folio");
    let report = prefill(h, &listed, &[]);
    prefill(h, &work.path().join("unlisted.folio"), &["--no-library"]);
    let contexts = list(h);
    assert_eq!(contexts.len(), 1, "{contexts:?}");
    let c = &contexts[0];
    assert_eq!((c["name"].as_str(), c["status"].as_str()), (Some("samples"), Some("ready")));
    assert_eq!(c["tokens"], report["report"]["tokens"]);
    assert_eq!(c["documents"], 3);
    assert_eq!(c["file_bytes"], report["report"]["file_bytes"]);
    assert_eq!(c["model"]["name"], "demo");

    let shown = ok_json(folio(h, &["library", "show", listed.to_str().unwrap(), "--json"]));
    let docs: Vec<(&str, u64)> = shown["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["title"].as_str().unwrap(), d["token_end"].as_u64().unwrap() - d["token_start"].as_u64().unwrap()))
        .collect();
    let spans: Vec<(&str, u64)> = report["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["title"].as_str().unwrap(), d["end"].as_u64().unwrap() - d["start"].as_u64().unwrap()))
        .collect();
    assert_eq!(docs, spans);
    let text = String::from_utf8(folio(h, &["library", "show", "1"]).stdout).unwrap();
    assert!(text.contains("the_diary_of_greta.txt") && text.contains("ready"), "{text}");

    let id = c["id"].to_string();
    let renamed = ok_json(folio(h, &["library", "rename", &id, "greta and friends", "--json"]));
    let path = PathBuf::from(renamed["renamed"]["path"].as_str().unwrap());
    assert_eq!(path, work.path().join("greta and friends.folio"));
    assert!(path.is_file() && !listed.exists());

    // Moved behind the library's back: listed as missing, and `show` says what to do.
    let moved = work.path().join("moved.folio");
    std::fs::rename(&path, &moved).unwrap();
    assert_eq!(list(h)[0]["status"], "missing");
    let text = String::from_utf8(folio(h, &["library", "show", &id]).stdout).unwrap();
    assert!(text.contains("put it back") && text.contains("folio library remove"), "{text}");
    std::fs::rename(&moved, &path).unwrap();

    // The portable file: exported, then imported (verified, copied) into another library.
    let usb = tempfile::tempdir().unwrap();
    let exported = ok_json(folio(h, &["library", "export", &id, usb.path().to_str().unwrap(), "--json"]));
    let copy = exported["exported"].as_str().unwrap().to_owned();
    let other = tempfile::tempdir().unwrap();
    let imported = ok_json(folio(other.path(), &["library", "import", &copy, "--json"]));
    assert_eq!(imported["imported"]["tokens"], c["tokens"]);
    assert!(imported["imported"]["path"].as_str().unwrap().starts_with(other.path().to_str().unwrap()));

    let err = err_text(folio(h, &["library", "show", "999"]));
    assert!(err.contains("no context \"999\"") && err.contains("folio library list"), "{err}");
    ok_json(folio(h, &["library", "remove", &id, "--delete-file", "--json"]));
    assert!(list(h).is_empty() && !path.exists());
}

#[test]
fn rebuild_from_the_files_lists_what_prefill_listed() {
    let (home, rebuilt, work) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    prefill(home.path(), &work.path().join("one.folio"), &[]);
    prefill(home.path(), &work.path().join("two.folio"), &["--kv-dtype", "fp8"]);
    let w = work.path().to_str().unwrap();
    let report = ok_json(folio(rebuilt.path(), &["library", "rebuild", w, "--json"]));
    assert_eq!(report["report"]["added"].as_array().unwrap().len(), 2, "{report}");
    let without_ids = |mut cs: Vec<Value>| {
        for c in &mut cs {
            c["id"] = Value::Null;
        }
        cs.sort_by_key(|c| c["path"].as_str().unwrap().to_owned());
        cs
    };
    assert_eq!(without_ids(list(home.path())), without_ids(list(rebuilt.path())));
}

#[test]
fn a_damaged_library_is_refused_with_what_to_do_and_rebuild_sets_it_aside() {
    let (home, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let h = home.path();
    let ctx = work.path().join("kept.folio");
    prefill(h, &ctx, &[]);
    let db = h.join(folio_library::DATABASE_FILE);
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    std::fs::write(&db, b"garbage, not SQLite".repeat(300)).unwrap();
    let err = err_text(folio(h, &["library", "list"]));
    assert!(err.contains("cannot be opened") && err.contains("folio library rebuild"), "{err}");
    // A prefill still runs: the library is a convenience, never the prefill's cost.
    let out = Command::new(env!("CARGO_BIN_EXE_folio"))
        .args(["prefill", "--model", &demo(), "--docs", &samples(), "--out"])
        .arg(work.path().join("second.folio"))
        .args(["--device", "cpu"])
        .env("FOLIO_HOME", h)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the library was not updated"));

    let report = ok_json(folio(h, &["library", "rebuild", work.path().to_str().unwrap(), "--json"]));
    let aside = PathBuf::from(report["set_aside"].as_str().unwrap());
    assert!(aside.is_file() && std::fs::read(&aside).unwrap().starts_with(b"garbage"));
    let names: Vec<String> = list(h).iter().map(|c| c["name"].as_str().unwrap().to_owned()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

/// The window's backend (this process, through folio-library) lists and writes settings while
/// `folio prefill` processes register contexts in the same database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_and_the_backend_share_one_database_at_once() {
    let (home, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let lib = Library::open(home.path()).await.unwrap();
    let outs: Vec<PathBuf> = (0..3).map(|i| work.path().join(format!("c{i}.folio"))).collect();
    let children: Vec<_> = outs
        .iter()
        .map(|o| {
            Command::new(env!("CARGO_BIN_EXE_folio"))
                .args(["prefill", "--model", &demo(), "--docs", &samples(), "--out"])
                .arg(o)
                .args(["--device", "cpu", "--json"])
                .env("FOLIO_HOME", home.path())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut i = 0;
    let mut running = children;
    while !running.is_empty() {
        lib.set_setting("backend.tick", &serde_json::json!(i)).await.unwrap();
        lib.contexts().await.unwrap();
        i += 1;
        let mut still = Vec::new();
        for mut c in running {
            match c.try_wait().unwrap() {
                Some(_) => {
                    let out = c.wait_with_output().unwrap();
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    assert!(out.status.success() && !stderr.contains("warning"), "{stderr}");
                }
                None => still.push(c),
            }
        }
        running = still;
    }
    let contexts = lib.contexts().await.unwrap();
    assert_eq!(contexts.len(), 3);
    assert!(contexts.iter().all(|c| c.status == Status::Ready), "{contexts:?}");
    assert!(i > 1, "the backend ran while the prefills did");
}
