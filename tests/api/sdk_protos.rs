//! The SDKs' copies of what they take from the repository. Each SDK in `sdk/` is a package that
//! must stand alone — a copy of its folder, its wheel, its tarball — so it carries files of its
//! own: `proto/turnstile/v1/worker.proto` (with whatever it imports) and the licence. `proto/`
//! and `LICENSE` at the root stay the one source; these tests fail when a copy drifts from it,
//! or when something in `sdk/` is a symlink (which a copy, a wheel or `npm pack` would break).
//!
//! `TURNSTILE_BLESS=1 cargo test --test api sdk_protos::` rewrites the copies from the source.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The contract the SDKs serve, relative to `proto/`.
const WORKER_PROTO: &str = "turnstile/v1/worker.proto";

/// Where each SDK keeps its copy of `proto/` (the same layout under it).
const PROTO_COPIES: [&str; 2] = ["sdk/python/turnstile_worker/protos", "sdk/typescript/proto"];

/// Each SDK's copy of the root `LICENSE`.
const LICENSE_COPIES: [&str; 2] = ["sdk/python/LICENSE", "sdk/typescript/LICENSE"];

/// What building or installing the SDKs leaves in their folders, which no package holds.
const BUILD_OUTPUT: [&str; 6] = [
    "node_modules",
    "dist",
    "build",
    "__pycache__",
    ".venv",
    "venv",
];

const HOW_TO_SYNC: &str = "`proto/` and `LICENSE` are the source; re-sync the SDKs' copies with \
     `TURNSTILE_BLESS=1 cargo test --test api sdk_protos::` and commit them";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn blessing() -> bool {
    std::env::var_os("TURNSTILE_BLESS").is_some_and(|v| !v.is_empty() && v != "0")
}

/// `file` (relative to `proto/`) and every file it imports, transitively, that lives in
/// `proto/` (well-known types such as `google/protobuf/*.proto` come with the loaders).
fn contract_files(file: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut todo = vec![file.to_owned()];
    while let Some(file) = todo.pop() {
        let path = root().join("proto").join(&file);
        if !path.exists() || !found.insert(file.clone()) {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        for line in text.lines() {
            let Some(rest) = line.trim_start().strip_prefix("import ") else {
                continue;
            };
            let rest = rest.trim_start();
            let rest = rest
                .strip_prefix("public ")
                .or_else(|| rest.strip_prefix("weak "))
                .unwrap_or(rest);
            if let Some(imported) = rest.trim().split('"').nth(1) {
                todo.push(imported.to_owned());
            }
        }
    }
    assert!(
        found.contains(file),
        "proto/{file} is missing: the SDKs serve it"
    );
    found
}

/// Every `.proto` file under `dir`, relative to it.
fn protos_under(dir: &Path) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(at) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&at) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "proto") {
                let relative = path.strip_prefix(dir).unwrap();
                found.insert(relative.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    found
}

/// Makes `copy` hold `source`'s bytes (replacing a symlink), or says how it differs.
fn check_copy(source: &Path, copy: &Path, problems: &mut Vec<String>) {
    let want =
        std::fs::read(source).unwrap_or_else(|e| panic!("reading {}: {e}", source.display()));
    let is_link = copy.symlink_metadata().is_ok_and(|m| m.is_symlink());
    let have = if is_link {
        None
    } else {
        std::fs::read(copy).ok()
    };
    if have.as_deref() == Some(want.as_slice()) {
        return;
    }
    if blessing() {
        if copy.symlink_metadata().is_ok() {
            std::fs::remove_file(copy).unwrap();
        }
        std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
        std::fs::write(copy, &want).unwrap();
        eprintln!("rewrote {}", copy.display());
        return;
    }
    let shown = |p: &Path| p.strip_prefix(root()).unwrap_or(p).display().to_string();
    problems.push(match have {
        _ if is_link => format!(
            "{} is a symlink, not a copy of {}",
            shown(copy),
            shown(source)
        ),
        None => format!("{} is missing (a copy of {})", shown(copy), shown(source)),
        Some(_) => format!("{} differs from {}", shown(copy), shown(source)),
    });
}

fn report(problems: &[String]) {
    assert!(
        problems.is_empty(),
        "the SDKs' copies are out of step:\n  {}\n{HOW_TO_SYNC}",
        problems.join("\n  ")
    );
}

#[test]
fn each_sdk_carries_a_byte_for_byte_copy_of_the_worker_contract() {
    let files = contract_files(WORKER_PROTO);
    let mut problems = Vec::new();
    for copies in PROTO_COPIES {
        let dir = root().join(copies);
        for file in &files {
            check_copy(
                &root().join("proto").join(file),
                &dir.join(file),
                &mut problems,
            );
        }
        // A file the contract no longer imports would ship as a stale copy.
        for stray in protos_under(&dir).difference(&files) {
            let path = dir.join(stray);
            if blessing() {
                std::fs::remove_file(&path).unwrap();
                eprintln!("removed {}", path.display());
            } else {
                problems.push(format!(
                    "{copies}/{stray} is not part of proto/{WORKER_PROTO} (or what it imports)"
                ));
            }
        }
    }
    report(&problems);
}

#[test]
fn each_sdk_carries_the_licence() {
    let source = root().join("LICENSE");
    let mut problems = Vec::new();
    for copy in LICENSE_COPIES {
        let copy = root().join(copy);
        if source.exists() {
            check_copy(&source, &copy, &mut problems);
        } else {
            // Before the repository has its LICENSE, each copy must still be the MIT licence the
            // packages' metadata declares.
            let text = std::fs::read_to_string(&copy).unwrap_or_default();
            if !text.starts_with("MIT License") {
                problems.push(format!("{} is not the MIT licence", copy.display()));
            }
        }
    }
    report(&problems);
}

#[test]
fn nothing_in_sdk_points_outside_it() {
    let mut links: Vec<PathBuf> = Vec::new();
    let mut todo = vec![root().join("sdk")];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if BUILD_OUTPUT.contains(&name.as_ref()) || name.ends_with(".egg-info") {
                continue;
            }
            let kind = entry.file_type().unwrap();
            if kind.is_symlink() {
                links.push(entry.path());
            } else if kind.is_dir() {
                todo.push(entry.path());
            }
        }
    }
    let links: Vec<_> = links
        .iter()
        .map(|l| l.strip_prefix(root()).unwrap_or(l).display().to_string())
        .collect();
    assert!(
        links.is_empty(),
        "symlinks in sdk/ break when an SDK's folder is copied, packed or built into a wheel: \
         {links:?}; make each a copy of what it points to ({HOW_TO_SYNC})"
    );
}
