//! The per-packet step: runs [`crate::perpacket::measure`] and keeps its
//! report (as JSON and as its own Markdown section) with the net costs the
//! targets are about.

use serde::{Deserialize, Serialize};

use crate::{
    perpacket::{self, Kind},
    results::PerPacket,
};

/// A case with a target: its net median and the target, in ns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PacketTarget {
    pub program: String,
    pub label: String,
    /// `new_flow`, `established`, ... (the case kind).
    pub kind: String,
    pub net_ns: f64,
    pub target_ns: f64,
}

impl PacketTarget {
    pub fn met(&self) -> bool {
        self.net_ns <= self.target_ns
    }
}

pub fn measure(quick: bool, progress: &dyn Fn(&str)) -> PerPacket {
    let options = if quick {
        perpacket::Options::quick()
    } else {
        perpacket::Options::full()
    };
    match perpacket::measure(&options, progress) {
        Ok(report) => PerPacket {
            targets: targets(&report),
            markdown: report.markdown(),
            report: serde_json::to_value(&report).ok(),
            error: None,
        },
        Err(e) => PerPacket {
            report: None,
            markdown: String::new(),
            targets: Vec::new(),
            error: Some(format!("{e:#}")),
        },
    }
}

fn kind_name(kind: Kind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{kind:?}"))
}

fn targets(report: &perpacket::Report) -> Vec<PacketTarget> {
    report
        .cases
        .iter()
        .filter_map(|case| {
            Some(PacketTarget {
                program: case.program.clone(),
                label: case.label.clone(),
                kind: kind_name(case.kind),
                net_ns: case.net.median,
                target_ns: case.target_ns?,
            })
        })
        .collect()
}
