//! The `KubeProxyConfiguration` file, read as written: every field optional,
//! numbers wide enough to hold an out-of-range value so that validation (in
//! `resolve`) can name it. Unknown fields are collected as warnings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use super::duration::GoDuration;
use super::{ConfigError, Warning};

/// The only `apiVersion` accepted.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The only `kind` accepted.
pub const KIND: &str = "KubeProxyConfiguration";

/// Sections that may also be spelled by their Go type name, as in the seed's
/// `proxy.yaml` (`kubeProxyIPTablesConfiguration:` for `iptables:`).
const SECTION_ALIASES: [(&str, &str); 4] = [
    ("iptables", "kubeProxyIPTablesConfiguration"),
    ("ipvs", "kubeProxyIPVSConfiguration"),
    ("nftables", "kubeProxyNFTablesConfiguration"),
    ("conntrack", "kubeProxyConntrackConfiguration"),
];

/// kube-proxy's `KubeProxyConfiguration` (v1alpha1) as written in the file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub feature_gates: Option<BTreeMap<String, bool>>,
    pub client_connection: Option<ClientConnectionSection>,
    /// `format` and `verbosity` are read; other fields are warned about.
    pub logging: Option<Value>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub enable_profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub mode: Option<String>,
    #[serde(alias = "kubeProxyIPTablesConfiguration")]
    pub iptables: Option<IptablesSection>,
    #[serde(alias = "kubeProxyIPVSConfiguration")]
    pub ipvs: Option<IpvsSection>,
    #[serde(alias = "kubeProxyNFTablesConfiguration")]
    pub nftables: Option<NftablesSection>,
    /// Windows-only; accepted and ignored.
    pub winkernel: Option<Value>,
    /// Windows-only; accepted and ignored.
    pub windows_run_as_service: Option<bool>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocalSection>,
    /// One CIDR, or a comma-separated dual-stack pair.
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i64>,
    #[serde(alias = "kubeProxyConntrackConfiguration")]
    pub conntrack: Option<ConntrackSection>,
    pub config_sync_period: Option<GoDuration>,
    pub port_range: Option<String>,
    /// The keys the sections were written under (for error paths).
    #[serde(skip)]
    pub section_keys: SectionKeys,
}

/// The key each aliased section was written under in the file: `iptables`
/// or `kubeProxyIPTablesConfiguration`, and so on. Errors name the field the
/// way the user wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionKeys {
    pub iptables: &'static str,
    pub ipvs: &'static str,
    pub nftables: &'static str,
    pub conntrack: &'static str,
}

impl Default for SectionKeys {
    fn default() -> Self {
        SectionKeys {
            iptables: "iptables",
            ipvs: "ipvs",
            nftables: "nftables",
            conntrack: "conntrack",
        }
    }
}

/// `clientConnection`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnectionSection {
    /// Path of a kubeconfig file; not checked here (the client reads it).
    pub kubeconfig: Option<String>,
    pub accept_content_types: Option<String>,
    pub content_type: Option<String>,
    pub qps: Option<f64>,
    pub burst: Option<i64>,
}

/// `iptables` (alias `kubeProxyIPTablesConfiguration`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IptablesSection {
    pub masquerade_all: Option<bool>,
    pub masquerade_bit: Option<i64>,
    pub localhost_node_ports: Option<bool>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
}

/// `ipvs` (alias `kubeProxyIPVSConfiguration`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpvsSection {
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    pub strict_arp: Option<bool>,
    pub tcp_timeout: Option<GoDuration>,
    pub tcp_fin_timeout: Option<GoDuration>,
    pub udp_timeout: Option<GoDuration>,
}

/// `nftables`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NftablesSection {
    pub masquerade_all: Option<bool>,
    pub masquerade_bit: Option<i64>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
}

/// `detectLocal`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocalSection {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

/// `conntrack`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackSection {
    pub max_per_core: Option<i64>,
    pub min: Option<i64>,
    pub tcp_established_timeout: Option<GoDuration>,
    pub tcp_close_wait_timeout: Option<GoDuration>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<GoDuration>,
    pub udp_stream_timeout: Option<GoDuration>,
}

