//! The per-packet step: runs [`crate::perpacket::measure`] and keeps its
//! report (as JSON and as its own Markdown section) with the net costs the
//! targets are about. Maglev's control-plane cost at 10,000 Services
//! ([`crate::maglev_scale`]) is measured with it: same step, no agent.

use crate::{
    maglev_scale,
    perpacket::{self, Kind},
    results::{PacketTarget, PerPacket},
};

pub fn measure(quick: bool, progress: &dyn Fn(&str)) -> PerPacket {
    let options = if quick {
        perpacket::Options::quick()
    } else {
        perpacket::Options::full()
    };
    let mut measured = match perpacket::measure(&options, progress) {
        Ok(report) => PerPacket {
            targets: targets(&report),
            markdown: report.markdown(),
            report: serde_json::to_value(&report).ok(),
            error: None,
            maglev: None,
        },
        Err(e) => PerPacket {
            report: None,
            markdown: String::new(),
            targets: Vec::new(),
            error: Some(format!("{e:#}")),
            maglev: None,
        },
    };
    match maglev_scale::measure(progress) {
        Ok(maglev) => {
            measured.markdown += "\n";
            measured.markdown += &maglev.markdown();
            measured.maglev = serde_json::to_value(&maglev).ok();
        }
        Err(e) => measured.markdown += &format!("\nMaglev tables at 10,000 Services: not measured: {e:#}\n"),
    }
    measured
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
