//! Third-party tools the tests install for themselves (helm, Python and npm packages, browser
//! drivers) under `<target dir>/tools`, once per target directory, so that a clean checkout needs
//! nothing but the network and the machine's package managers.
//!
//! Each tool is built in a scratch directory and renamed into place, so a test process never sees
//! a half-installed tool; within this process, one install runs at a time.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

/// `<target dir>`, found from this test binary's path (`<target>/<profile>/deps/…`), so that it
/// follows `CARGO_TARGET_DIR` without reading it.
pub fn target_dir() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .ancestors()
        .nth(3)
        .expect("test binary lives in <target>/<profile>/deps")
        .to_path_buf()
}

/// `<target dir>/tools/<name>`, filled by `fill` (given an empty scratch directory) unless it
/// exists already.
pub fn installed(name: &str, fill: impl FnOnce(&Path)) -> PathBuf {
    static INSTALLING: Mutex<()> = Mutex::new(());
    let _one = INSTALLING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = target_dir().join("tools");
    let done = dir.join(name);
    if done.exists() {
        return done;
    }
    let started = std::time::Instant::now();
    let scratch = dir.join(format!("{name}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    fill(&scratch);
    // Another process may have finished first; then its copy stands and ours goes.
    if std::fs::rename(&scratch, &done).is_err() {
        assert!(done.exists(), "could not move {scratch:?} to {done:?}");
        let _ = std::fs::remove_dir_all(&scratch);
    }
    eprintln!("installed {name} in {:.1?}", started.elapsed());
    done
}

/// Runs `command` to completion; panics naming `what` (and how to fix it) unless it succeeded.
pub fn run(command: &mut Command, what: &str) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// A `pip install --target` directory `name` holding `packages`, for `PYTHONPATH`.
pub fn pip(name: &str, packages: &[&str]) -> PathBuf {
    installed(name, |dir| {
        run(
            Command::new("python3")
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(["--no-input", "--target"])
                .arg(dir)
                .args(packages),
            &format!("pip install {packages:?} (needs python3 with pip, and PyPI)"),
        );
    })
}

/// A directory `name` whose `node_modules` holds `packages`, for `NODE_PATH` or `require`.
pub fn npm(name: &str, packages: &[&str]) -> PathBuf {
    installed(name, |dir| {
        std::fs::write(dir.join("package.json"), "{\"private\":true}").unwrap();
        run(
            Command::new("npm")
                .args(["install", "--silent", "--no-audit", "--no-fund"])
                .args(packages)
                .current_dir(dir),
            &format!("npm install {packages:?} (needs npm and the registry)"),
        );
    })
}