/// A configuration file after parsing: its contents and what was ignored.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    /// Where it was read from (`None` for text parsed directly).
    pub path: Option<PathBuf>,
    pub spec: KubeProxyConfiguration,
    /// Unknown fields and ignored settings.
    pub warnings: Vec<Warning>,
}

impl ConfigFile {
    /// Reads and parses `path`; every error names the file.
    pub fn read(path: &Path) -> Result<ConfigFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut file = ConfigFile::parse(&text).map_err(|e| e.in_file(path))?;
        file.path = Some(path.to_owned());
        Ok(file)
    }

    /// Parses the text of a `KubeProxyConfiguration`: checks `apiVersion`
    /// and `kind`, collects unknown fields as warnings and reports type
    /// errors with the field's path. Values are validated later, by
    /// [`super::resolve`].
    pub fn parse(text: &str) -> Result<ConfigFile, ConfigError> {
        let value: Value = serde_saphyr::from_str(text).map_err(|e| ConfigError::yaml(e.to_string()))?;
        let Value::Object(map) = &value else {
            return Err(ConfigError::yaml(format!(
                "expected a mapping (a KubeProxyConfiguration), found {}",
                kind_of(&value)
            )));
        };
        check_type_meta(map)?;
        let mut section_keys = SectionKeys::default();
        for (canonical, alias) in SECTION_ALIASES {
            match (map.contains_key(canonical), map.contains_key(alias)) {
                (true, true) => {
                    return Err(ConfigError::invalid(
                        alias,
                        format!("is another spelling of {canonical}; give only one of them"),
                    ));
                }
                (false, true) => match canonical {
                    "iptables" => section_keys.iptables = alias,
                    "ipvs" => section_keys.ipvs = alias,
                    "nftables" => section_keys.nftables = alias,
                    _ => section_keys.conntrack = alias,
                },
                _ => {}
            }
        }

        let mut warnings = Vec::new();
        let mut on_ignored = |path: serde_ignored::Path<'_>| {
            warnings.push(Warning::new(ignored_path(&path), "unknown field, ignored"));
        };
        let de = serde_ignored::Deserializer::new(value, &mut on_ignored);
        let mut spec: KubeProxyConfiguration = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            ConfigError::invalid(
                if path == "." { "(top level)".to_owned() } else { path },
                e.into_inner().to_string(),
            )
        })?;
        spec.section_keys = section_keys;
        if spec.winkernel.is_some() {
            warnings.push(Warning::new("winkernel", "Windows-only settings, ignored"));
        }
        if spec.windows_run_as_service.is_some() {
            warnings.push(Warning::new("windowsRunAsService", "Windows-only setting, ignored"));
        }
        Ok(ConfigFile {
            path: None,
            spec,
            warnings,
        })
    }
}

fn check_type_meta(map: &serde_json::Map<String, Value>) -> Result<(), ConfigError> {
    for (field, want) in [("apiVersion", API_VERSION), ("kind", KIND)] {
        match map.get(field) {
            Some(Value::String(got)) if got == want => {}
            Some(Value::String(got)) => {
                return Err(ConfigError::invalid(
                    field,
                    format!("{got:?} is not supported (expected {want})"),
                ));
            }
            None | Some(Value::Null) => {
                return Err(ConfigError::invalid(field, format!("missing (expected {want})")));
            }
            Some(other) => {
                return Err(ConfigError::invalid(
                    field,
                    format!("expected the string {want}, found {}", kind_of(other)),
                ));
            }
        }
    }
    Ok(())
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// `iptables.foo`, `ipvs.excludeCIDRs[0].x`: the path as written, without
/// serde_ignored's markers for `Option` and newtypes.
fn ignored_path(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", ignored_path(parent)),
        Path::Map { parent, key } => {
            let parent = ignored_path(parent);
            if parent.is_empty() {
                key.clone()
            } else {
                format!("{parent}.{key}")
            }
        }
        Path::Some { parent } | Path::NewtypeStruct { parent } | Path::NewtypeVariant { parent } => {
            ignored_path(parent)
        }
    }
}
