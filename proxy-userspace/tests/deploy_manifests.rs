//! Offline checks of `deploy/`: every Kubernetes manifest parses into its
//! k8s-openapi type with no unknown field; the DaemonSet's command line,
//! probes, mounts and privileges agree with what the agent accepts and
//! serves (its own flag parser and config parser read them); the ClusterRole
//! only reads; the image recipe installs what the DaemonSet runs. No root,
//! no network, no API server.
//!
//! One test needs root: the image's iptables backend selection, run in
//! fresh network namespaces with Kubernetes-style rules in either backend.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use clap::Parser;
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, HTTPGetAction, PodSpec, Probe, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use proxy_userspace::config::{self, ConfigFile, Environment, RunFlags, Source};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;

/// The agent's command line as `main.rs` has it, for `run` (the only
/// subcommand the DaemonSet uses).
#[derive(Parser)]
#[command(name = "xproxy")]
enum Xproxy {
    Run(Box<RunFlags>),
}

/// The node name the tests pretend the kubelet substitutes.
const NODE_NAME: &str = "node-a";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("proxy-userspace has a parent directory")
        .to_owned()
}

fn deploy_dir() -> PathBuf {
    repo_root().join("deploy")
}

// ---------------------------------------------------------------------------
// Reading the manifests.

/// Every manifest under `deploy/`, by kind.
#[derive(Default)]
struct Manifests {
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
    daemon_sets: Vec<DaemonSet>,
}

impl Manifests {
    /// Reads every `.yaml`/`.yml` file under `dir`; the errors name the
    /// file and document.
    fn read(dir: &Path) -> (Manifests, Vec<String>) {
        let mut manifests = Manifests::default();
        let mut errors = Vec::new();
        for file in yaml_files(dir) {
            let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            let name = file.strip_prefix(repo_root()).unwrap_or(&file).display().to_string();
            if let Err(e) = manifests.add_text(&text) {
                errors.push(format!("{name}: {e}"));
            }
        }
        (manifests, errors)
    }

