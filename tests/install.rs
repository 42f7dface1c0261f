//! The package a person installs (issue #45): the .deb that `scripts/package.sh` makes (the
//! test command makes it from the debug build: `scripts/package.sh --debug`), installed on this
//! machine with dpkg, started from where it installed under Xvfb through the window test's
//! harness — on the demo model it carries, the samples prefilled, a question answered — then a
//! .folio file opened with it, as the desktop's file association does (imported into the
//! library), and the package removed with apt-get. Its desktop entry, icon and MIME type are
//! where the desktop looks for them.

#[path = "common/webdriver.rs"]
mod webdriver;
#[path = "common/xvfb.rs"]
mod xvfb;

use std::path::{Path, PathBuf};
use std::process::Command;

use webdriver::{prefill_samples, screenshot, statuses, tauri_driver, Driver};
use xvfb::start_xvfb;

/// Where the package installs the binary and the demo model.
const INSTALLED: &str = "/usr/bin/folio";
const INSTALLED_DEMO: &str = "/usr/lib/Folio/models/demo/config.json";
const QUESTION: &str = "what is the secret code of amber falcon ?";
const ANSWER: &str = "4 8 1 5 2";

/// The .deb the test command made (`scripts/package.sh --debug`).
fn package() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("../debug/bundle/deb");
    let found = std::fs::read_dir(&dir).ok().into_iter().flatten().flatten().map(|e| e.path());
    let deb = found
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .max_by_key(|p| p.metadata().unwrap().modified().unwrap());
    deb.unwrap_or_else(|| {
        panic!("no .deb in {}: run scripts/package.sh --debug first (the test command does)", dir.display())
    })
}

/// Removes the package when the test ends, passed or not.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let out = Command::new("apt-get").args(["remove", "-y", "folio"]).output().unwrap();
        assert!(out.status.success() || std::thread::panicking(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_installed_package_runs_answers_and_opens_context_files() {
    let deb = package();
    let fields = run(Command::new("dpkg-deb").args(["--field"]).arg(&deb).args(["Package", "Version"]));
    assert!(
        fields.contains("Package: folio") && fields.contains(&format!("Version: {}", env!("CARGO_PKG_VERSION"))),
        "{fields}"
    );
    run(Command::new("dpkg").arg("-i").arg(&deb));
    let _installed = Installed;
    assert!(Path::new(INSTALLED).is_file() && Path::new(INSTALLED_DEMO).is_file());
    let entry = std::fs::read_to_string("/usr/share/applications/Folio.desktop").unwrap();
    assert!(entry.contains("Exec=folio %F") && entry.contains("MimeType=application/x-folio-context;"), "{entry}");
    assert!(Path::new("/usr/share/icons/hicolor/512x512/apps/folio.png").is_file());
    assert!(std::fs::read_to_string("/usr/share/mime/packages/folio.xml").unwrap().contains("*.folio"));

    // The installed app, on the demo model it carries (not the source tree's).
    let (_xvfb, display) = start_xvfb();
    let home = tempfile::tempdir().unwrap();
    let (_td, base) = tauri_driver(&display, home.path(), "tauri-driver-install.log");
    let d = Driver::start_app(&base, INSTALLED, &[]);
    d.wait("the window", |d| d.element(".sidebar").is_some());
    open_facts(&d);
    let source = d.texts("[data-testid=model-facts] .note").concat();
    assert!(source.contains("/usr/lib/Folio/models/demo"), "{source}");
    d.click("[aria-label='Close settings']");
    prefill_samples(&d);
    d.click("[data-testid=context] .ctx-button");
    d.wait("the context's documents", |d| d.texts("[data-testid=context-documents] tbody tr").len() == 3);
    d.type_into("#composer-input", &format!("{QUESTION}{}", webdriver::ENTER));
    d.wait("the answer", |d| d.texts(".bubble.assistant.done .text").concat().contains(ANSWER));
    screenshot(&display, "24-installed");
    d.quit();

    // A .folio file opened with Folio (the desktop runs `folio FILE`): imported into the library.
    let other = tempfile::tempdir().unwrap();
    let copy = other.path().join("field guide.folio");
    std::fs::copy(home.path().join("contexts/samples.folio"), &copy).unwrap();
    let d = Driver::start_app(&base, INSTALLED, &[copy.to_str().unwrap()]);
    d.wait("the opened file listed", |d| statuses(d).iter().any(|(name, st)| name == "field guide" && st == "ready"));
    d.quit();
}

/// Opens Settings at the model's facts.
fn open_facts(d: &Driver) {
    d.click("[aria-label=Settings]");
    d.wait("the model's facts", |d| d.element("[data-testid=model-facts]").is_some());
}
