//! Bot workers: bots in Python and TypeScript, run by the SDKs in `sdk/`, keep every guarantee an
//! in-process bot has — the pizza race over three replicas on PostgreSQL, redelivery answered
//! from the receipt without calling the worker, a replica SIGKILLed under load with every count
//! exact — and each way a worker can fail gives its documented status with nothing committed.
//! The double-text policies reach a worker too: under `coalesce` the messages that arrived while
//! a turn ran are one run of a Python bot, which sees them all in `turn.batch`; under
//! `interrupt` a second message cancels the running turn, and the next run sees the first in
//! `turn.superseded`.
//!
//! The SDKs are tested as their users get them, never from the tree: each SDK's folder is copied
//! alone to a scratch directory (so that anything it reaches outside itself is missing), the
//! install commands of its README are run there as written, and the README's example, the
//! SDK's examples and this file's bots run from what they installed — a fresh venv holding the
//! wheel pip built, a fresh npm project holding the tarball `npm pack` made. That happens once
//! per test process, under `<target>/tmp/sdk-<pid>`. The packages come from PyPI and npm once per
//! target directory (a wheelhouse and an npm cache under `<target>/tools`), which needs `python3`
//! with pip and venv, `npm`, `bash`, `tar`, and the registries; without them the tests fail and
//! say so.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use support::fleet::Fleet;
use support::load::{Failure, Gateway, Shape};
use support::tools::run;
use support::{TestApp, check, message, texts, toppings};
use tokio::time::{Instant, sleep};
use tonic::{Code, Status};
use tonic_types::StatusExt as _;
use turnstile::DoubleText;
use turnstile::bot::Scopes;
use turnstile::bots::remote::RemoteBots;
use turnstile::config::Config;
use turnstile::grpc::pb;
use turnstile::grpc::pb::stream_turn_response::Event as StreamEvent;
use turnstile::store::Store;
use turnstile::store::memory::MemoryStore;

/// What the SDKs' builds and installs take from PyPI, kept as wheels under `<target>/tools`.
const PYTHON_WHEELS: [&str; 3] = [
    "grpcio==1.76.0",
    "grpcio-tools==1.76.0",
    "setuptools==80.9.0",
];

/// What an SDK's folder holds after a build or an install, which a plain copy of it lacks.
const BUILD_OUTPUT: [&str; 6] = [
    "node_modules",
    "dist",
    "build",
    "__pycache__",
    ".venv",
    "venv",
];

/// The contract, at the repository's root: the SDKs' packages must carry these bytes.
fn worker_proto() -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("proto/turnstile/v1/worker.proto"))
        .unwrap()
}

// --- the SDKs, built and installed as their READMEs say -------------------------------------