    /// Adds every document of one YAML text.
    fn add_text(&mut self, text: &str) -> Result<(), String> {
        let documents: Vec<Value> = serde_saphyr::from_multiple(text).map_err(|e| format!("not YAML: {e}"))?;
        let mut errors = Vec::new();
        for (index, document) in documents.into_iter().enumerate() {
            if document.is_null() {
                continue;
            }
            if let Err(e) = self.add(document) {
                errors.push(format!("document {index}: {e}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    fn add(&mut self, document: Value) -> Result<(), String> {
        let kind = document
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        match kind.as_str() {
            "ServiceAccount" => self.service_accounts.push(typed(document)?),
            "ClusterRole" => self.cluster_roles.push(typed(document)?),
            "ClusterRoleBinding" => self.cluster_role_bindings.push(typed(document)?),
            "ConfigMap" => self.config_maps.push(typed(document)?),
            "DaemonSet" => self.daemon_sets.push(typed(document)?),
            other => return Err(format!("kind {other:?} is not one this test knows")),
        }
        Ok(())
    }

    /// The manifests of `deploy/`; panics with every error found.
    fn load() -> Manifests {
        let (manifests, errors) = Manifests::read(&deploy_dir());
        assert!(errors.is_empty(), "invalid manifests:\n{}", errors.join("\n"));
        manifests
    }

    fn daemon_set(&self) -> &DaemonSet {
        match self.daemon_sets.as_slice() {
            [one] => one,
            other => panic!("expected one DaemonSet under deploy/, found {}", other.len()),
        }
    }

    fn config_map(&self, name: &str) -> &ConfigMap {
        self.config_maps
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no ConfigMap {name:?} under deploy/"))
    }
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            files.extend(yaml_files(&path));
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// `document` as a `T`, failing on a wrong type (with the field's path),
/// on any field `T` does not have (which the API server would drop, or
/// refuse with strict field validation) and on a missing required field.
fn typed<T: DeserializeOwned + Serialize>(document: Value) -> Result<T, String> {
    let mut unknown = Vec::new();
    let mut on_ignored = |path: serde_ignored::Path<'_>| {
        // The path without serde_ignored's `?` steps for Option and newtypes.
        let shown: Vec<String> = path
            .to_string()
            .split('.')
            .filter(|s| *s != "?")
            .map(str::to_owned)
            .collect();
        unknown.push(shown.join("."));
    };
    let de = serde_ignored::Deserializer::new(document.clone(), &mut on_ignored);
    let value: T = serde_path_to_error::deserialize(de).map_err(|e| format!("{}: {}", e.path(), e.inner()))?;
    if !unknown.is_empty() {
        return Err(format!("unknown field(s): {}", unknown.join(", ")));
    }
    let written = serde_json::to_value(&value).map_err(|e| format!("cannot write it back: {e}"))?;
    let mut missing = Vec::new();
    defaulted_fields(&document, &written, "", &mut missing);
    if !missing.is_empty() {
        return Err(format!("missing required field(s): {}", missing.join(", ")));
    }
    Ok(value)
}

/// The keys `written` has and `read` lacks. k8s-openapi fills a missing
/// required field with its default when reading and always writes it, so
/// a typed value written back shows exactly the required fields the
/// manifest left out (optional ones absent stay absent).
fn defaulted_fields(read: &Value, written: &Value, path: &str, missing: &mut Vec<String>) {
    match (read, written) {
        (Value::Object(read), Value::Object(written)) => {
            for (key, value) in written {
                let here = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match read.get(key) {
                    Some(original) => defaulted_fields(original, value, &here, missing),
                    None => missing.push(here),
                }
            }
        }
        (Value::Array(read), Value::Array(written)) => {
            for (index, (original, value)) in read.iter().zip(written).enumerate() {
                defaulted_fields(original, value, &format!("{path}.{index}"), missing);
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------
// The agent container and what it runs with.

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .template
        .spec
        .as_ref()
        .expect("the DaemonSet's pod template has a spec")
}

fn agent(pod: &PodSpec) -> &Container {
    pod.containers
        .iter()
        .find(|c| c.name == "xproxy")
        .expect("a container named xproxy")
}

/// The container's arguments with `$(VAR)` replaced as the kubelet does,
/// from the container's env (only `NODE_NAME` gets a value here); a
/// reference to a variable the container does not define is an error,
/// because the kubelet would pass it on literally.
fn expanded_args(container: &Container) -> Vec<String> {
    let defined: BTreeSet<&str> = container.env.iter().flatten().map(|e| e.name.as_str()).collect();
    container
        .args
        .iter()
        .flatten()
        .map(|arg| {
            let mut out = String::new();
            let mut rest = arg.as_str();
            while let Some(start) = rest.find("$(") {
                let end = rest[start..]
                    .find(')')
                    .unwrap_or_else(|| panic!("unclosed $( in {arg:?}"));
                let name = &rest[start + 2..start + end];
                assert!(
                    defined.contains(name),
                    "{arg:?} uses $({name}), which the container does not define"
                );
                out.push_str(&rest[..start]);
                out.push_str(if name == "NODE_NAME" { NODE_NAME } else { name });
                rest = &rest[start + end + 1..];
            }
            out.push_str(rest);
            out
        })
        .collect()
}

/// `xproxy ARGS` through the agent's own flag parser.
fn run_flags(container: &Container) -> RunFlags {
    let args = expanded_args(container);
    let Some((subcommand, _)) = args.split_first() else {
        panic!("the agent container has no args");
    };
    assert_eq!(subcommand, "run", "the agent container runs `xproxy run`");
    match Xproxy::try_parse_from(std::iter::once("xproxy".to_owned()).chain(args)) {
        Ok(Xproxy::Run(flags)) => *flags,
        Err(e) => panic!("xproxy does not accept the DaemonSet's args: {e}"),
    }
}

/// The text the container reads at `path`, from the ConfigMap volume
/// mounted over it.
fn config_map_file(manifests: &Manifests, pod: &PodSpec, container: &Container, path: &Path) -> String {
    let (mount, relative) = container
        .volume_mounts
        .iter()
        .flatten()
        .find_map(|m| Some((m, path.strip_prefix(&m.mount_path).ok()?)))
        .unwrap_or_else(|| panic!("nothing is mounted over {}", path.display()));
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("no volume {:?}", mount.name));
    let source = volume
        .config_map
        .as_ref()
        .unwrap_or_else(|| panic!("volume {:?} is not a ConfigMap", volume.name));
    let relative = relative.to_str().expect("UTF-8 path");
    let key = match &source.items {
        Some(items) => items.iter().find(|i| i.path == relative).map_or_else(
            || panic!("ConfigMap volume {:?} has no item at {relative}", volume.name),
            |i| i.key.as_str(),
        ),
        None => relative,
    };
    let name = source.name.as_str();
    manifests
        .config_map(name)
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .unwrap_or_else(|| panic!("ConfigMap {name:?} has no key {key:?}"))
        .clone()
}

/// The agent's configuration as it resolves inside the DaemonSet's pod.
fn agent_config(manifests: &Manifests) -> config::Loaded {
    let pod = pod_spec(manifests.daemon_set());
    let container = agent(pod);
    let flags = run_flags(container);
    let path = flags.config.clone().expect("the DaemonSet passes --config");
    let text = config_map_file(manifests, pod, container, &path);
    let file = ConfigFile::parse(&text).unwrap_or_else(|e| panic!("the agent rejects the ConfigMap's config: {e}"));
    let env = Environment {
        kubeconfig: None,
        hostname: Some("hostname-not-used".into()),
    };
    config::resolve(&flags, Some(&file), &env)
        .unwrap_or_else(|e| panic!("the agent rejects the ConfigMap's config: {e}"))
}

/// The port a probe's HTTP GET goes to, a named port resolved.
fn probe_get<'a>(container: &Container, probe: Option<&'a Probe>, what: &str) -> (&'a HTTPGetAction, i32) {
    let get = probe
        .and_then(|p| p.http_get.as_ref())
        .unwrap_or_else(|| panic!("the agent has no HTTP {what} probe"));
    let port = match &get.port {
        IntOrString::Int(port) => *port,
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .map_or_else(
                || panic!("{what} probe: the container has no port named {name:?}"),
                |p| p.container_port,
            ),
    };
    (get, port)
}

// ---------------------------------------------------------------------------
// The tests.

#[test]
fn every_manifest_parses_into_its_kubernetes_type_with_no_unknown_field() {
    let m = Manifests::load();
    assert_eq!(
        (
            m.service_accounts.len(),
            m.cluster_roles.len(),
            m.cluster_role_bindings.len(),
            m.config_maps.len(),
            m.daemon_sets.len()
        ),
        (1, 1, 1, 1, 1),
        "one of each: ServiceAccount, ClusterRole, ClusterRoleBinding, ConfigMap, DaemonSet"
    );
    let namespaced = m
        .service_accounts
        .iter()
        .map(|o| &o.metadata)
        .chain(m.config_maps.iter().map(|o| &o.metadata))
        .chain(m.daemon_sets.iter().map(|o| &o.metadata));
    for meta in namespaced {
        assert!(meta.name.as_deref().is_some_and(|n| !n.is_empty()), "a name: {meta:?}");
        assert_eq!(meta.namespace.as_deref(), Some("kube-system"), "{:?}", meta.name);
    }
    let cluster_wide = m
        .cluster_roles
        .iter()
        .map(|o| &o.metadata)
        .chain(m.cluster_role_bindings.iter().map(|o| &o.metadata));
    for meta in cluster_wide {
        assert!(meta.name.as_deref().is_some_and(|n| !n.is_empty()), "a name: {meta:?}");
        assert_eq!(meta.namespace, None, "{:?} is cluster-wide", meta.name);
    }
}

#[test]
fn a_typo_or_a_missing_field_in_a_manifest_fails_the_check() {
    let text = std::fs::read_to_string(deploy_dir().join("kubernetes/daemonset.yaml")).expect("daemonset.yaml");
    let mut m = Manifests::default();
    m.add_text(&text).expect("the DaemonSet as it is parses");

    let typo = text.replacen("hostNetwork:", "hostNetwrok:", 1);
    let error = m.add_text(&typo).expect_err("a typo'd field must fail");
    assert!(error.contains("spec.template.spec.hostNetwrok"), "{error}");

    let deep_typo = text.replacen(
        "mountPropagation: HostToContainer",
        "mountPropogation: HostToContainer",
        1,
    );
    let error = m.add_text(&deep_typo).expect_err("a typo'd field must fail");
    assert!(error.contains("volumeMounts.0.mountPropogation"), "{error}");

    let no_selector = text.replacen("  selector:\n    matchLabels:\n      k8s-app: xproxy\n", "", 1);
    assert_ne!(no_selector, text);
    let error = m
        .add_text(&no_selector)
        .expect_err("a missing required field must fail");
    assert!(error.contains("missing required field(s): spec.selector"), "{error}");

    let no_container_name = text.replacen(
        "        - name: xproxy\n          image: xproxy:0.1.0\n",
        "        - image: xproxy:0.1.0\n",
        1,
    );
    assert_ne!(no_container_name, text);
    let error = m
        .add_text(&no_container_name)
        .expect_err("a missing required field must fail");
    assert!(error.contains("spec.template.spec.containers.0.name"), "{error}");
}

#[test]
fn the_configmaps_config_passes_the_agents_parser_without_a_warning() {
    let loaded = agent_config(&Manifests::load());
    assert!(loaded.warnings.is_empty(), "warnings: {:?}", loaded.warnings);
    let config = loaded.config;
    assert_eq!(config.mode, config::Mode::Ebpf);
    assert_eq!(config.node_name, NODE_NAME, "--hostname-override=$(NODE_NAME)");
    // The in-cluster configuration: what KUBERNETES_SERVICE_HOST/PORT steer.
    assert_eq!(config.source, Source::InCluster);
}

#[test]
fn the_probes_ask_livez_and_healthz_on_the_port_the_config_serves() {
    let m = Manifests::load();
    let config = agent_config(&m).config;
    let container = agent(pod_spec(m.daemon_set()));
    let healthz = config.healthz_bind_address;
    assert!(
        healthz.ip().is_unspecified(),
        "the kubelet probes the node's address: healthzBindAddress must listen on every address, not {healthz}"
    );
    for (probe, what, path) in [
        (container.liveness_probe.as_ref(), "liveness", "/livez"),
        (container.readiness_probe.as_ref(), "readiness", "/healthz"),
    ] {
        let (get, port) = probe_get(container, probe, what);
        assert_eq!(get.path.as_deref(), Some(path), "{what} probe path");
        assert_eq!(i32::from(healthz.port()), port, "{what} probe port");
        assert!(
            get.host.is_none(),
            "{what} probe: the kubelet's default host (the node)"
        );
        assert!(
            matches!(get.scheme.as_deref(), None | Some("HTTP")),
            "{what} probe scheme"
        );
    }
}

#[test]
fn the_cluster_role_only_reads_services_endpointslices_and_nodes() {
    let m = Manifests::load();
    let role = &m.cluster_roles[0];
    assert!(role.aggregation_rule.is_none());
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none(), "no resourceNames: {rule:?}");
        assert!(rule.non_resource_urls.is_none(), "no nonResourceURLs: {rule:?}");
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.insert((group.as_str(), resource.as_str(), verb.as_str()));
                }
            }
        }
    }
    let mut wanted = BTreeSet::new();
    for (group, resource) in [("", "services"), ("", "nodes"), ("discovery.k8s.io", "endpointslices")] {
        for verb in ["get", "list", "watch"] {
            wanted.insert((group, resource, verb));
        }
    }
    assert_eq!(granted, wanted);
}

