//! The WebDriver side of the window tests (tests/gui_library.rs, tests/gui_chat.rs): tauri-driver
//! on fresh ports, a session on the Folio app, screenshots of the X screen, the moves on the
//! window that the tests repeat (drops, Settings, the contexts' statuses), and the app killed
//! mid-prefill. Expects the including file to declare `mod xvfb` (tests/common/xvfb.rs) beside it.
#![allow(dead_code)] // each window test uses its own share of these

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::xvfb::Reaped;

/// A cold WebKit start under a software renderer, or a demo-model prefill of a few thousand
/// tokens in a debug build.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// W3C WebDriver's key for an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// W3C WebDriver's Enter key.
pub const ENTER: &str = "\u{E007}";
pub const ESC: &str = "\u{E00C}";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// tauri-driver on fresh ports for the app on `display` with `home` as FOLIO_HOME, logging to `log`:
/// the child (killed with its group on drop) and its URL.
pub fn tauri_driver(display: &str, home: &Path, log: &str) -> (Reaped, String) {
    tauri_driver_with(display, home, log, &[])
}

/// [`tauri_driver`], the app started with `env` too (a hub's address, a cache folder).
pub fn tauri_driver_with(display: &str, home: &Path, log: &str, env: &[(&str, &str)]) -> (Reaped, String) {
    // Each start gets its own ports: a driver killed with its window must not answer again.
    let (port, native) = (free_port(), free_port());
    let child = Command::new("tauri-driver")
        .args(["--port", &port.to_string(), "--native-port", &native.to_string()])
        .envs(env.iter().copied())
        .env("DISPLAY", display)
        .env("FOLIO_HOME", home)
        .env("FOLIO_TEST_HOOKS", "1")
        .env("WEBKIT_DISABLE_COMPOSITING_MODE", "1")
        .env("LIBGL_ALWAYS_SOFTWARE", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(log)).unwrap())
        .process_group(0)
        .spawn()
        .expect("tauri-driver is needed for this test (scripts/setup.sh installs it)");
    (Reaped(child), format!("http://127.0.0.1:{port}"))
}

/// A WebDriver session on the Folio app.
pub struct Driver {
    agent: ureq::Agent,
    base: String,
    session: String,
}

impl Driver {
    pub fn start(base: &str) -> Self {
        Self::start_app(base, env!("CARGO_BIN_EXE_folio"), &[])
    }

    /// A session on the app at `app` (an installed one), started with `args`.
    pub fn start_app(base: &str, app: &str, args: &[&str]) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let args: Vec<&str> = ["--device", "cpu"].iter().chain(args).copied().collect();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "tauri:options": {"application": app, "args": args}
        }}});
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            // tauri-driver takes a moment to listen.
            match agent.post(&format!("{base}/session")).send_json(&caps) {
                Ok(mut r) => {
                    let v: Value = r.body_mut().read_json().unwrap();
                    let session = v["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {v}"));
                    return Self { agent, base: base.to_owned(), session: session.to_owned() };
                }
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => panic!("tauri-driver did not answer at {base}: {e}"),
            }
        }
    }

    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut r = match (method, body) {
            ("GET", _) => self.agent.get(&url).call(),
            ("DELETE", _) => self.agent.delete(&url).call(),
            (_, b) => self.agent.post(&url).send_json(b.unwrap_or(json!({}))),
        }
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let v: Value = r.body_mut().read_json().unwrap();
        if v["value"].get("error").is_some() {
            return json!({"error": v["value"]});
        }
        v["value"].clone()
    }

    pub fn script(&self, js: &str, args: Value) -> Value {
        self.call("POST", "/execute/sync", Some(json!({"script": js, "args": args})))
    }

    /// Text content of every element matching `css`.
    pub fn texts(&self, css: &str) -> Vec<String> {
        let v = self.script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent.trim())",
            json!([css]),
        );
        v.as_array().map(|a| a.iter().map(|s| s.as_str().unwrap_or("").to_owned()).collect()).unwrap_or_default()
    }

    pub fn element(&self, css: &str) -> Option<String> {
        let v = self.call("POST", "/element", Some(json!({"using": "css selector", "value": css})));
        v[ELEMENT].as_str().map(str::to_owned)
    }

    pub fn click(&self, css: &str) {
        let id = self.element(css).unwrap_or_else(|| panic!("nothing matches {css}"));
        let v = self.call("POST", &format!("/element/{id}/click"), Some(json!({})));
        assert!(v.get("error").is_none(), "click {css}: {v}");
    }

    pub fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css).unwrap_or_else(|| panic!("nothing matches {css}"));
        let v = self.call("POST", &format!("/element/{id}/value"), Some(json!({"text": text})));
        assert!(v.get("error").is_none(), "type into {css}: {v}");
    }

    /// Waits until `ready` holds, or fails with `what` and the page's text.
    pub fn wait(&self, what: &str, mut ready: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + STEP_TIMEOUT;
        while !ready(self) {
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; the window shows: {:?}", self.texts("body"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn quit(self) {
        let _ = self.agent.delete(&format!("{}/session/{}", self.base, self.session)).call();
    }
}

/// The whole X screen as a PNG in the test's temp folder.
pub fn screenshot(display: &str, name: &str) -> PathBuf {
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("app-{name}.png"));
    let ok = Command::new("import").args(["-display", display, "-window", "root"]).arg(&shot).status();
    assert!(ok.is_ok_and(|s| s.success()), "screenshot {name}");
    println!("screenshot: {}", shot.display());
    shot
}