/// This process's scratch directory, `<target>/tmp/sdk-<pid>`. Those of earlier test processes
/// that have exited are removed first.
fn scratch() -> &'static Path {
    static SCRATCH: OnceLock<PathBuf> = OnceLock::new();
    SCRATCH.get_or_init(|| {
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        if let Ok(entries) = std::fs::read_dir(tmp) {
            for entry in entries.map_while(Result::ok) {
                let name = entry.file_name().to_string_lossy().into_owned();
                if let Some(pid) = name.strip_prefix("sdk-")
                    && !Path::new("/proc").join(pid).exists()
                {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        let dir = tmp.join(format!("sdk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

/// Copies SDK folder `sdk/<name>` to `to` as a user would copy it: everything but build output,
/// symlinks as symlinks (so one that points outside the folder breaks in the copy).
fn copy_sdk(name: &str, to: &Path) {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap().map_while(Result::ok) {
            let name = entry.file_name();
            let shown = name.to_string_lossy();
            if BUILD_OUTPUT.contains(&shown.as_ref())
                || shown.ends_with(".egg-info")
                || shown.ends_with(".tgz")
            {
                continue;
            }
            let (from, to) = (entry.path(), to.join(&name));
            let kind = entry.file_type().unwrap();
            if kind.is_symlink() {
                std::os::unix::fs::symlink(std::fs::read_link(&from).unwrap(), &to).unwrap();
            } else if kind.is_dir() {
                copy(&from, &to);
            } else {
                std::fs::copy(&from, &to).unwrap();
            }
        }
    }
    copy(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk").join(name),
        to,
    );
}

/// The one code block of language `lang` in section `## {section}` of the markdown `readme`.
fn readme_block(readme: &str, section: &str, lang: &str) -> String {
    let mut blocks = Vec::new();
    let (mut in_section, mut block): (bool, Option<(String, String)>) = (false, None);
    for line in readme.lines() {
        if let Some((language, code)) = &mut block {
            if line.trim_start().starts_with("```") {
                if in_section && language == lang {
                    blocks.push(std::mem::take(code));
                }
                block = None;
            } else {
                code.push_str(line);
                code.push('\n');
            }
        } else if let Some(fence) = line.trim_start().strip_prefix("```") {
            block = Some((fence.trim().to_owned(), String::new()));
        } else if let Some(heading) = line.strip_prefix("## ") {
            in_section = heading.trim() == section;
        }
    }
    assert_eq!(
        blocks.len(),
        1,
        "the README should have one ```{lang} block under `## {section}`"
    );
    blocks.pop().unwrap()
}

/// `code` with `from` (which must occur exactly once) replaced by `to`: a README's example
/// serves on a fixed port, a test's on any free one.
fn replace_once(code: &str, from: &str, to: &str) -> String {
    assert_eq!(
        code.matches(from).count(),
        1,
        "expected `{from}` once in:\n{code}"
    );
    code.replace(from, to)
}

/// Runs a README's shell block with `bash -eu` in `dir`, with `home` as `~`.
fn run_shell_block(code: &str, dir: &Path, home: &Path, env: &[(&str, &Path)], what: &str) {
    std::fs::create_dir_all(home).unwrap();
    let mut command = Command::new("bash");
    command
        .args(["-e", "-u", "-c", code])
        .current_dir(dir)
        .env("HOME", home)
        .env_remove("PYTHONPATH")
        .env_remove("NODE_PATH")
        .stdin(Stdio::null());
    for (name, value) in env {
        command.env(name, value);
    }
    run(&mut command, what);
}

/// A directory of wheels for everything the Python SDK's build and install need, so that they
/// run offline: `<target>/tools/python-worker-wheels-…`.
fn wheelhouse() -> PathBuf {
    let tag = run(
        Command::new("python3").args(["-c", "import sys; print(sys.implementation.cache_tag)"]),
        "python3 (needed for the Python SDK)",
    );
    let tag = String::from_utf8_lossy(&tag.stdout).trim().to_owned();
    support::tools::installed(
        &format!("python-worker-wheels-{tag}-grpcio-1.76.0-setuptools-80.9.0"),
        |dir| {
            run(
                Command::new("python3")
                    .args(["-m", "pip", "download", "--quiet"])
                    .args(["--disable-pip-version-check", "--no-input", "--dest"])
                    .arg(dir)
                    .args(PYTHON_WHEELS),
                &format!("pip download {PYTHON_WHEELS:?} (needs python3 with pip, and PyPI)"),
            );
        },
    )
}

/// The Python SDK as its README installs it, from a copy of `sdk/python`.
struct PythonSdk {
    /// The copy of `sdk/python` it was built from.
    sdk: PathBuf,
    /// The bot's project, `~/greeter-bot`: the README's `greeter.py` and this file's `moody.py`
    /// and `doubles.py`.
    project: PathBuf,
    /// The fresh environment's interpreter.
    python: PathBuf,
}

fn python_sdk() -> &'static PythonSdk {
    static SDK: OnceLock<PythonSdk> = OnceLock::new();
    SDK.get_or_init(|| {
        let started = std::time::Instant::now();
        let wheels = wheelhouse();
        let dir = scratch().join("python");
        let sdk = dir.join("turnstile-worker");
        copy_sdk("python", &sdk);
        let readme = std::fs::read_to_string(sdk.join("README.md")).unwrap();
        // pip builds and installs from the wheelhouse alone; its build environment gets
        // setuptools from there too.
        let pip_env: [(&str, &Path); 4] = [
            ("PIP_NO_INDEX", Path::new("1")),
            ("PIP_FIND_LINKS", &wheels),
            ("PIP_DISABLE_PIP_VERSION_CHECK", Path::new("1")),
            ("PIP_NO_CACHE_DIR", Path::new("1")),
        ];
        let home = dir.join("home");
        run_shell_block(
            &readme_block(&readme, "Install", "sh"),
            &sdk,
            &home,
            &pip_env,
            "the Python SDK README's install commands",
        );
        let project = home.join("greeter-bot");
        let python = project.join(".venv/bin/python");

        // The wheel itself carries the contract and the licence.
        let wheel_dir = dir.join("wheel");
        let mut wheel = Command::new("python3");
        wheel
            .args(["-m", "pip", "wheel", "--quiet", "--no-deps", "-w"])
            .arg(&wheel_dir)
            .arg(&sdk);
        for (name, value) in pip_env {
            wheel.env(name, value);
        }
        run(&mut wheel, "building the Python SDK's wheel");
        let wheel = std::fs::read_dir(&wheel_dir)
            .unwrap()
            .map_while(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "whl"))
            .expect("pip built no wheel");
        let listing = run(
            Command::new("python3")
                .args([
                    "-c",
                    "import sys, zipfile; print('\\n'.join(zipfile.ZipFile(sys.argv[1]).namelist()))",
                ])
                .arg(&wheel),
            "listing the wheel",
        );
        let listing = String::from_utf8_lossy(&listing.stdout);
        for file in [
            "turnstile_worker/__init__.py",
            "turnstile_worker/protos/turnstile/v1/worker.proto",
            "turnstile_worker-0.2.0.dist-info/licenses/LICENSE",
        ] {
            assert!(
                listing.lines().any(|l| l == file),
                "the wheel lacks {file}:\n{listing}"
            );
        }

        // The environment imports the package it installed, and that carries the contract.
        let installed = run(
            Command::new(&python)
                .args([
                    "-c",
                    "import os, turnstile_worker; print(os.path.dirname(turnstile_worker.__file__))",
                ])
                .current_dir(&project)
                .env_remove("PYTHONPATH"),
            "importing turnstile_worker from the fresh environment",
        );
        let installed = PathBuf::from(String::from_utf8_lossy(&installed.stdout).trim());
        assert!(
            installed.starts_with(project.join(".venv")),
            "turnstile_worker came from {installed:?}, not the fresh environment"
        );
        assert_eq!(
            std::fs::read(installed.join("protos/turnstile/v1/worker.proto")).unwrap(),
            worker_proto(),
            "the installed package's worker.proto is proto/turnstile/v1/worker.proto"
        );

        let greeter = readme_block(&readme, "A bot", "python");
        std::fs::write(
            project.join("greeter.py"),
            replace_once(&greeter, "\"0.0.0.0:50061\"", "\"127.0.0.1:0\""),
        )
        .unwrap();
        std::fs::write(project.join("moody.py"), MOODY).unwrap();
        std::fs::write(project.join("doubles.py"), DOUBLES).unwrap();
        eprintln!(
            "the Python SDK built and installed in {:.1?}",
            started.elapsed()
        );
        PythonSdk {
            sdk,
            project,
            python,
        }
    })
}

/// The TypeScript SDK as its README installs it, from a copy of `sdk/typescript`.
struct NodeSdk {
    /// The bot's project, `~/counter-bot`, compiled: the README's `counter.ts` as
    /// `dist/counter.js`, the SDK's examples as `examples/counter.js`,
    /// `dist/examples/counter.js` and `dist/examples/llm.js`, this file's `moody.ts` as
    /// `dist/moody.js`.
    project: PathBuf,
}

fn node_sdk() -> &'static NodeSdk {
    static SDK: OnceLock<NodeSdk> = OnceLock::new();
    SDK.get_or_init(|| {
        let started = std::time::Instant::now();
        let dir = scratch().join("typescript");
        let sdk = dir.join("turnstile-worker");
        copy_sdk("typescript", &sdk);
        let readme = std::fs::read_to_string(sdk.join("README.md")).unwrap();
        // npm's cache lives with the target directory, so that a second run needs no network.
        let tools = support::tools::target_dir().join("tools");
        let cache = tools.join("npm-cache");
        let user_config = std::env::var_os("HOME")
            .map(|home| PathBuf::from(home).join(".npmrc"))
            .filter(|p| p.exists());
        let mut npm_env: Vec<(&str, &Path)> = vec![
            ("npm_config_cache", &cache),
            ("npm_config_prefer_offline", Path::new("true")),
            ("npm_config_audit", Path::new("false")),
            ("npm_config_fund", Path::new("false")),
            ("npm_config_update_notifier", Path::new("false")),
        ];
        // The user's npm configuration (a registry mirror, say) outlives the scratch HOME.
        if let Some(config) = &user_config {
            npm_env.push(("npm_config_userconfig", config));
        }
        let home = dir.join("home");
        run_shell_block(
            &readme_block(&readme, "Install", "sh"),
            &sdk,
            &home,
            &npm_env,
            "the TypeScript SDK README's install commands (need npm and the registry)",
        );
        let project = home.join("counter-bot");

        // The tarball carries the build, the contract and the licence.
        let tarball = sdk.join("turnstile-worker-0.2.0.tgz");
        let listing = run(
            Command::new("tar").arg("tzf").arg(&tarball),
            "listing the tarball",
        );
        let listing = String::from_utf8_lossy(&listing.stdout);
        for file in [
            "package/dist/index.js",
            "package/dist/index.d.ts",
            "package/proto/turnstile/v1/worker.proto",
            "package/LICENSE",
            "package/README.md",
        ] {
            assert!(
                listing.lines().any(|l| l == file),
                "the tarball lacks {file}:\n{listing}"
            );
        }
        let installed = project.join("node_modules/turnstile-worker");
        assert!(
            installed.is_dir() && !installed.is_symlink(),
            "turnstile-worker is not installed from the tarball in {project:?}"
        );
        assert_eq!(
            std::fs::read(installed.join("proto/turnstile/v1/worker.proto")).unwrap(),
            worker_proto(),
            "the installed package's worker.proto is proto/turnstile/v1/worker.proto"
        );

        std::fs::write(
            project.join("tsconfig.json"),
            readme_block(&readme, "A bot", "json"),
        )
        .unwrap();
        let counter = readme_block(&readme, "A bot", "ts");
        std::fs::write(
            project.join("counter.ts"),
            replace_once(&counter, "'0.0.0.0:50062'", "'127.0.0.1:0'"),
        )
        .unwrap();
        std::fs::create_dir_all(project.join("examples")).unwrap();
        for example in ["counter.ts", "counter.js", "llm.ts"] {
            std::fs::copy(
                sdk.join("examples").join(example),
                project.join("examples").join(example),
            )
            .unwrap();
        }
        std::fs::write(project.join("moody.ts"), MOODY_TS).unwrap();
        let mut tsc = Command::new("npx");
        tsc.arg("tsc").current_dir(&project);
        for (name, value) in &npm_env {
            tsc.env(name, value);
        }
        run(&mut tsc, "compiling the bots with the project's tsc");
        eprintln!(
            "the TypeScript SDK built and installed in {:.1?}",
            started.elapsed()
        );
        NodeSdk { project }
    })
}

/// The 1-based number of the one line of `code` that contains `needle`.
fn line_of(code: &str, needle: &str) -> usize {
    let lines: Vec<usize> = code
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains(needle))
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(lines.len(), 1, "`{needle}` should be on one line");
    lines[0]
}

// --- worker processes -----------------------------------------------------------------------

/// A bot worker process, killed when dropped. It runs with `TURNSTILE_WORKER_TRACE`, so its
/// stderr names every call it gets.
struct WorkerProcess {
    child: Child,
    port: u16,
    stderr: Arc<Mutex<Vec<String>>>,
}

/// `python script args…` in the Python SDK's fresh environment, in the bot's project.
fn python_command(script: &Path, args: &[&str]) -> Command {
    let sdk = tokio::task::block_in_place(python_sdk);
    let mut command = Command::new(&sdk.python);
    command
        .arg(script)
        .args(args)
        .current_dir(&sdk.project)
        .env_remove("PYTHONPATH");
    command
}

/// `node --enable-source-maps args…` in the TypeScript bot's project.
fn node_command(args: &[&str]) -> Command {
    let sdk = tokio::task::block_in_place(node_sdk);
    let mut command = Command::new("node");
    command
        .arg("--enable-source-maps")
        .args(args)
        .current_dir(&sdk.project)
        .env_remove("NODE_PATH");
    command
}

impl WorkerProcess {
    /// A Python worker: `python script args…`.
    fn python(script: &Path, args: &[&str]) -> WorkerProcess {
        WorkerProcess::spawn(python_command(script, args))
    }

    /// A Python worker serving this file's `moody.py`.
    fn moody_py() -> WorkerProcess {
        let project = &tokio::task::block_in_place(python_sdk).project;
        WorkerProcess::python(&project.join("moody.py"), &[])
    }

    /// A Node worker: `node args…` in the TypeScript bot's project.
    fn node(args: &[&str]) -> WorkerProcess {
        WorkerProcess::spawn(node_command(args))
    }

    /// Starts `command` and waits (generously) for the line that says which port it serves on.
    fn spawn(mut command: Command) -> WorkerProcess {
        let mut child = command
            .env("TURNSTILE_WORKER_TRACE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting a bot worker");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&stderr);
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(port) = line.rsplit_once(" on port ").map(|(_, p)| p.to_owned()) {
                    let _ = tx.send(port);
                }
            }
        });
        let port = tokio::task::block_in_place(|| rx.recv_timeout(Duration::from_secs(120)));
        let port: u16 = match port {
            Ok(port) => port.trim().parse().unwrap(),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the bot worker never said its port; stderr:\n{}",
                    stderr.lock().unwrap().join("\n")
                );
            }
        };
        WorkerProcess {
            child,
            port,
            stderr,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The attempts the worker was called with for activity `id`, in order.
    fn calls(&self, id: &str) -> Vec<u32> {
        let needle = format!(" activity={id} ");
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("turnstile-worker: RunTurn") && l.contains(&needle))
            .filter_map(|l| l.rsplit_once("attempt=")?.1.parse().ok())
            .collect()
    }

    /// [`WorkerProcess::calls`] once there are `n` of them (the worker's stderr is read by a
    /// thread of its own, so a line may trail the answer it was printed before), or after 30 s.
    async fn calls_settled(&self, id: &str, n: usize) -> Vec<u32> {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let calls = self.calls(id);
            if calls.len() >= n || Instant::now() > until {
                return calls;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// How many `StreamRunTurn` calls the worker got for activity `id`.
    fn stream_calls(&self, id: &str) -> usize {
        let needle = format!(" activity={id} ");
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("turnstile-worker: StreamRunTurn") && l.contains(&needle))
            .count()
    }

    /// How many calls the worker got in all.
    fn all_calls(&self) -> usize {
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("turnstile-worker: RunTurn"))
            .count()
    }

    /// Everything the worker has written to stderr so far.
    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// [`WorkerProcess::stderr`] once it contains `needle`, or after 30 s.
    async fn stderr_settled(&self, needle: &str) -> String {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let stderr = self.stderr();
            if stderr.contains(needle) || Instant::now() > until {
                return stderr;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A configuration hosting `name` as a remote bot served at `url`.
fn remote(config: Config, name: &str, url: &str) -> Config {
    remotes(config, &[(name, url)])
}

/// A configuration hosting each `(name, url)` as a remote bot.
fn remotes(config: Config, bots: &[(&str, &str)]) -> Config {
    Config {
        remote_bots: RemoteBots {
            bots: bots
                .iter()
                .map(|(name, url)| format!("{name}={url}").parse().unwrap())
                .collect(),
            ..RemoteBots::default()
        },
        ..config
    }
}

/// `text` from `user` to bot `bot` in `conversation`, with activity id `id`.
fn to_bot(bot: &str, conversation: &str, id: &str, text: &str) -> pb::ProcessTurnRequest {
    let mut activity = message(conversation, "alice", text);
    activity.id = Some(id.into());
    pb::ProcessTurnRequest::typed(activity, bot)
}

fn reason(status: &Status) -> String {
    status
        .get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

// --- the pizza race, with the Python pizza bot ----------------------------------------------

const RACE_TURNS: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_python_pizza_bot_never_acknowledges_a_lost_topping_over_three_replicas() {
    let sdk = tokio::task::block_in_place(python_sdk);
    let worker = WorkerProcess::python(&sdk.sdk.join("examples/pizza.py"), &["127.0.0.1:0"]);
    let url = support::pg::fresh_database().await;
    let start = || {
        TestApp::on(&url)
            .config(|c| remote(c, "pizza-py", &worker.url()))
            .spawn()
    };
    let (a, b, c) = tokio::join!(start(), start(), start());
    let clients = [a.client.clone(), b.client.clone(), c.client.clone()];

    let calls = (0..RACE_TURNS).map(|i| {
        let mut client = clients[i % clients.len()].clone();
        tokio::spawn(async move {
            let topping = format!("t{i:02}");
            let mut activity = message("py-race", &format!("user{i}"), &format!("add {topping}"));
            activity.id = Some(format!("add-{i}"));
            let response = client
                .process_turn(pb::ProcessTurnRequest::typed(activity, "pizza-py"))
                .await
                .unwrap_or_else(|s| panic!("add {topping} failed: {s:?}"))
                .into_inner();
            (topping, texts(&response).join("\n"), response.attempts)
        })
    });
    let mut added = Vec::new();
    for call in calls.collect::<Vec<_>>() {
        added.push(call.await.unwrap());
    }

    // Every reply names its topping, and the replies' orders form one chain 1..=40.
    let mut orders: Vec<BTreeSet<String>> = Vec::new();
    for (topping, reply, _) in &added {
        let order: BTreeSet<String> = toppings(reply).into_iter().collect();
        assert!(
            reply.starts_with(&format!("Added {topping}.")) && order.contains(topping),
            "the reply to `add {topping}` does not name it: {reply:?}"
        );
        orders.push(order);
    }
    orders.sort_by_key(BTreeSet::len);
    assert_eq!(
        orders.iter().map(BTreeSet::len).collect::<Vec<_>>(),
        (1..=RACE_TURNS).collect::<Vec<_>>(),
        "every turn saw a distinct order size"
    );
    for pair in orders.windows(2) {
        assert!(
            pair[0].is_subset(&pair[1]),
            "an acknowledged order was lost: {:?} is not in {:?}",
            pair[0],
            pair[1]
        );
    }
    let mut client = clients[0].clone();
    let shown = client
        .process_turn(to_bot("pizza-py", "py-race", "show-1", "show"))
        .await
        .unwrap()
        .into_inner();
    let final_order: BTreeSet<String> = toppings(&texts(&shown)[0]).into_iter().collect();
    assert_eq!(final_order.len(), RACE_TURNS, "{final_order:?}");

    // The race happened, and each replay called the worker again with the next attempt.
    let replayed: Vec<_> = added.iter().filter(|(_, _, a)| *a > 1).collect();
    assert!(!replayed.is_empty(), "no turn needed a second attempt");
    let i = added.iter().position(|(_, _, a)| *a > 1).unwrap();
    let attempts = worker
        .calls_settled(&format!("add-{i}"), added[i].2 as usize)
        .await;
    assert_eq!(
        attempts,
        (1..=added[i].2).collect::<Vec<_>>(),
        "the worker saw each attempt of add-{i}"
    );
    eprintln!(
        "{} of {RACE_TURNS} turns were replayed; {} worker calls",
        replayed.len(),
        worker.all_calls()
    );
}

// --- the TypeScript counter: redelivery and a replica SIGKILL -------------------------------

/// Sends activity `id` once, then three times at once, to `app`'s `counter`: every answer is the
/// first one's.
async fn deliver_four_times(app: &TestApp, worker: &WorkerProcess, id: &str, n: u64) {
    let mut client = app.client.clone();
    let first = client
        .process_turn(to_bot("counter", "ts", id, "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&first), [format!("count: {n}")]);
    assert!(!first.redelivered);
    let again = (0..3).map(|_| {
        let mut client = client.clone();
        let id = id.to_owned();
        tokio::spawn(async move {
            client
                .process_turn(to_bot("counter", "ts", &id, "hi"))
                .await
                .unwrap()
                .into_inner()
        })
    });
    for call in again.collect::<Vec<_>>() {
        let again = call.await.unwrap();
        assert!(again.redelivered, "{again:?}");
        assert_eq!(texts(&again), [format!("count: {n}")], "the same answer");
    }
    assert!(!worker.calls_settled(id, 1).await.is_empty());
    // Time for any stray call's trace line to be read.
    sleep(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_is_answered_from_the_receipt_without_calling_the_typescript_worker() {
    // The counter of the SDK README's example.
    let worker = WorkerProcess::node(&["dist/counter.js"]);
    // Without the state cache every attempt loads the receipt with the state: a redelivery never
    // reaches the worker.
    let uncached = TestApp::memory()
        .config(|c| {
            let c = Config {
                state_cache_entries: 0,
                ..c
            };
            remote(c, "counter", &worker.url())
        })
        .spawn()
        .await;
    deliver_four_times(&uncached, &worker, "once-1", 1).await;
    assert_eq!(worker.calls("once-1"), [1], "the worker ran the turn once");
    deliver_four_times(&uncached, &worker, "once-2", 2).await;
    assert_eq!(
        worker.calls("once-2"),
        [1],
        "the redeliveries counted nothing"
    );

    // With it (the default), a redelivery to the replica that cached the conversation skips the
    // load that finds the receipt: the worker runs once more, that run's commit meets the
    // receipt and is thrown away, and the stored answer is returned (README, guarantees).
    let cached = TestApp::memory()
        .config(|c| remote(c, "counter", &worker.url()))
        .spawn()
        .await;
    deliver_four_times(&cached, &worker, "cached-1", 1).await;
    deliver_four_times(&cached, &worker, "cached-2", 2).await;
    let calls = worker.calls("cached-2");
    assert!(
        calls.len() <= 4 && calls.iter().all(|&a| a == 1),
        "each call at most one wasted run: {calls:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_typescript_counter_survives_a_replica_sigkill_with_every_count_exact() {
    const SHAPE: Shape = Shape {
        workers: 12,
        duration: Duration::from_secs(5),
        conversations: 20,
        hot: 2,
        hot_share: 0.3,
        call_timeout: Duration::from_secs(3),
        turn_bound: Duration::from_secs(20),
    };
    const VICTIM: usize = 1;
    let worker = WorkerProcess::node(&["dist/examples/counter.js", "127.0.0.1:0"]);
    let url = support::pg::fresh_database().await;
    // `counter` is the TypeScript worker here: it replaces the built-in counter bot.
    let remote_bots = format!("counter={}", worker.url());
    let mut fleet =
        Fleet::start_with_env(3, &url, &[("TURNSTILE_REMOTE_BOTS", remote_bots.as_str())]).await;
    let gateway = Gateway::new(&fleet.addrs(), SHAPE.call_timeout);
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let gateway = gateway.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move { gateway.run(SHAPE, "ts-kill", stop).await })
    };
    sleep(Duration::from_secs(2)).await;
    let calls_before = worker.all_calls();
    fleet.kill(VICTIM);
    sleep(Duration::from_secs(1)).await;
    fleet.restart(VICTIM).await;
    let over = Instant::now();
    sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();

    let mut record = gateway.take_record();
    for (i, turn) in std::mem::take(&mut record.unacked).into_iter().enumerate() {
        gateway
            .deliver(&turn, i, Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("{turn:?} could not be delivered after the kill"));
    }
    let settled = gateway.take_record();
    record.acks.extend(settled.acks);
    record.failures.extend(settled.failures);

    let counts = check::final_counts(&url, SHAPE.conversations).await;
    let receipts = check::receipts(&url).await;
    let proof = check::prove(&record, &counts, &receipts);
    assert!(
        calls_before > 0,
        "the worker was never called before the kill"
    );
    assert!(
        record
            .acks
            .iter()
            .any(|a| a.server == VICTIM && a.at > over),
        "the restarted replica answered no turn"
    );
    let internal = record
        .failures
        .iter()
        .filter(|(_, f)| *f == Failure::Status(Code::Internal))
        .count();
    assert_eq!(internal, 0, "INTERNAL during a replica kill");
    eprintln!(
        "{} turns over {} conversations, {} applied; {} failures retried; {} worker calls",
        proof.turns,
        proof.conversations,
        proof.applied,
        record.failures.len(),
        worker.all_calls()
    );
    for (status, log) in fleet.stop() {
        assert!(status.success(), "a server did not stop cleanly:\n{log}");
    }
}

// --- failures: down, slow, raising ----------------------------------------------------------

/// `moody.py`, a Python worker. Its bot `moody` counts every message, then fails as the text
/// asks; `remember X` keeps X in the state without counting. Its bot `together` is a plain
/// function that answers only once four of its turns are running at the same time.
const MOODY: &str = r#"import asyncio
import json
import threading

from turnstile_worker import Worker

worker = Worker()

# Lets its callers through only when four wait at once (else it breaks, after 20 s).
TOGETHER = threading.Barrier(4, timeout=20)


@worker.bot("moody")
async def moody(turn):
    if turn.text == "scopes":
        turn.send(f"user: {turn.user is not None}, private: {turn.private_conversation is not None}")
        return
    if turn.text == "peek":
        seen = turn.conversation.get("count", 0)
        if turn.attempt == 1:
            await asyncio.sleep(3)
        turn.send(f"seen: {seen}")
        return
    if turn.text.startswith("remember "):
        turn.conversation["secret"] = turn.text[len("remember "):]
        turn.send("remembered")
        return
    count = turn.conversation.get("count", 0) + 1
    turn.conversation["count"] = count
    turn.send(f"count: {count}")
    if turn.text.startswith("boom"):
        raise ValueError(f"no pizza today, with {dict(turn.conversation)} after {turn.text!r}")
    if turn.text.startswith("parse"):
        json.loads(turn.text)
    if turn.text == "slow":
        await asyncio.sleep(10)


@worker.bot("drafter-py")
def drafter(turn):
    # A plain handler, in a thread: its drafts cross to the event loop.
    count = turn.conversation.get("count", 0) + 1
    turn.conversation["count"] = count
    turn.inform("Thinking…")
    turn.draft("x" * 100 if turn.text == "huge" else "half an answer")
    if turn.text == "fail":
        raise RuntimeError("the model went away")
    turn.draft(f"count: {count}")
    turn.send(f"count: {count}")


@worker.bot("together")
def together(turn):
    TOGETHER.wait()
    turn.send("together")


asyncio.run(worker.serve("127.0.0.1:0"))
"#;

/// `moody.ts`, the TypeScript twin of `moody.py`'s failing bot: `remember X` keeps X in the
/// state; `parse…` fails inside `JSON.parse`; anything else throws. And `drafter-ts`, like
/// `moody.py`'s `drafter-py`.
const MOODY_TS: &str = r#"import { Worker, type Turn } from 'turnstile-worker';

function moody(turn: Turn): void {
  if (turn.text.startsWith('remember ')) {
    turn.conversation.secret = turn.text.slice('remember '.length);
    turn.send('remembered');
    return;
  }
  turn.conversation.count = Number(turn.conversation.count ?? 0) + 1;
  if (turn.text.startsWith('parse')) JSON.parse(turn.text);
  throw new TypeError(`no pizza today, with ${JSON.stringify(turn.conversation)} after ${turn.text}`);
}

async function drafter(turn: Turn): Promise<void> {
  const count = Number(turn.conversation.count ?? 0) + 1;
  turn.conversation.count = count;
  await turn.inform('Thinking…');
  await turn.draft(turn.text === 'huge' ? 'x'.repeat(100) : 'half an answer');
  if (turn.text === 'fail') throw new RangeError('the model went away');
  await turn.draft(`count: ${count}`);
  turn.send(`count: ${count}`);
}

new Worker().bot('moody', moody).bot('drafter-ts', drafter).serve(process.argv[2] ?? '127.0.0.1:0');
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_raising_slow_or_down_fails_the_turn_with_its_status_and_commits_nothing() {
    let mut worker = WorkerProcess::moody_py();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut app = TestApp::shared(Arc::clone(&store))
        .config(|c| remote(c, "moody", &worker.url()))
        .spawn()
        .await;

    let raised = app
        .client
        .process_turn(to_bot("moody", "m", "boom-1", "boom"))
        .await
        .unwrap_err();
    assert_eq!(raised.code(), Code::Internal, "{raised:?}");
    assert_eq!(reason(&raised), "BOT_FAILED");
    let line = line_of(MOODY, "raise ValueError(");
    assert!(
        raised.message().contains("bot worker `moody` failed")
            && raised
                .message()
                .contains(&format!("raised ValueError in moody (moody.py:{line})")),
        "the message names the worker and the problem: {raised:?}"
    );

    let mut slow = tonic::Request::new(to_bot("moody", "m", "slow-1", "slow"));
    slow.set_timeout(Duration::from_secs(3));
    let started = Instant::now();
    let late = app.client.process_turn(slow).await.unwrap_err();
    assert_eq!(late.code(), Code::DeadlineExceeded, "{late:?}");
    assert!(started.elapsed() < Duration::from_secs(9), "not cut short");
    if !late.details().is_empty() {
        // The server's answer (not the client's own timer, which may fire first).
        assert_eq!(reason(&late), "DEADLINE_EXCEEDED", "{late:?}");
    }
    assert_eq!(
        worker.calls_settled("slow-1", 1).await,
        [1],
        "the slow worker was called"
    );

    let ok = app
        .client
        .process_turn(to_bot("moody", "m", "ok-1", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        texts(&ok),
        ["count: 1"],
        "the failed turns committed nothing"
    );
    assert_eq!(ok.version, 1);

    worker.kill();
    let down = app
        .client
        .process_turn(to_bot("moody", "m", "down-1", "hi"))
        .await
        .unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert_eq!(reason(&down), "BOT_UNAVAILABLE");
    assert!(down.get_details_retry_info().is_some(), "{down:?}");
    assert!(down.message().contains("bot worker `moody`"), "{down:?}");

    // The worker back (on another port, so through another server over the same store): the
    // turn that found it down had committed nothing.
    let back = WorkerProcess::moody_py();
    let mut other = TestApp::shared(Arc::clone(&store))
        .config(|c| remote(c, "moody", &back.url()))
        .spawn()
        .await;
    let after = other
        .client
        .process_turn(to_bot("moody", "m", "down-1", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&after), ["count: 2"]);
    assert!(
        !after.redelivered,
        "the turn was not committed while the worker was down"
    );

    // Killed in the middle of a call: the connection breaks under it, and that is UNAVAILABLE
    // too (the client library says UNKNOWN with a transport error).
    let mut back = back;
    let cut = {
        let mut client = other.client.clone();
        tokio::spawn(async move {
            let mut slow = tonic::Request::new(to_bot("moody", "m", "slow-2", "slow"));
            slow.set_timeout(Duration::from_secs(30));
            client.process_turn(slow).await
        })
    };
    assert_eq!(back.calls_settled("slow-2", 1).await, [1]);
    back.kill();
    let cut = cut.await.unwrap().unwrap_err();
    assert_eq!(cut.code(), Code::Unavailable, "{cut:?}");
    assert_eq!(reason(&cut), "BOT_UNAVAILABLE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_turn_that_only_read_a_scope_is_replayed_when_it_moved() {
    let worker = WorkerProcess::moody_py();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let start = || {
        TestApp::shared(Arc::clone(&store))
            .config(|c| remote(c, "moody", &worker.url()))
            .spawn()
    };
    let (a, mut b) = tokio::join!(start(), start());
    let peeking = {
        let mut client = a.client.clone();
        tokio::spawn(async move {
            client
                .process_turn(to_bot("moody", "p", "peek-1", "peek"))
                .await
                .unwrap()
                .into_inner()
        })
    };
    let until = Instant::now() + Duration::from_secs(60);
    while worker.calls("peek-1").is_empty() {
        assert!(Instant::now() < until, "the worker was never called");
        sleep(Duration::from_millis(10)).await;
    }
    // While the peek sleeps in the worker, another replica changes what it read.
    let changed = b
        .client
        .process_turn(to_bot("moody", "p", "count-1", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&changed), ["count: 1"]);
    let peeked = peeking.await.unwrap();
    assert_eq!(
        (texts(&peeked), peeked.attempts),
        (vec!["seen: 1".to_owned()], 2),
        "the SDK reported the read, so the stale answer was replayed"
    );
    assert_eq!(worker.calls_settled("peek-1", 2).await, [1, 2]);
}

/// A worker's bot given only its conversation's scope (`--bot-scopes`) is sent no other, and the
/// SDK shows it none; unnamed, it gets every scope, as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_python_bot_given_only_its_conversation_scope_is_sent_no_other() {
    let worker = WorkerProcess::moody_py();
    for (given, says) in [
        (vec![], "user: True, private: True"),
        (
            vec![("moody".to_owned(), Scopes::CONVERSATION)],
            "user: False, private: False",
        ),
    ] {
        let mut app = TestApp::memory()
            .config(|c| Config {
                bot_scopes: given.clone(),
                ..remote(c, "moody", &worker.url())
            })
            .spawn()
            .await;
        let answer = app
            .client
            .process_turn(to_bot("moody", "s", "scopes-1", "scopes"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(texts(&answer), [says], "{given:?}");
    }
}

// --- bot errors: the whole story in the worker's log, the place in the status ----------------

/// Kept in the state before the failing turn: the failure's status must not show it.
const SECRET_STATE: &str = "sesame-4217";
/// Said in the failing turn: the failure's status must not show it either.
const SECRET_TEXT: &str = "said the cat";

/// Has `moody` (served by `worker`) remember [`SECRET_STATE`], then sends it `{failing}
/// {SECRET_TEXT}`, which fails in the bot with an error whose message quotes both. Returns that
/// turn's status, checked to be `INTERNAL`, `BOT_FAILED`, and to quote neither.
async fn fail_with_secrets(worker: &WorkerProcess, failing: &str) -> Status {
    let mut app = TestApp::memory()
        .config(|c| remote(c, "moody", &worker.url()))
        .spawn()
        .await;
    let conversation = format!("secrets-{failing}");
    let remembered = app
        .client
        .process_turn(to_bot(
            "moody",
            &conversation,
            &format!("{failing}-remember"),
            &format!("remember {SECRET_STATE}"),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&remembered), ["remembered"]);
    let status = app
        .client
        .process_turn(to_bot(
            "moody",
            &conversation,
            &format!("{failing}-fail"),
            &format!("{failing} {SECRET_TEXT}"),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert_eq!(reason(&status), "BOT_FAILED", "{status:?}");
    let shown = format!(
        "{} {}",
        status.message(),
        String::from_utf8_lossy(status.details())
    );
    for secret in [SECRET_STATE, SECRET_TEXT, "no pizza today"] {
        assert!(
            !shown.contains(secret),
            "the status quotes the error's message ({secret:?}): {status:?}"
        );
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_bot_error_is_logged_whole_and_named_by_its_place_without_the_state() {
    let worker = WorkerProcess::moody_py();
    let project = &tokio::task::block_in_place(python_sdk).project;

    let raise = line_of(MOODY, "raise ValueError(");
    let status = fail_with_secrets(&worker, "boom").await;
    assert!(
        status.message().contains(&format!(
            "bot worker `moody` failed: Internal: the bot raised ValueError in moody (moody.py:{raise})"
        )),
        "the status names the exception, the function, the file and the line: {status:?}"
    );
    // The worker's log has the traceback, message and all.
    let frame = format!(
        "File \"{}\", line {raise}, in moody",
        project.join("moody.py").display()
    );
    let log = worker.stderr_settled(&frame).await;
    assert!(
        log.contains("bot 'moody' failed on activity boom-fail (attempt 1)")
            && log.contains("Traceback (most recent call last):")
            && log.contains(&frame)
            && log.contains(&format!(
                "ValueError: no pizza today, with {{'secret': '{SECRET_STATE}'"
            )),
        "the worker's log has the whole traceback:\n{log}"
    );

    // Raised inside a library: its place, then the bot's own line that called it.
    let parse = line_of(MOODY, "json.loads(");
    let status = fail_with_secrets(&worker, "parse").await;
    assert!(
        status
            .message()
            .contains("the bot raised JSONDecodeError in ")
            && status
                .message()
                .contains(&format!(", called from moody (moody.py:{parse})")),
        "{status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typescript_bot_error_is_logged_whole_and_named_by_its_place_without_the_state() {
    let worker = WorkerProcess::node(&["dist/moody.js", "127.0.0.1:0"]);
    let project = &tokio::task::block_in_place(node_sdk).project;

    // Source maps on, so both name lines of moody.ts, not of the compiled moody.js.
    let throw = line_of(MOODY_TS, "throw new TypeError(");
    let status = fail_with_secrets(&worker, "boom").await;
    assert!(
        status.message().contains(&format!(
            "bot worker `moody` failed: Internal: the bot threw TypeError in moody (moody.ts:{throw}:"
        )),
        "the status names the error, the function, the file and the line: {status:?}"
    );
    let frame = format!("at moody ({}:{throw}:", project.join("moody.ts").display());
    let log = worker.stderr_settled(&frame).await;
    assert!(
        log.contains("bot 'moody' failed on activity boom-fail (attempt 1)")
            && log.contains(&frame)
            && log.contains(&format!(
                "TypeError: no pizza today, with {{\"secret\":\"{SECRET_STATE}\""
            )),
        "the worker's log has the whole stack:\n{log}"
    );

    // Thrown inside a dependency: its place, then the bot's own line that called it.
    let parse = line_of(MOODY_TS, "JSON.parse(");
    let status = fail_with_secrets(&worker, "parse").await;
    assert!(
        status.message().contains(&format!(
            "the bot threw SyntaxError in JSON.parse (<anonymous>), called from moody (moody.ts:{parse}:"
        )),
        "{status:?}"
    );
}

// --- the Python SDK runs plain handlers off its event loop -----------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plain_python_handler_that_blocks_holds_up_no_other_turn() {
    let worker = WorkerProcess::moody_py();
    let app = TestApp::memory()
        .config(|c| remote(c, "together", &worker.url()))
        .spawn()
        .await;
    // `together` blocks its thread until four of its turns are in it at once: they all pass only
    // if the worker runs four plain handlers at the same time. Run on the event loop, the first
    // would block it, the others would never start, and the barrier would break.
    let turns = (0..4).map(|i| {
        let mut client = app.client.clone();
        tokio::spawn(async move {
            let conversation = format!("together-{i}");
            client
                .process_turn(to_bot("together", &conversation, &conversation, "hi"))
                .await
        })
    });
    for (i, turn) in turns.collect::<Vec<_>>().into_iter().enumerate() {
        let answer = turn
            .await
            .unwrap()
            .unwrap_or_else(|s| panic!("turn {i} did not run beside the others: {s:?}"))
            .into_inner();
        assert_eq!(texts(&answer), ["together"]);
    }
}

// --- the READMEs' bots and the examples, as their users run them ----------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_bots_and_the_examples_answer_as_written() {
    let python = tokio::task::block_in_place(python_sdk);
    let greeter = WorkerProcess::python(&python.project.join("greeter.py"), &[]);
    let counter_py =
        WorkerProcess::python(&python.sdk.join("examples/counter.py"), &["127.0.0.1:0"]);
    let counter_ts = WorkerProcess::node(&["dist/counter.js"]);
    let mut counter_js = node_command(&["examples/counter.js", "127.0.0.1:0"]);
    counter_js.env("BOT_NAME", "counter-js");
    let counter_js = WorkerProcess::spawn(counter_js);
    let mut app = TestApp::memory()
        .config(|c| {
            remotes(
                c,
                &[
                    ("greeter", &greeter.url()),
                    ("counter-py", &counter_py.url()),
                    ("counter", &counter_ts.url()),
                    ("counter-js", &counter_js.url()),
                ],
            )
        })
        .spawn()
        .await;
    for n in 1..=2 {
        let greeted = app
            .client
            .process_turn(to_bot(
                "greeter",
                "readme-greeter",
                &format!("greet-{n}"),
                "hi",
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            texts(&greeted),
            [format!("Hello alice, message {n} from you.")]
        );
        for bot in ["counter-py", "counter", "counter-js"] {
            let counted = app
                .client
                .process_turn(to_bot(
                    bot,
                    &format!("readme-{bot}"),
                    &format!("{bot}-{n}"),
                    "hi",
                ))
                .await
                .unwrap_or_else(|s| panic!("{bot}: {s:?}"))
                .into_inner();
            assert_eq!(texts(&counted), [format!("count: {n}")], "{bot}");
        }
    }
}

// --- streaming: the llm samples' drafts through StreamTurn ----------------------------------

/// Every event of a `StreamTurn` call, and how it ended.
async fn stream_turn(
    app: &TestApp,
    bot: &str,
    activity: pb::Activity,
) -> (Vec<StreamEvent>, Result<(), Status>) {
    let mut client = app.client.clone();
    let mut events = Vec::new();
    let mut stream = match client
        .stream_turn(pb::StreamTurnRequest::typed(activity, bot))
        .await
    {
        Ok(response) => response.into_inner(),
        Err(status) => return (events, Err(status)),
    };
    loop {
        match stream.message().await {
            Ok(Some(response)) => events.push(response.event.unwrap()),
            Ok(None) => return (events, Ok(())),
            Err(status) => return (events, Err(status)),
        }
    }
}

/// The committed outcome, which must be the last event and the only one.
fn streamed_outcome(events: &[StreamEvent]) -> &pb::ProcessTurnResponse {
    let outcomes = events
        .iter()
        .filter(|e| matches!(e, StreamEvent::Outcome(_)))
        .count();
    assert_eq!(outcomes, 1, "{events:?}");
    match events.last() {
        Some(StreamEvent::Outcome(outcome)) => outcome,
        other => panic!("the last event is not the outcome: {other:?}"),
    }
}

/// Checks a streamed llm sample's answer to its `n`th message: a status line, then the reply's
/// growing text, then the outcome, whose reply is the last draft.
fn check_llm_stream(bot: &str, n: usize, events: &[StreamEvent]) {
    let drafts: Vec<&pb::Draft> = events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Draft(d) => Some(d),
            _ => None,
        })
        .collect();
    assert!(drafts.len() > 10, "{bot}: a draft per word: {events:?}");
    assert_eq!(drafts[0].kind(), pb::DraftKind::Informative, "{bot}");
    assert_eq!(drafts[0].text, "Thinking…", "{bot}");
    for (i, draft) in drafts.iter().enumerate() {
        assert_eq!(draft.sequence, u32::try_from(i + 1).unwrap(), "{bot}");
        assert_eq!(draft.attempt, 1, "{bot}");
    }
    let text: Vec<&str> = drafts[1..]
        .iter()
        .map(|d| {
            assert_eq!(d.kind(), pb::DraftKind::Text, "{bot}");
            d.text.as_str()
        })
        .collect();
    for pair in text.windows(2) {
        assert!(
            pair[1].starts_with(pair[0]) && pair[1].len() > pair[0].len(),
            "{bot}: the text so far grows: {pair:?}"
        );
    }
    let committed = streamed_outcome(events);
    assert!(!committed.redelivered, "{bot}");
    assert_eq!(
        texts(committed),
        [*text.last().unwrap()],
        "{bot}: the last draft is the committed reply"
    );
    assert!(
        text.last()
            .unwrap()
            .contains(&format!("answer number {n} of")),
        "{bot}: the transcript counts the turns: {text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_and_typescript_llm_samples_stream_their_tokens_and_commit_the_whole_answer() {
    let python = tokio::task::block_in_place(python_sdk);
    let mut llm_py = python_command(&python.sdk.join("examples/llm.py"), &["127.0.0.1:0"]);
    llm_py.env("LLM_TOKEN_DELAY_MS", "2");
    let llm_py = WorkerProcess::spawn(llm_py);
    let mut llm_ts = node_command(&["dist/examples/llm.js", "127.0.0.1:0"]);
    llm_ts.env("LLM_TOKEN_DELAY_MS", "2");
    let llm_ts = WorkerProcess::spawn(llm_ts);
    let mut app = TestApp::postgres()
        .config(|c| remotes(c, &[("llm-py", &llm_py.url()), ("llm-ts", &llm_ts.url())]))
        .spawn()
        .await;

    for (bot, worker) in [("llm-py", &llm_py), ("llm-ts", &llm_ts)] {
        let conversation = format!("stream-{bot}");
        let first = message(&conversation, "ada", "hello");
        let id = first.id.clone().unwrap();
        let (events, ended) = stream_turn(&app, bot, first.clone()).await;
        ended.unwrap_or_else(|s| panic!("{bot}: {s:?}\n{}", worker.stderr()));
        check_llm_stream(bot, 1, &events);
        let committed = streamed_outcome(&events).clone();
        assert_eq!(committed.version, 1, "{bot}");

        // A redelivery gets the outcome alone: the worker is not called, nothing is drafted.
        let (again, ended) = stream_turn(&app, bot, first).await;
        ended.unwrap();
        assert_eq!(again.len(), 1, "{bot}: the outcome alone: {again:?}");
        let redelivered = streamed_outcome(&again);
        assert!(redelivered.redelivered, "{bot}");
        assert_eq!(texts(redelivered), texts(&committed), "{bot}");
        assert_eq!(
            worker.stream_calls(&id),
            1,
            "{bot}: called once:\n{}",
            worker.stderr()
        );

        // The transcript was kept: the second answer knows it is the second.
        let (events, ended) = stream_turn(&app, bot, message(&conversation, "ada", "again")).await;
        ended.unwrap();
        check_llm_stream(bot, 2, &events);

        // A turn nobody streams just answers, through RunTurn.
        let unstreamed = message(&conversation, "ada", "quietly");
        let unstreamed_id = unstreamed.id.clone().unwrap();
        let reply = app
            .client
            .process_turn(pb::ProcessTurnRequest::typed(unstreamed, bot))
            .await
            .unwrap()
            .into_inner();
        assert!(
            texts(&reply)[0].contains("answer number 3 of"),
            "{bot}: {reply:?}"
        );
        assert_eq!(
            worker.calls_settled(&unstreamed_id, 1).await,
            [1],
            "{bot}: RunTurn"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_turn_cancels_the_llm_samples_handler_and_commits_what_was_shown() {
    let python = tokio::task::block_in_place(python_sdk);
    // Slow enough to press Stop mid-answer: about three seconds for the whole.
    let mut llm_py = python_command(&python.sdk.join("examples/llm.py"), &["127.0.0.1:0"]);
    llm_py.env("LLM_TOKEN_DELAY_MS", "150");
    let llm_py = WorkerProcess::spawn(llm_py);
    let mut llm_ts = node_command(&["dist/examples/llm.js", "127.0.0.1:0"]);
    llm_ts.env("LLM_TOKEN_DELAY_MS", "150");
    let llm_ts = WorkerProcess::spawn(llm_ts);
    let mut app = TestApp::postgres()
        .config(|c| remotes(c, &[("llm-py", &llm_py.url()), ("llm-ts", &llm_ts.url())]))
        .spawn()
        .await;

    for (bot, worker) in [("llm-py", &llm_py), ("llm-ts", &llm_ts)] {
        let activity = message(&format!("stop-{bot}"), "ada", "hello");
        let id = activity.id.clone().unwrap();
        let mut stream = app
            .client
            .clone()
            .stream_turn(pb::StreamTurnRequest::typed(activity.clone(), bot))
            .await
            .unwrap()
            .into_inner();
        // The user sees a few words, then presses Stop.
        let mut events = Vec::new();
        let shown = loop {
            let event = stream.message().await.unwrap().unwrap().event.unwrap();
            let words = match &event {
                StreamEvent::Draft(d) if d.kind() == pb::DraftKind::Text => {
                    Some(d.text.clone()).filter(|t| t.split(' ').count() >= 4)
                }
                _ => None,
            };
            events.push(event);
            if let Some(words) = words {
                break words;
            }
        };
        let stopped = app
            .client
            .stop_turn(pb::StopTurnRequest {
                bot: bot.into(),
                channel_id: activity.channel_id.clone().unwrap(),
                conversation_id: activity.conversation.clone().unwrap().id.unwrap(),
                activity_id: id.clone(),
                shown_text: Some(shown.clone()),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(stopped.result(), pb::StopTurnResult::Stopped, "{bot}");
        while let Some(response) = stream.message().await.unwrap() {
            events.push(response.event.unwrap());
        }
        let committed = streamed_outcome(&events);
        assert!(committed.stopped, "{bot}: {committed:?}");
        assert_eq!(texts(committed), [shown.as_str()], "{bot}: what was shown");
        assert_eq!(
            committed.version, 0,
            "{bot}: the transcript in state is unchanged"
        );
        // The handler itself was stopped: the worker says so.
        let stderr = worker
            .stderr_settled(&format!("cancelled on activity {id}"))
            .await;
        assert!(
            stderr.contains(&format!("cancelled on activity {id}")),
            "{bot}: {stderr}"
        );
        assert!(!stderr.contains("failed on activity"), "{bot}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_bot_that_drafts_then_fails_or_drafts_too_much_commits_nothing() {
    let python = WorkerProcess::moody_py();
    let typescript = WorkerProcess::node(&["dist/moody.js"]);
    let app = TestApp::postgres()
        .config(|c| {
            let mut config = remotes(
                c,
                &[
                    ("drafter-py", &python.url()),
                    ("drafter-ts", &typescript.url()),
                ],
            );
            config.limits.max_text_bytes = 64;
            config
        })
        .spawn()
        .await;
    for (bot, failure) in [
        (
            "drafter-py",
            "the bot raised RuntimeError in drafter (moody.py:",
        ),
        (
            "drafter-ts",
            "the bot threw RangeError in drafter (moody.ts:",
        ),
    ] {
        let conversation = format!("drafts-{bot}");
        let (events, ended) = stream_turn(&app, bot, message(&conversation, "ada", "fail")).await;
        let status = ended.expect_err(bot);
        assert_eq!(status.code(), Code::Internal, "{bot}: {status:?}");
        assert_eq!(reason(&status), "BOT_FAILED", "{bot}");
        assert!(status.message().contains(failure), "{bot}: {status:?}");
        assert!(
            !status.message().contains("half an answer") && !status.message().contains("went away"),
            "{bot}: no draft or error text in the status: {status:?}"
        );
        assert!(
            !events.iter().any(|e| matches!(e, StreamEvent::Outcome(_))),
            "{bot}"
        );

        let (events, ended) = stream_turn(&app, bot, message(&conversation, "ada", "huge")).await;
        let status = ended.expect_err(bot);
        assert_eq!(status.code(), Code::Internal, "{bot}: {status:?}");
        assert!(
            status.message().starts_with(&format!(
                "bot worker `{bot}` sent a draft of 100 bytes, over the limit of 64 bytes"
            )),
            "{bot}: {status:?}"
        );
        assert!(
            !events.iter().any(|e| matches!(e, StreamEvent::Outcome(_))),
            "{bot}"
        );

        // Neither committed anything: the next turn counts from zero.
        let (events, ended) = stream_turn(&app, bot, message(&conversation, "ada", "ok")).await;
        ended.unwrap();
        let drafts: Vec<String> = events
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Draft(d) => Some(format!("{:?} {}", d.kind(), d.text)),
                _ => None,
            })
            .collect();
        assert_eq!(
            drafts,
            [
                "Informative Thinking…",
                "Text half an answer",
                "Text count: 1"
            ],
            "{bot}"
        );
        let committed = streamed_outcome(&events);
        assert_eq!(texts(committed), ["count: 1"], "{bot}");
        assert_eq!(committed.version, 1, "{bot}");
    }
}

// --- failures: garbage and oversized answers; replays on conflict (a worker in Rust) ---------

/// A worker for bot `fake` that counts like the counter bot and answers garbage when asked,
/// recording every call as (activity id, attempt, conversation state).
#[derive(Default)]
struct FakeWorker {
    calls: Mutex<Vec<(String, u32, String)>>,
    gate: tokio::sync::Notify,
}

/// The gRPC service of a [`FakeWorker`].
struct FakeService(Arc<FakeWorker>);

#[tonic::async_trait]
impl pb::bot_worker_server::BotWorker for FakeService {
    async fn run_turn(
        &self,
        request: tonic::Request<pb::RunTurnRequest>,
    ) -> Result<tonic::Response<pb::RunTurnResponse>, Status> {
        let request = request.into_inner();
        let activity: serde_json::Value = serde_json::from_str(&request.activity_json).unwrap();
        let id = activity["id"].as_str().unwrap_or_default().to_owned();
        let text = activity["text"].as_str().unwrap_or_default().to_owned();
        let state_json = request.conversation.as_ref().unwrap().state_json.clone();
        self.0
            .calls
            .lock()
            .unwrap()
            .push((id, request.attempt, state_json.clone()));
        if text.starts_with("wait") && request.attempt == 1 {
            self.0.gate.notified().await;
        }
        let state: serde_json::Value = serde_json::from_str(&state_json).unwrap();
        let count = state["count"].as_u64().unwrap_or(0) + 1;
        let mut reply = serde_json::json!({"text": format!("count: {count}")}).to_string();
        let mut new_state = serde_json::json!({"count": count}).to_string();
        let conversation = match text.as_str() {
            // Reads the state, changes nothing.
            "wait-peek" => pb::ScopeOutcome {
                read: true,
                replaced_json: None,
            },
            _ => pb::ScopeOutcome {
                read: true,
                replaced_json: Some(new_state.clone()),
            },
        };
        match text.as_str() {
            "error" => return Err(Status::internal("the model provider refused")),
            "garbage-state" => new_state = "[1, 2]".into(),
            "garbage-reply" => reply = "count: one".into(),
            "huge" => {
                reply = serde_json::json!({"text": "x".repeat(5 << 20)}).to_string();
            }
            _ => {}
        }
        let conversation = match conversation.replaced_json {
            Some(_) => pb::ScopeOutcome {
                read: true,
                replaced_json: Some(new_state),
            },
            None => conversation,
        };
        Ok(tonic::Response::new(pb::RunTurnResponse {
            replies_json: vec![reply],
            conversation: Some(conversation),
            user: None,
            private_conversation: None,
        }))
    }

    type StreamRunTurnStream = tokio_stream::Empty<Result<pb::StreamRunTurnResponse, Status>>;

    /// A worker from before streaming: Turnstile calls RunTurn instead.
    async fn stream_run_turn(
        &self,
        _: tonic::Request<pb::StreamRunTurnRequest>,
    ) -> Result<tonic::Response<Self::StreamRunTurnStream>, Status> {
        Err(Status::unimplemented("no streaming"))
    }
}

impl FakeWorker {
    /// Serves on a free port; returns its URL.
    async fn serve(self: &Arc<Self>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let service = pb::bot_worker_server::BotWorkerServer::new(FakeService(Arc::clone(self)))
            .max_encoding_message_size(usize::MAX);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        url
    }

    fn attempts(&self, id: &str) -> Vec<(u32, String)> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(i, _, _)| i == id)
            .map(|(_, a, s)| (*a, s.clone()))
            .collect()
    }
}

/// An app over `store` hosting the worker at `worker_url` as `fake`.
async fn app_for(worker_url: &str, store: &Arc<dyn Store>) -> TestApp {
    TestApp::shared(Arc::clone(store))
        .config(|c| remote(c, "fake", worker_url))
        .spawn()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_or_oversized_answer_is_internal_naming_the_problem_and_commits_nothing() {
    let worker = Arc::new(FakeWorker::default());
    let url = worker.serve().await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut app = app_for(&url, &store).await;

    for (text, problem) in [
        (
            "garbage-state",
            "bot worker `fake` answered conversation state that is not a JSON object",
        ),
        (
            "garbage-reply",
            "bot worker `fake` answered reply 1 that is not valid JSON",
        ),
        ("huge", "bot worker `fake` answered more than 4194304 bytes"),
        (
            "error",
            "bot worker `fake` failed: Internal: the model provider refused",
        ),
    ] {
        let status = app
            .client
            .process_turn(to_bot("fake", "g", text, text))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{text}: {status:?}");
        assert_eq!(reason(&status), "BOT_FAILED", "{text}");
        assert!(
            status.message().starts_with(problem),
            "{text}: the message should name the problem: {:?}",
            status.message()
        );
    }
    let ok = app
        .client
        .process_turn(to_bot("fake", "g", "fine", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&ok), ["count: 1"], "nothing was committed before");
    let reply = &ok.activities[0];
    assert_eq!(
        reply.reply_to_id.as_deref(),
        Some("fine"),
        "a worker's reply is addressed back like an in-process bot's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_calls_the_worker_again_with_the_fresh_state() {
    let worker = Arc::new(FakeWorker::default());
    let url = worker.serve().await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let a = app_for(&url, &store).await;
    let mut b = app_for(&url, &store).await;

    // Replica A's turn reads the state, then waits inside the worker.
    let waiting = {
        let mut client = a.client.clone();
        tokio::spawn(async move {
            client
                .process_turn(to_bot("fake", "race", "slow-turn", "wait"))
                .await
                .unwrap()
                .into_inner()
        })
    };
    let until = Instant::now() + Duration::from_secs(30);
    while worker.attempts("slow-turn").is_empty() {
        assert!(Instant::now() < until, "the worker was never called");
        sleep(Duration::from_millis(10)).await;
    }
    // Meanwhile replica B commits a turn of the same conversation.
    let fast = b
        .client
        .process_turn(to_bot("fake", "race", "fast-turn", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&fast), ["count: 1"]);
    worker.gate.notify_one();

    let slow = waiting.await.unwrap();
    assert_eq!(texts(&slow), ["count: 2"], "replayed on the fresh state");
    assert_eq!(slow.attempts, 2);
    assert_eq!(slow.version, 2);
    let attempts = worker.attempts("slow-turn");
    assert_eq!(
        attempts,
        [(1, "{}".to_owned()), (2, r#"{"count":1}"#.to_owned())],
        "attempt 2 got the state replica B committed"
    );

    // A turn that only read the state is version-checked too: the worker said it read it.
    let peeking = {
        let mut client = a.client.clone();
        tokio::spawn(async move {
            client
                .process_turn(to_bot("fake", "race", "peek-turn", "wait-peek"))
                .await
                .unwrap()
                .into_inner()
        })
    };
    while worker.attempts("peek-turn").is_empty() {
        assert!(Instant::now() < until, "the worker was never called");
        sleep(Duration::from_millis(10)).await;
    }
    b.client
        .process_turn(to_bot("fake", "race", "fast-turn-2", "hi"))
        .await
        .unwrap();
    worker.gate.notify_one();
    let peeked = peeking.await.unwrap();
    assert_eq!(peeked.attempts, 2, "the read was checked at commit");
    assert_eq!(
        texts(&peeked),
        ["count: 4"],
        "it answered from the fresh state"
    );
}

// --- double texting: coalesce and interrupt, with the Python SDK ----------------------------

/// `doubles.py`, a Python worker serving one bot as `coalescing` and as `interrupting`. Each run
/// it starts is appended to the file `argv[1]`, one JSON line (the activity's id and the ids of
/// `turn.batch` and of `turn.superseded`), and to the conversation's `runs`; a
/// message `wait` then waits until the file `argv[2]` exists (15 s at most). It answers every
/// message it was given, in order. `peek` answers the activity ids of the runs the conversation
/// holds, and records nothing.
const DOUBLES: &str = r#"import asyncio
import json
import os
import sys

from turnstile_worker import Worker

RUNS, GATE = sys.argv[1], sys.argv[2]

worker = Worker()


def ids(activities):
    return [a.get("id") for a in activities]


@worker.bot("coalescing")
@worker.bot("interrupting")
async def doubles(turn):
    if turn.text == "peek":
        turn.send(json.dumps([run["activity"] for run in turn.conversation.get("runs", [])]))
        return
    run = {
        "activity": turn.activity.get("id"),
        "batch": ids(turn.batch),
        "superseded": ids(turn.superseded),
    }
    with open(RUNS, "a") as runs:
        runs.write(json.dumps(run) + "\n")
    turn.conversation["runs"] = turn.conversation.get("runs", []) + [run]
    if turn.text == "wait":
        for _ in range(750):
            if os.path.exists(GATE):
                break
            await asyncio.sleep(0.02)
    said = turn.superseded + (turn.batch or [turn.activity])
    turn.send("answered: " + ", ".join(a.get("text", "") for a in said))


asyncio.run(worker.serve("127.0.0.1:0"))
"#;

/// One run `doubles.py` started, as it recorded it.
#[derive(Debug, serde::Deserialize)]
struct Run {
    activity: String,
    batch: Vec<String>,
    superseded: Vec<String>,
}

/// A `doubles.py` worker, with its run log and its gate in a directory of their own.
struct Doubles {
    worker: WorkerProcess,
    runs: PathBuf,
    gate: PathBuf,
}

impl Doubles {
    fn start(name: &str) -> Doubles {
        let project = &tokio::task::block_in_place(python_sdk).project;
        let dir = scratch().join(format!("doubles-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (runs, gate) = (dir.join("runs.jsonl"), dir.join("gate"));
        let worker = WorkerProcess::python(
            &project.join("doubles.py"),
            &[runs.to_str().unwrap(), gate.to_str().unwrap()],
        );
        Doubles { worker, runs, gate }
    }

    /// The runs the worker has started, in order (each is written before its answer is sent):
    /// the lines written whole so far.
    fn runs(&self) -> Vec<Run> {
        let log = std::fs::read_to_string(&self.runs).unwrap_or_default();
        let whole = log.rfind('\n').map_or(0, |end| end + 1);
        log[..whole]
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// [`Doubles::runs`] once there are `n`, or after 30 s.
    async fn runs_settled(&self, n: usize) -> Vec<Run> {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let runs = self.runs();
            if runs.len() >= n || Instant::now() > until {
                return runs;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Lets a run of `wait` go on.
    fn open_gate(&self) {
        std::fs::write(&self.gate, "").unwrap();
    }
}

/// Two replicas on one fresh database, hosting `bot` as `worker`'s with double-text `policy`
/// (`--remote-bot`, `--double-text`).
async fn double_text_replicas(
    bot: &str,
    worker: &WorkerProcess,
    policy: DoubleText,
) -> (TestApp, TestApp) {
    let url = support::pg::fresh_database().await;
    let start = || {
        TestApp::on(&url)
            .config(|c| Config {
                double_text: vec![(bot.to_owned(), policy)],
                ..remote(c, bot, &worker.url())
            })
            .spawn()
    };
    tokio::join!(start(), start())
}

/// `request` to `app`, on a task of its own.
async fn spawn_turn(
    app: &TestApp,
    request: pb::ProcessTurnRequest,
) -> tokio::task::JoinHandle<Result<pb::ProcessTurnResponse, Status>> {
    let mut client = app.client.clone();
    tokio::spawn(async move {
        client
            .process_turn(request)
            .await
            .map(tonic::Response::into_inner)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn coalesce_answers_the_messages_sent_during_a_python_turn_in_one_run_that_sees_them_all() {
    let doubles = Doubles::start("coalesce");
    let (a, b) = double_text_replicas("coalescing", &doubles.worker, DoubleText::Coalesce).await;
    let to = |id: &str, text: &str| to_bot("coalescing", "co", id, text);
    let first = spawn_turn(&a, to("co-wait", "wait")).await;
    assert_eq!(
        doubles.runs_settled(1).await.len(),
        1,
        "the worker never ran the first message:\n{}",
        doubles.worker.stderr()
    );

    // While it runs, three more messages arrive, on both replicas, in this order.
    let batch = [
        ("co-1", "one", &b),
        ("co-2", "two", &a),
        ("co-3", "three", &b),
    ];
    let mut calls = Vec::new();
    for (id, text, server) in batch {
        calls.push(spawn_turn(server, to(id, text)).await);
        sleep(Duration::from_millis(300)).await;
    }
    assert!(!first.is_finished(), "the first turn still runs");
    doubles.open_gate();

    let first = first
        .await
        .unwrap()
        .unwrap_or_else(|s| panic!("co-wait failed: {s:?}"));
    assert_eq!(texts(&first), ["answered: wait"], "{first:?}");
    assert!(
        first.coalesced.is_empty() || first.coalesced == ["co-wait"],
        "the first message was answered alone: {first:?}"
    );
    let ids = batch.map(|(id, _, _)| id);
    let mut answers = Vec::new();
    for (call, id) in calls.into_iter().zip(ids) {
        let answer = call
            .await
            .unwrap()
            .unwrap_or_else(|s| panic!("{id} failed: {s:?}"));
        assert_eq!(answer.coalesced, ids, "{id}: the batch, in arrival order");
        assert!(!answer.superseded, "{id}: {answer:?}");
        answers.push(answer);
    }
    let delivered: Vec<_> = ids
        .iter()
        .zip(&answers)
        .filter(|(_, answer)| !answer.activities.is_empty())
        .collect();
    assert_eq!(
        delivered.len(),
        1,
        "one call of the batch gets its answer: {answers:?}"
    );
    let (ran, answer) = delivered[0];
    assert_eq!(texts(answer), ["answered: one, two, three"]);

    // The worker ran twice: the first message alone, then the three, in arrival order.
    let runs = doubles.runs();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(runs[0].activity, "co-wait", "{runs:?}");
    assert!(
        runs[0].batch.is_empty() || runs[0].batch == ["co-wait"],
        "the first ran alone: {runs:?}"
    );
    assert_eq!(
        runs[1].batch, ids,
        "the second run's turn.batch holds the three: {runs:?}"
    );
    assert_eq!(
        runs[1].activity, *ran,
        "its turn.activity is the message of the call that got the answer: {runs:?}"
    );
    assert!(runs.iter().all(|run| run.superseded.is_empty()), "{runs:?}");

    // A redelivery of each, to the other replica, is answered from its receipt: no third run.
    for ((id, text, server), answer) in batch.into_iter().zip(&answers) {
        let other = if std::ptr::eq(server, &a) { &b } else { &a };
        let again = other
            .client
            .clone()
            .process_turn(to(id, text))
            .await
            .unwrap_or_else(|s| panic!("redelivering {id} failed: {s:?}"))
            .into_inner();
        assert!(again.redelivered, "{id}: {again:?}");
        assert_eq!(again.coalesced, ids, "{id}: {again:?}");
        assert_eq!(texts(&again), texts(answer), "{id}: the same answer again");
    }
    sleep(Duration::from_millis(200)).await;
    let runs = doubles.runs();
    assert_eq!(runs.len(), 2, "a redelivery ran the bot again: {runs:?}");
    assert_eq!(doubles.worker.all_calls(), 2, "{}", doubles.worker.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn interrupt_cancels_a_running_python_turn_and_the_next_run_sees_its_message_superseded() {
    let doubles = Doubles::start("interrupt");
    let (a, mut b) =
        double_text_replicas("interrupting", &doubles.worker, DoubleText::Interrupt).await;
    let to = |id: &str, text: &str| to_bot("interrupting", "in", id, text);
    // The first run records itself in the conversation state, then waits (on a gate this test
    // never opens: for 15 s, unless it is cancelled).
    let first = spawn_turn(&a, to("in-wait", "wait")).await;
    assert_eq!(
        doubles.runs_settled(1).await.len(),
        1,
        "the worker never ran the first message:\n{}",
        doubles.worker.stderr()
    );

    // A second message, on the other replica.
    let started = Instant::now();
    let second = b
        .client
        .process_turn(to("in-2", "second"))
        .await
        .unwrap_or_else(|s| panic!("in-2 failed: {s:?}"))
        .into_inner();
    assert_eq!(texts(&second), ["answered: wait, second"], "{second:?}");
    assert!(!second.superseded, "{second:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the second message waited for the first turn ({:?})",
        started.elapsed()
    );
    let first = first
        .await
        .unwrap()
        .unwrap_or_else(|s| panic!("in-wait failed: {s:?}"));
    assert!(first.superseded, "{first:?}");
    assert!(first.activities.is_empty(), "{first:?}");

    // Two runs: the first alone, then the second, given the first as superseded.
    let runs = doubles.runs();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(runs[0].activity, "in-wait", "{runs:?}");
    assert!(runs[0].superseded.is_empty(), "{runs:?}");
    assert_eq!(runs[1].activity, "in-2", "{runs:?}");
    assert_eq!(runs[1].superseded, ["in-wait"], "turn.superseded: {runs:?}");
    assert!(runs.iter().all(|run| run.batch.is_empty()), "{runs:?}");

    // Nothing of the first run was committed: the state holds the second run's write alone.
    let peeked = b
        .client
        .process_turn(to("in-peek", "peek"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&peeked), [r#"["in-2"]"#]);

    // A redelivery of the first, to either replica, is answered superseded without running.
    for server in [&a, &b] {
        let again = server
            .client
            .clone()
            .process_turn(to("in-wait", "wait"))
            .await
            .unwrap_or_else(|s| panic!("redelivering in-wait failed: {s:?}"))
            .into_inner();
        assert!(again.superseded, "{again:?}");
        assert!(again.redelivered, "{again:?}");
        assert!(again.activities.is_empty(), "{again:?}");
    }
    sleep(Duration::from_millis(200)).await;
    assert_eq!(doubles.runs().len(), 2, "{:?}", doubles.runs());
    assert_eq!(
        doubles.worker.calls("in-wait"),
        [1],
        "{}",
        doubles.worker.stderr()
    );
}
