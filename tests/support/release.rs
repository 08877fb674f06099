//! The previous release, which this one is held to: which release it is (CHANGELOG.md names its
//! version and commit) and its `turnstile` binary, built from that commit of this clone's history.
//!
//! The binary is built once per target directory, under `<target dir>/tools` beside the tools the
//! other third-party tests install, and reused after that. The build is one `cargo build` of the
//! release's own sources with its own `Cargo.lock`, in a target directory of its own: nothing of
//! this tree's build is shared or disturbed. A commit missing from the clone (a shallow clone) is
//! a failure that says so, never a skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

use super::tools;

/// A release: its version and the commit it was cut from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// `X.Y.Z`, tagged `vX.Y.Z`.
    pub version: String,
    /// The full commit id.
    pub commit: String,
}

/// This repository's root.
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The newest release in CHANGELOG.md: the heading `## [X.Y.Z] — date` and, below it, the line
/// `Released as tag vX.Y.Z, commit <sha>.`
pub fn last() -> Release {
    let changelog = std::fs::read_to_string(repo().join("CHANGELOG.md")).unwrap();
    let mut lines = changelog.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.strip_prefix("## [") else {
            continue;
        };
        let version = rest.split(']').next().unwrap();
        if version.eq_ignore_ascii_case("unreleased") {
            continue;
        }
        let commit = lines
            .find_map(|l| l.split_once(", commit ").map(|(_, c)| c))
            .unwrap_or_else(|| panic!("release {version} names no commit in CHANGELOG.md"))
            .trim_end_matches('.')
            .to_owned();
        return Release {
            version: version.to_owned(),
            commit,
        };
    }
    panic!("CHANGELOG.md names no release");
}

impl Release {
    /// The release's `turnstile` binary (debug profile), built from its commit the first time it
    /// is asked for in this target directory.
    ///
    /// # Panics
    /// When the commit is not in this clone, or the build fails (with cargo's output).
    pub fn binary(&self) -> PathBuf {
        // One build at a time in this process; the tests that want the binary wait for it.
        static BUILDING: Mutex<()> = Mutex::new(());
        let _one = BUILDING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tools = tools::target_dir().join("tools");
        let name = format!("turnstile-{}-{}", self.version, &self.commit[..12]);
        let done = tools.join(&name);
        let binary = done.join("turnstile");
        if binary.exists() {
            return binary;
        }
        self.check_in_history();
        let started = std::time::Instant::now();
        eprintln!(
            "building turnstile {} from commit {} (once per target directory; minutes)",
            self.version, self.commit
        );
        // Sources and target directory stay put until the binary is in place, so that a build
        // cut short resumes where it stopped instead of starting over.
        let build = tools.join(format!("{name}.build"));
        let sources = self.sources(&build);
        let built = cargo_build(&sources, &build.join("target"));
        self.check_version(&built);

        let scratch = tools.join(format!("{name}.partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).unwrap();
        std::fs::copy(&built, scratch.join("turnstile"))
            .unwrap_or_else(|e| panic!("copying {built:?}: {e}"));
        // Another process may have finished first; then its copy stands and ours goes.
        if std::fs::rename(&scratch, &done).is_err() {
            assert!(binary.exists(), "could not move {scratch:?} to {done:?}");
            let _ = std::fs::remove_dir_all(&scratch);
        }
        // The binary is all that is kept: the build's target directory is gigabytes.
        let _ = std::fs::remove_dir_all(&build);
        eprintln!(
            "built turnstile {} in {:.1?}",
            self.version,
            started.elapsed()
        );
        binary
    }

    /// Fails, saying what to do, unless this clone has the release's commit.
    fn check_in_history(&self) {
        let found = Command::new("git")
            .args(["cat-file", "-e", &format!("{}^{{commit}}", self.commit)])
            .current_dir(repo())
            .output();
        assert!(
            found.as_ref().is_ok_and(|o| o.status.success()),
            "release {} (CHANGELOG.md: commit {}) is not in this clone's git history at {}, so its \
             binary cannot be built: clone with full history, or fetch it (`git fetch origin tag \
             v{}`; in a shallow clone `git fetch --unshallow`). git said: {}",
            self.version,
            self.commit,
            repo().display(),
            self.version,
            match &found {
                Ok(output) => String::from_utf8_lossy(&output.stderr).trim().to_owned(),
                Err(e) => format!("cannot run git: {e}"),
            }
        );
    }

    /// `<build>/src`: the release's tree as `git archive` gives it (what the tag holds, nothing
    /// of this work tree), extracted unless it is there already.
    fn sources(&self, build: &Path) -> PathBuf {
        let sources = build.join("src");
        if sources.join("Cargo.toml").exists() {
            return sources;
        }
        let partial = build.join("src.partial");
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial).unwrap();
        let tar = build.join("source.tar");
        tools::run(
            Command::new("git")
                .args(["archive", "--format=tar", "-o"])
                .arg(&tar)
                .arg(&self.commit)
                .current_dir(repo()),
            &format!("git archive of release {}", self.version),
        );
        tools::run(
            Command::new("tar")
                .arg("-xf")
                .arg(&tar)
                .arg("-C")
                .arg(&partial),
            &format!("extracting release {}'s sources", self.version),
        );
        let _ = std::fs::remove_file(&tar);
        std::fs::rename(&partial, &sources).unwrap();
        sources
    }

    /// Fails unless `binary` says it is this release.
    fn check_version(&self, binary: &Path) {
        let output = tools::run(
            Command::new(binary).arg("--version"),
            "the built binary's --version",
        );
        let said = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            said.trim(),
            format!("turnstile {}", self.version),
            "commit {} is not release {}",
            self.commit,
            self.version
        );
    }
}

/// Runs `cargo build --locked --bin turnstile` in `sources` with `target` as its target
/// directory; returns the binary, or fails with cargo's output.
fn cargo_build(sources: &Path, target: &Path) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args(["build", "--locked", "--bin", "turnstile"])
        .current_dir(sources)
        .env("CARGO_TARGET_DIR", target)
        // The release is built as it was released, whatever this build's flags (a CI's
        // `-D warnings`), and a lint a later compiler added does not fail it.
        .env("RUSTFLAGS", "--cap-lints=warn")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_BUILD_TARGET_DIR");
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "building the previous release failed ({}): {command:?}\n{}",
        output.status,
        build_log(&output)
    );
    let binary = target.join("debug").join("turnstile");
    assert!(
        binary.exists(),
        "cargo built no {binary:?}:\n{}",
        build_log(&output)
    );
    binary
}

/// What cargo said, less its `Compiling`/`Downloaded` progress lines.
fn build_log(output: &Output) -> String {
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    let mut progress = 0;
    let mut kept: Vec<&str> = Vec::new();
    for line in text.lines() {
        let word = line.trim_start().split(' ').next().unwrap_or("");
        if matches!(word, "Compiling" | "Downloaded" | "Downloading" | "Locking") {
            progress += 1;
        } else {
            kept.push(line);
        }
    }
    format!("({progress} progress lines left out)\n{}", kept.join("\n"))
}