/// Pids of running Folio windows whose FOLIO_HOME is `home`.
fn app_pids(home: &Path) -> Vec<i32> {
    let want = format!("FOLIO_HOME={}", home.display());
    let exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_folio")).unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe)
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()))
        })
        .collect()
}

/// Waits until the prefill writing `partial` has checkpointed a layer, then kills the app
/// (SIGKILL: no chance to clean up).
pub fn kill_after_a_layer(home: &Path, partial: &Path) {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let done = std::fs::read_to_string(partial.join("checkpoint.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["layers_done"].as_u64());
        if done.is_some_and(|n| n >= 1) {
            break;
        }
        assert!(Instant::now() < deadline, "no layer checkpointed in {}", partial.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids = app_pids(home);
    assert_eq!(pids.len(), 1, "one Folio window runs: {pids:?}");
    // SAFETY: signalling a process this test started (through tauri-driver), found by its
    // executable and FOLIO_HOME.
    unsafe { libc::kill(pids[0], libc::SIGKILL) };
}

pub fn statuses(d: &Driver) -> Vec<(String, String)> {
    let v = d.script(
        "return Array.from(document.querySelectorAll('[data-testid=context]')).map(e => \
         [e.querySelector('.ctx-name').textContent.trim(), e.dataset.status])",
        json!([]),
    );
    v.as_array()
        .map(|a| a.iter().map(|p| (p[0].as_str().unwrap().to_owned(), p[1].as_str().unwrap().to_owned())).collect())
        .unwrap_or_default()
}

/// Calls the app's Tauri command `command` with `args` from the page, as the window's code does,
/// and fails the test with the command's error.
pub fn invoke(d: &Driver, command: &str, args: Value) {
    let v = d.call(
        "POST",
        "/execute/async",
        Some(json!({"script": "const done = arguments[arguments.length - 1]; \
            window.__TAURI_INTERNALS__.invoke(arguments[0], arguments[1]) \
            .then(() => done('ok'), (e) => done('error: ' + e));", "args": [command, args]})),
    );
    assert_eq!(v, "ok", "{command}: {v}");
}

pub fn drop_paths(d: &Driver, paths: &[&Path]) {
    let paths: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    invoke(d, "simulate_drop", json!({ "paths": paths }));
}

/// A folder `folder` under `dir` holding `notes.txt`: the repository's three sample documents'
/// text `times` over (a long document the demo model reads, about 690 tokens a time).
pub fn repeated_samples(dir: &Path, folder: &str, times: usize) -> PathBuf {
    let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/samples");
    let text: String = ["field_notes.txt", "market_records.txt", "the_diary_of_greta.txt"]
        .iter()
        .map(|f| std::fs::read_to_string(samples.join(f)).unwrap())
        .collect();
    let folder = dir.join(folder);
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("notes.txt"), text.repeat(times)).unwrap();
    folder
}

/// The repository's sample documents dropped on an empty library and prefilled as a person
/// does it (the sheet's Start): waits until `samples` is listed ready.
pub fn prefill_samples(d: &Driver) {
    let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/samples").canonicalize().unwrap();
    drop_paths(d, &[&samples]);
    d.wait("three staged documents", |d| d.texts("[data-testid=staged-documents] tbody tr").len() == 3);
    d.click("[data-testid=start-prefill]");
    d.wait("samples listed ready", |d| statuses(d) == [("samples".into(), "ready".into())]);
}

/// Opens Settings and waits until its forms and the auto-resume toggle show what the engine has
/// now (until then they are disabled: a late read would overwrite what is typed) and the drawer
/// has slid in (a click at coordinates during the slide lands beside its target).
pub fn open_settings(d: &Driver) {
    d.click("[aria-label=Settings]");
    d.wait("the settings loaded", |d| {
        d.script(
            "return document.querySelector('[data-testid=apply-generation]')?.matches(':enabled') \
             && document.querySelector('[data-testid=auto-resume]')?.matches(':enabled') \
             && document.querySelector('.drawer[role=dialog]').getAnimations().length === 0",
            json!([]),
        ) == json!(true)
    });
}

/// Picks `method` in Settings (its default budget) and applies it.
pub fn choose_method(d: &Driver, method: &str) {
    open_settings(d);
    d.wait("the methods", |d| d.texts("[data-testid=method] option").len() >= 8);
    d.script(
        "const s = document.querySelector('[data-testid=method]'); s.value = arguments[0]; \
         s.dispatchEvent(new Event('change', {bubbles: true}));",
        json!([method]),
    );
    // Clicked from the page, as the drawer's other Apply buttons are: notes and errors that
    // appear above a button move it, and a click at coordinates taken before lands beside it.
    d.script("document.querySelector('[data-testid=apply-method]').click()", json!([]));
    d.wait("the method applied", |d| {
        d.texts("[role=status]").concat().contains(&format!("The next answer uses {method}"))
    });
    d.click("[aria-label='Close settings']");
}

/// Whether the first `css` lies inside the first `frame` as it is scrolled now: what a person
/// sees of it, not whether it exists.
pub fn in_view(d: &Driver, css: &str, frame: &str) -> bool {
    let script = "const c = document.querySelector(arguments[0]).getBoundingClientRect(); \
                  const f = document.querySelector(arguments[1]).getBoundingClientRect(); \
                  return c.top >= f.top - 1 && c.bottom <= f.bottom + 1";
    d.script(script, json!([css, frame])) == json!(true)
}