#[test]
fn the_binding_gives_the_role_to_the_daemonsets_service_account() {
    let m = Manifests::load();
    let (account, role, binding) = (&m.service_accounts[0], &m.cluster_roles[0], &m.cluster_role_bindings[0]);
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.api_group.as_deref(), Some("rbac.authorization.k8s.io"));
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subjects: Vec<_> = binding
        .subjects
        .iter()
        .flatten()
        .map(|s| (s.kind.as_str(), Some(&s.name), s.namespace.as_ref()))
        .collect();
    assert_eq!(
        subjects,
        [(
            "ServiceAccount",
            account.metadata.name.as_ref(),
            account.metadata.namespace.as_ref()
        )]
    );
    let ds = m.daemon_set();
    assert_eq!(pod_spec(ds).service_account_name, account.metadata.name);
    assert_eq!(ds.metadata.namespace, account.metadata.namespace);
}

#[test]
fn the_daemonset_gives_the_agent_the_node_it_needs() {
    let m = Manifests::load();
    let ds = m.daemon_set();
    let spec = &ds.spec;
    let pod = pod_spec(ds);
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert!(
        pod.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()),
        "a toleration of every taint (operator Exists, no key, no effect)"
    );
    let strategy = spec.update_strategy.as_ref().expect("an update strategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().expect("rollingUpdate");
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(1)));
    let labels = spec.selector.match_labels.as_ref().expect("matchLabels");
    let template_labels = spec.template.metadata.as_ref().and_then(|m| m.labels.as_ref());
    assert!(
        labels
            .iter()
            .all(|(k, v)| template_labels.and_then(|l| l.get(k)) == Some(v)),
        "the selector matches the template's labels"
    );

    let container = agent(pod);
    let flags = run_flags(container);
    let mounts = host_mounts(pod, container);
    assert!(
        flags.pin_path.starts_with("/sys/fs/bpf"),
        "pins under the host's bpffs: {}",
        flags.pin_path.display()
    );
    assert_eq!(mounts.get("/sys/fs/bpf"), Some(&("/sys/fs/bpf", false)));
    assert_eq!(mounts.get("/lib/modules"), Some(&("/lib/modules", true)));
    assert_eq!(mounts.get("/run/xtables.lock"), Some(&("/run/xtables.lock", false)));

    let security = container.security_context.as_ref().expect("a securityContext");
    assert_ne!(
        security.privileged,
        Some(true),
        "the agent runs with capabilities, unprivileged"
    );
    let caps = security.capabilities.as_ref().expect("capabilities");
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(
        added,
        BTreeSet::from(["NET_ADMIN", "NET_RAW", "BPF", "PERFMON", "SYS_RESOURCE"])
    );
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
}

