//! Shared by the window tests (tests/gui_window.rs, tests/gui_library.rs): an X server of
//! their own, and children that never outlive a failed assertion.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long Xvfb may take to open its socket.
const XVFB_TIMEOUT: Duration = Duration::from_secs(20);

/// Kills the child's process group and waits for it on drop (spawn it with
/// `process_group(0)`): tauri-driver goes with its WebKitWebDriver and the app, Xvfb alone.
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        // SAFETY: signalling the process group this test created for the child.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

fn free_display() -> u32 {
    (100 + std::process::id() % 800..1000)
        .find(|n| {
            !Path::new(&format!("/tmp/.X11-unix/X{n}")).exists() && !Path::new(&format!("/tmp/.X{n}-lock")).exists()
        })
        .expect("no free X display number")
}

/// An Xvfb screen of 1280×860 on a free display, ready (its socket open): the server and the
/// display's name (":N").
pub fn start_xvfb() -> (Reaped, String) {
    let n = free_display();
    let display = format!(":{n}");
    let xvfb = Command::new("Xvfb")
        .args([display.as_str(), "-screen", "0", "1280x860x24", "-nolisten", "tcp"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("Xvfb is needed for this test (scripts/setup.sh installs it)");
    let xvfb = Reaped(xvfb);
    let socket = format!("/tmp/.X11-unix/X{n}");
    let start = Instant::now();
    while !Path::new(&socket).exists() {
        assert!(start.elapsed() < XVFB_TIMEOUT, "Xvfb did not start on {display}");
        std::thread::sleep(Duration::from_millis(100));
    }
    (xvfb, display)
}
