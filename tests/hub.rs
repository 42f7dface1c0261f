//! Models from the Hugging Face hub (issue #45): a repo id that is not cached downloads into the
//! standard HF cache with huggingface_hub's layout and loads offline afterwards; a connection
//! dropped mid-file and a download killed midway go on from where they broke (a Range request);
//! an unknown repo and a full disk are said in words, and nothing is lost. Against a hub on
//! loopback (HF_ENDPOINT) serving the tiny Llama of the fixtures.

#[path = "common/cli.rs"]
mod cli;
#[path = "common/hub.rs"]
mod hub;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use hub::{Faults, Hub, COMMIT};

fn llama() -> PathBuf {
    cli::root().join("tests/fixtures/models/llama")
}

/// `folio ARGS` against `hub`, with the HF cache under `hf_home`.
fn folio(hub: &Hub, hf_home: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_folio"));
    cmd.args(args)
        .args(["--device", "cpu"])
        .env("HF_HOME", hf_home)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("FOLIO_HOME", hf_home.join("folio"))
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN");
    cmd
}

fn ok(out: Output) -> String {
    assert!(out.status.success(), "folio failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The repo's folder in the cache.
fn repo_dir(hf_home: &Path) -> PathBuf {
    hf_home.join("hub/models--folio-test--llama")
}

#[test]
fn a_model_downloads_into_the_hf_cache_and_loads_offline_after() {
    let hub = Hub::start(&llama(), "llama", Faults::default());
    let home = tempfile::tempdir().unwrap();
    let info = ok(folio(&hub, home.path(), &["info", "--model", "folio-test/llama", "--json"]).output().unwrap());
    assert!(info.contains("\"llama\""), "{info}");
    // huggingface_hub's layout: refs/main names the commit, each snapshot file links to its blob.
    let dir = repo_dir(home.path());
    assert_eq!(std::fs::read_to_string(dir.join("refs/main")).unwrap(), COMMIT);
    let weights = dir.join("snapshots").join(COMMIT).join("model.safetensors");
    let target = std::fs::read_link(&weights).unwrap();
    assert!(target.starts_with("../../blobs"), "{}", target.display());
    assert_eq!(std::fs::read(&weights).unwrap(), std::fs::read(llama().join("model.safetensors")).unwrap());
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]
    {
        assert!(dir.join("snapshots").join(COMMIT).join(f).exists(), "{f}");
    }
    // No network needed any more.
    let offline =
        folio(&hub, home.path(), &["info", "--model", "folio-test/llama"]).env("HF_HUB_OFFLINE", "1").output();
    ok(offline.unwrap());
    let log: String = std::fs::read_dir(home.path().join("folio/logs"))
        .unwrap()
        .map(|f| std::fs::read_to_string(f.unwrap().path()).unwrap())
        .collect();
    assert!(log.contains("model downloaded") && log.contains("repo=folio-test/llama"), "{log}");
}

#[test]
fn a_dropped_connection_goes_on_from_where_it_broke() {
    let hub = Hub::start(&llama(), "llama", Faults { drop_once: Some(200_000), ..Faults::default() });
    let home = tempfile::tempdir().unwrap();
    ok(folio(&hub, home.path(), &["info", "--model", "folio-test/llama"]).output().unwrap());
    assert!(hub.dropped() && hub.ranges() >= 1, "dropped {}, ranges {}", hub.dropped(), hub.ranges());
    let weights = repo_dir(home.path()).join("snapshots").join(COMMIT).join("model.safetensors");
    assert_eq!(std::fs::read(weights).unwrap(), std::fs::read(llama().join("model.safetensors")).unwrap());
}

#[test]
fn a_download_killed_midway_goes_on_from_where_it_stopped() {
    let hub = Hub::start(&llama(), "llama", Faults { slow: Some(Duration::from_millis(20)), ..Faults::default() });
    let home = tempfile::tempdir().unwrap();
    let mut child = folio(&hub, home.path(), &["info", "--model", "folio-test/llama"]).spawn().unwrap();
    let blobs = repo_dir(home.path()).join("blobs");
    let started = Instant::now();
    let partial = loop {
        let found = std::fs::read_dir(&blobs).into_iter().flatten().flatten().map(|e| e.path()).find(|p| {
            p.extension().is_some_and(|e| e == "incomplete") && std::fs::metadata(p).is_ok_and(|m| m.len() > 50_000)
        });
        if let Some(p) = found {
            break p;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "no partial weights appeared");
        std::thread::sleep(Duration::from_millis(20));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    let kept = std::fs::metadata(&partial).unwrap().len();
    assert!(kept > 0 && kept < 602_984, "{kept}");
    ok(folio(&hub, home.path(), &["info", "--model", "folio-test/llama"]).output().unwrap());
    assert!(hub.ranges() >= 1, "the second run started over");
    assert!(!partial.exists());
}

#[test]
fn an_unknown_repo_and_a_full_disk_are_said_in_words() {
    let hub = Hub::start(&llama(), "llama", Faults::default());
    let home = tempfile::tempdir().unwrap();
    let err = cli::err_text(folio(&hub, home.path(), &["info", "--model", "folio-test/nothing"]).output().unwrap());
    assert!(err.contains("no model folio-test/nothing at revision main"), "{err}");
    // A full disk (a file-size limit: what a full disk is to one process) under the weights.
    let mut cmd = folio(&hub, home.path(), &["info", "--model", "folio-test/llama"]);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 100 << 10, rlim_max: 100 << 10 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let err = cli::err_text(cmd.output().unwrap());
    assert!(err.contains("the disk is full") && err.contains("model.safetensors"), "{err}");
    // Room again: the download goes on from what arrived.
    ok(folio(&hub, home.path(), &["info", "--model", "folio-test/llama"]).output().unwrap());
    assert!(hub.ranges() >= 1);
}

/// A sharded model killed among its shards (the index and some shards in the cache) is not taken
/// for a whole one: the next run goes on with the rest and loads it.
#[test]
fn a_sharded_download_killed_among_its_shards_goes_on() {
    let qwen3 = cli::root().join("tests/fixtures/models/qwen3");
    let hub = Hub::start(&qwen3, "qwen3", Faults { slow: Some(Duration::from_millis(20)), ..Faults::default() });
    let home = tempfile::tempdir().unwrap();
    let mut child = folio(&hub, home.path(), &["info", "--model", "folio-test/qwen3"]).spawn().unwrap();
    let snapshot = home.path().join("hub/models--folio-test--qwen3/snapshots").join(COMMIT);
    let started = Instant::now();
    while !snapshot.join("model-00002-of-00005.safetensors").exists() {
        assert!(started.elapsed() < Duration::from_secs(60), "the second shard never arrived");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!snapshot.join("model-00005-of-00005.safetensors").exists(), "the download finished before the kill");
    let info = ok(folio(&hub, home.path(), &["info", "--model", "folio-test/qwen3"])
        .env("HF_HUB_OFFLINE", "0")
        .output()
        .unwrap());
    assert!(info.contains("qwen3"), "{info}");
    assert!(snapshot.join("model-00005-of-00005.safetensors").exists());
}