/// The hostPath volumes `container` mounts: mount path -> (host path, read-only).
fn host_mounts<'a>(pod: &'a PodSpec, container: &'a Container) -> BTreeMap<&'a str, (&'a str, bool)> {
    container
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let volume = pod.volumes.iter().flatten().find(|v| v.name == m.name)?;
            let host = volume.host_path.as_ref()?;
            Some((m.mount_path.as_str(), (host.path.as_str(), m.read_only == Some(true))))
        })
        .collect()
}

#[test]
fn bpffs_is_mounted_bidirectionally_by_a_privileged_container_only() {
    let m = Manifests::load();
    let pod = pod_spec(m.daemon_set());
    let containers = pod.init_containers.iter().flatten().chain(&pod.containers);
    let mut bidirectional_bpffs = false;
    for container in containers {
        for mount in container.volume_mounts.iter().flatten() {
            if mount.mount_propagation.as_deref() != Some("Bidirectional") {
                continue;
            }
            // The API server refuses Bidirectional anywhere else.
            let privileged = container.security_context.as_ref().and_then(|s| s.privileged);
            assert_eq!(
                privileged,
                Some(true),
                "{}: Bidirectional needs privileged",
                container.name
            );
            bidirectional_bpffs |= mount.mount_path == "/sys/fs/bpf";
        }
    }
    assert!(
        bidirectional_bpffs,
        "/sys/fs/bpf is mounted with Bidirectional propagation"
    );
    let agent_bpffs = agent(pod)
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == "/sys/fs/bpf")
        .and_then(|m| m.mount_propagation.as_deref());
    assert_eq!(
        agent_bpffs,
        Some("HostToContainer"),
        "the agent sees a bpffs mounted after it started"
    );
}

