//! The wire contract `turnstile.v1` never breaks: buf (from npm, `@bufbuild/buf`) lints the
//! protos with the rules of `proto/buf.yaml` and compares them with the last release's, named in
//! CHANGELOG.md. A change that would break a client goes to a new version instead.
#![allow(clippy::unwrap_used)]

use crate::support;
use support::release::{self, Release, repo};

use std::path::PathBuf;
use std::process::{Command, Output};

const BUF: &str = "@bufbuild/buf@1.75.0";

fn buf() -> PathBuf {
    support::tools::npm("bufbuild-buf-1.75.0", &[BUF]).join("node_modules/.bin/buf")
}

fn run_buf(args: &[&str]) -> Output {
    Command::new(buf())
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("cannot run buf ({BUF} from npm): {e}"))
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}

/// buf's git input for `commit`: by its tag when this clone has it, else by the commit itself.
fn against(version: &str, commit: &str) -> String {
    let tag = format!("v{version}");
    let has_tag = Command::new("git")
        .args([
            "rev-parse",
            "-q",
            "--verify",
            &format!("refs/tags/{tag}^{{commit}}"),
        ])
        .current_dir(repo())
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == commit);
    if has_tag {
        format!(".git#tag={tag},subdir=proto")
    } else {
        format!(".git#ref={commit},subdir=proto,depth=1000")
    }
}

#[test]
fn the_protos_pass_buf_lint() {
    let output = run_buf(&["lint", "proto"]);
    assert!(
        output.status.success(),
        "buf lint proto:\n{}",
        text(&output)
    );
}

#[test]
fn the_contract_has_not_broken_since_the_last_release() {
    let Release { version, commit } = release::last();
    let against = against(&version, &commit);
    let output = run_buf(&["breaking", "proto", "--against", &against]);
    assert!(
        output.status.success(),
        "turnstile.v1 changed incompatibly since {version} ({against}); put the change in a new \
         version of the contract instead:\n{}",
        text(&output)
    );
}

/// The rules are strict enough to catch the one break the contract had before its first
/// release: `ProcessTurnResponse.replayed` became `redelivered`, same number, a new JSON name.
#[test]
fn the_rules_catch_a_renamed_field() {
    let before_rename = Command::new("git")
        .args(["rev-parse", "9b23a99~1"])
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        before_rename.status.success(),
        "the history is in this clone"
    );
    let commit = String::from_utf8_lossy(&before_rename.stdout)
        .trim()
        .to_owned();
    let output = run_buf(&[
        "breaking",
        "proto",
        "--against",
        &format!(".git#ref={commit},subdir=proto,depth=1000"),
    ]);
    assert!(!output.status.success(), "the rename went unnoticed");
    let found = text(&output);
    assert!(
        found.contains("changed name from \"replayed\" to \"redelivered\""),
        "{found}"
    );
    assert!(found.contains("json_name"), "the JSON name counts: {found}");
}