#[test]
fn the_api_server_address_comes_from_the_configmap() {
    let m = Manifests::load();
    let container = agent(pod_spec(m.daemon_set()));
    let from_config_map = |name: &str| {
        let var = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("the agent has no {name} (kube-rs's in-cluster config reads it)"));
        let key = var
            .value_from
            .as_ref()
            .and_then(|v| v.config_map_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{name} comes from a ConfigMap key"));
        assert_ne!(key.optional, Some(true), "{name} is required");
        m.config_map(&key.name)
            .data
            .as_ref()
            .and_then(|d| d.get(&key.key))
            .unwrap_or_else(|| panic!("ConfigMap {:?} has no key {:?}", key.name, key.key))
            .clone()
    };
    let host = from_config_map("KUBERNETES_SERVICE_HOST");
    assert!(!host.trim().is_empty(), "an API server address");
    let port = from_config_map("KUBERNETES_SERVICE_PORT");
    assert!(port.parse::<u16>().is_ok_and(|p| p != 0), "a port: {port:?}");
}

#[test]
fn the_image_recipe_installs_what_the_daemonset_runs() {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile")).expect("deploy/Dockerfile");
    let instructions = dockerfile_instructions(&dockerfile);
    let mut installed = BTreeSet::new();
    for args in instructions.iter().filter_map(|i| i.strip_prefix("COPY ")) {
        let from_stage = args.split_whitespace().any(|a| a.starts_with("--from="));
        let paths: Vec<&str> = args.split_whitespace().filter(|a| !a.starts_with("--")).collect();
        let Some((destination, sources)) = paths.split_last() else {
            panic!("COPY without paths: {args}");
        };
        if !from_stage {
            for source in sources {
                assert!(
                    repo_root().join(source).exists(),
                    "COPY {source}: not in the repository"
                );
            }
        }
        installed.insert(destination.to_string());
    }

    let m = Manifests::load();
    let pod = pod_spec(m.daemon_set());
    let image = format!("xproxy:{}", env!("CARGO_PKG_VERSION"));
    for container in pod.init_containers.iter().flatten().chain(&pod.containers) {
        assert_eq!(container.image.as_deref(), Some(image.as_str()), "{}", container.name);
    }
    let command = agent(pod).command.as_deref().unwrap_or_default();
    let entrypoint = command.first().expect("the agent container names its command");
    assert!(
        installed.contains(entrypoint),
        "{entrypoint} is not installed by the Dockerfile"
    );
    let script = std::fs::read_to_string(deploy_dir().join("image/xproxy-entrypoint")).expect("entrypoint script");
    for path in script.split_whitespace().filter(|w| w.starts_with("/usr/local/")) {
        assert!(
            installed.contains(path),
            "the entrypoint runs {path}, which the Dockerfile does not install"
        );
    }

    let install = instructions
        .iter()
        .find(|i| i.starts_with("RUN apt-get update"))
        .expect("the runtime stage installs packages");
    let packages: BTreeSet<&str> = install.split_whitespace().collect();
    for package in ["iptables", "ipset", "nftables", "conntrack", "ipvsadm", "iproute2"] {
        assert!(packages.contains(package), "the runtime stage lacks {package}");
    }
}

/// The Dockerfile's instructions, continuation lines joined, comments dropped.
fn dockerfile_instructions(text: &str) -> Vec<String> {
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                if !current.trim().is_empty() {
                    instructions.push(current.split_whitespace().collect::<Vec<_>>().join(" "));
                }
                current.clear();
            }
        }
    }
    instructions
}

// ---------------------------------------------------------------------------
// The image's iptables backend selection (root).

/// What kube-proxy (iptables mode) and the kubelet leave in a backend: the
/// service chains in nat, and the kubelet's hint chain in mangle.
const KUBE_PROXY_RULES: &str = "*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABC - [0:0]
:KUBE-SEP-DEF - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 53 -j KUBE-SVC-ABC
-A KUBE-SVC-ABC -m statistic --mode random --probability 0.5 -j KUBE-SEP-DEF
-A KUBE-SEP-DEF -p tcp -m tcp -j DNAT --to-destination 10.244.0.5:53
COMMIT
*mangle
:KUBE-IPTABLES-HINT - [0:0]
COMMIT
";

/// Only the kubelet's hint: fewer lines than [`KUBE_PROXY_RULES`].
const KUBELET_HINT: &str = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";

/// `iptables-<backend>-restore` of `rules` in the namespace.
fn restore(ns: &testbed::netns::Netns, backend: &str, rules: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns.name(), &format!("iptables-{backend}-restore")])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ip netns exec iptables-restore");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(rules.as_bytes())
        .expect("writing the rules");
    let out = child.wait_with_output().expect("iptables-restore");
    assert!(
        out.status.success(),
        "iptables-{backend}-restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `iptables-backend detect` in the namespace, with `forced` as
/// XPROXY_IPTABLES_BACKEND (unset when `None`).
fn detect(ns: &testbed::netns::Netns, forced: Option<&str>) -> String {
    let script = deploy_dir().join("image/iptables-backend");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns.name(), "sh"])
        .arg(&script)
        .arg("detect")
        .env_remove("XPROXY_IPTABLES_BACKEND");
    if let Some(backend) = forced {
        cmd.env("XPROXY_IPTABLES_BACKEND", backend);
    }
    let out = cmd.output().expect("running iptables-backend");
    assert!(
        out.status.success(),
        "iptables-backend detect: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn the_image_picks_the_iptables_backend_kubernetes_rules_are_in() {
    if !testbed::privileged::require_root("the_image_picks_the_iptables_backend_kubernetes_rules_are_in") {
        return;
    }
    // (case, rules in legacy, rules in nft, forced, expected)
    let cases = [
        ("nothing anywhere: the default", "", "", None, "nft"),
        ("kube-proxy in legacy", KUBE_PROXY_RULES, KUBELET_HINT, None, "legacy"),
        ("kube-proxy in nft", KUBELET_HINT, KUBE_PROXY_RULES, None, "nft"),
        ("forced", "", "", Some("legacy"), "legacy"),
    ];
    for (case, legacy, nft, forced, expected) in cases {
        // A fresh namespace per case; dropping it (also on a failed
        // assertion) removes it and every rule in it.
        let ns = testbed::netns::Netns::new("xpipt").expect("a network namespace");
        for (backend, rules) in [("legacy", legacy), ("nft", nft)] {
            if !rules.is_empty() {
                restore(&ns, backend, rules);
            }
        }
        assert_eq!(detect(&ns, forced), expected, "{case}");
    }
}
