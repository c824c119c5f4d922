//! What `xproxy trace` prints: the program's return code by name, the
//! verdict it counted, the backend it chose and the headers before and
//! after, as text for people or JSON for scripts.

use std::{fmt::Write as _, net::SocketAddrV4};

use proxy_common::{
    CtValue, Verdict,
    conntrack::{FLAG_NOTRACK, FLAG_SNAT},
};
use serde::Serialize;

use super::{frame::Headers, program::HookArg};

/// One trace's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The program run (`xdp_uplink`, `tc_ingress`, `tc_egress`).
    pub program: &'static str,
    pub hook: HookArg,
    pub iface: String,
    /// The kernel's id of the live program.
    pub program_id: u32,
    /// Whether the TCP segment was a SYN.
    pub syn: bool,
    /// The program's return code, and its name for the hook.
    pub code: u32,
    pub action: &'static str,
    /// The verdict counter the run moved (`xproxy status`, `/metrics`).
    pub verdict: Option<&'static str>,
    /// The verdict in words.
    pub meaning: &'static str,
    /// The backend of the frame's flow, as conntrack holds it after the run.
    pub backend: Option<SocketAddrV4>,
    /// For a backend's reply of a tracked flow: the frontend its source is
    /// rewritten back to.
    pub frontend: Option<SocketAddrV4>,
    pub before: Headers,
    /// The frame as the program left it (`None` if it left no IPv4 frame).
    pub after: Option<Headers>,
    /// The mark the packet goes on with, for the agent's rules in the
    /// kernel: the skb's after a tc program's run; after XDP's, the one it
    /// left in the metadata for tc ingress to copy into the skb. 0: none.
    pub mark: u32,
    /// What the mark asks of the kernel, by the flow's conntrack entry.
    pub mark_for: Option<&'static str>,
    pub undone: Undone,
}

/// What the trace put back after the run (see the guard module).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Undone {
    pub conntrack_entries: usize,
    pub affinity_entry: bool,
    /// The verdict counter was moved back (false only if none moved).
    pub counters: bool,
}

/// What a packet's `mark` asks of the kernel, told by its flow's `entry`:
/// the masquerade rule's bit on a flow the kernel source-NATs, the notrack
/// rule's on one kept off the kernel's conntrack.
pub fn mark_purpose(mark: u32, entry: Option<&CtValue>) -> Option<&'static str> {
    let flags = entry.map_or(0, |e| e.flags);
    if mark == 0 {
        None
    } else if flags & FLAG_NOTRACK != 0 {
        Some("the kernel's conntrack leaves the flow alone")
    } else if flags & FLAG_SNAT != 0 {
        Some("the kernel masquerades the flow")
    } else {
        None
    }
}

/// The name of return code `code` of an XDP or a tc program.
pub fn action_name(xdp: bool, code: u32) -> &'static str {
    const XDP: [&str; 5] = ["XDP_ABORTED", "XDP_DROP", "XDP_PASS", "XDP_TX", "XDP_REDIRECT"];
    const TC: [&str; 8] = [
        "TC_ACT_OK",
        "TC_ACT_RECLASSIFY",
        "TC_ACT_SHOT",
        "TC_ACT_PIPE",
        "TC_ACT_STOLEN",
        "TC_ACT_QUEUED",
        "TC_ACT_REPEAT",
        "TC_ACT_REDIRECT",
    ];
    let names: &[&str] = if xdp { &XDP } else { &TC };
    match usize::try_from(code).ok().and_then(|i| names.get(i)) {
        Some(name) => name,
        // TC_ACT_UNSPEC is -1, as the u32 the kernel reports.
        None if !xdp && code == u32::MAX => "TC_ACT_UNSPEC",
        None => "unknown",
    }
}

/// A verdict in words, or what no moved counter means.
pub fn meaning(verdict: Option<Verdict>) -> &'static str {
    let Some(verdict) = verdict else {
        return "no verdict counter moved (a program older than its stats map?)";
    };
    match verdict {
        Verdict::PassNotService => "not a Service: passed untouched",
        Verdict::PassNotIpv4OrL4 => "not IPv4 TCP/UDP: passed untouched",
        Verdict::PassMalformed => "malformed: passed untouched",
        Verdict::DnatNew => "a new flow to a Service: DNATed to the backend picked",
        Verdict::DnatEstablished => "a packet of a tracked flow: DNATed to its backend",
        Verdict::RevNat => "a backend's reply: source rewritten back to the frontend",
        Verdict::RejectNoBackend => "a Service without endpoints: rejected (TCP RST / ICMP port unreachable)",
        Verdict::Error => "the maps disagreed or a kernel helper failed",
        Verdict::PassToTc => {
            "needs a mark XDP could not leave (no metadata): backend picked, left to the tc hook to mark and DNAT"
        }
        Verdict::DropNoLocalBackend => "Local traffic policy without an endpoint on this node: dropped",
        Verdict::PassFragmentUntracked => "a later fragment of an untracked datagram: passed untouched",
        Verdict::IcmpError => "an ICMP error of a tracked flow: translated",
        Verdict::DropSourceRange => "source outside the load balancer's source ranges: dropped",
    }
}

impl Report {
    /// The report as lines of text, one field a line.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let proto = match self.before.proto {
            proxy_common::proto::TCP if self.syn => "TCP [SYN]",
            proxy_common::proto::TCP => "TCP [ACK]",
            _ => "UDP",
        };
        let _ = writeln!(
            out,
            "{proto} {} -> {} through {} on {} ({} hook, program id {})",
            self.before.source(),
            self.before.destination(),
            self.program,
            self.iface,
            hook_name(self.hook),
            self.program_id,
        );
        let counted = self.verdict.unwrap_or("-");
        let _ = writeln!(
            out,
            "verdict:      {} ({}), counted as {counted}: {}",
            self.action, self.code, self.meaning
        );
        let backend = self.backend.map_or_else(|| "-".to_owned(), |b| b.to_string());
        let _ = writeln!(out, "backend:      {backend}");
        if let Some(frontend) = self.frontend {
            let _ = writeln!(out, "frontend:     {frontend}");
        }
        match &self.after {
            Some(after) => {
                let _ = writeln!(out, "source:       {} -> {}", self.before.source(), after.source());
                let _ = writeln!(
                    out,
                    "destination:  {} -> {}",
                    self.before.destination(),
                    after.destination()
                );
            }
            None => {
                let _ = writeln!(out, "headers:      the program left no IPv4 frame");
            }
        }
        match (self.mark, self.mark_for) {
            (0, _) => {
                let _ = writeln!(out, "mark:         none");
            }
            (mark, Some(purpose)) => {
                let _ = writeln!(out, "mark:         {mark:#x}: {purpose}");
            }
            (mark, None) => {
                let _ = writeln!(out, "mark:         {mark:#x}");
            }
        }
        let _ = writeln!(
            out,
            "undone:       {} conntrack entries, affinity {}, counters {}",
            self.undone.conntrack_entries,
            if self.undone.affinity_entry {
                "restored"
            } else {
                "untouched"
            },
            if self.undone.counters { "restored" } else { "untouched" },
        );
        out
    }
}

fn hook_name(hook: HookArg) -> &'static str {
    match hook {
        HookArg::Xdp => "xdp",
        HookArg::TcIngress => "tc-ingress",
        HookArg::TcEgress => "tc-egress",
        HookArg::Pod => "pod",
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn headers(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Headers {
        Headers {
            proto: proxy_common::proto::TCP,
            src: src.0,
            src_port: Some(src.1),
            dst: dst.0,
            dst_port: Some(dst.1),
        }
    }

    const CLIENT: (Ipv4Addr, u16) = (Ipv4Addr::new(10, 244, 0, 14), 49152);
    const CLUSTER_IP: (Ipv4Addr, u16) = (Ipv4Addr::new(10, 96, 0, 88), 88);
    const BACKEND: (Ipv4Addr, u16) = (Ipv4Addr::new(10, 244, 0, 12), 80);

    fn dnat_report() -> Report {
        Report {
            program: "tc_ingress",
            hook: HookArg::Pod,
            iface: "np0".into(),
            program_id: 57,
            syn: true,
            code: 0,
            action: action_name(false, 0),
            verdict: Some(Verdict::DnatNew.name()),
            meaning: meaning(Some(Verdict::DnatNew)),
            backend: Some(SocketAddrV4::new(BACKEND.0, BACKEND.1)),
            frontend: None,
            before: headers(CLIENT, CLUSTER_IP),
            after: Some(headers(CLIENT, BACKEND)),
            mark: 0,
            mark_for: None,
            undone: Undone {
                conntrack_entries: 2,
                affinity_entry: false,
                counters: true,
            },
        }
    }

    #[test]
    fn return_codes_are_named_per_hook() {
        assert_eq!(action_name(true, 2), "XDP_PASS");
        assert_eq!(action_name(true, 3), "XDP_TX");
        assert_eq!(action_name(false, 2), "TC_ACT_SHOT");
        assert_eq!(action_name(false, 7), "TC_ACT_REDIRECT");
        assert_eq!(action_name(false, u32::MAX), "TC_ACT_UNSPEC");
        assert_eq!(action_name(true, 9), "unknown");
    }

    #[test]
    fn every_verdict_has_its_own_meaning() {
        let mut seen: Vec<&str> = Verdict::ALL.iter().map(|v| meaning(Some(*v))).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), Verdict::ALL.len());
        assert!(meaning(Some(Verdict::PassNotService)).starts_with("not a Service"));
    }

    #[test]
    fn text_shows_verdict_backend_and_rewrite() {
        let text = dnat_report().text();
        let expected = "\
TCP [SYN] 10.244.0.14:49152 -> 10.96.0.88:88 through tc_ingress on np0 (pod hook, program id 57)
verdict:      TC_ACT_OK (0), counted as dnat_new: a new flow to a Service: DNATed to the backend picked
backend:      10.244.0.12:80
source:       10.244.0.14:49152 -> 10.244.0.14:49152
destination:  10.96.0.88:88 -> 10.244.0.12:80
mark:         none
undone:       2 conntrack entries, affinity untouched, counters restored
";
        assert_eq!(text, expected);
    }

    #[test]
    fn text_of_a_frame_not_for_a_service_says_so() {
        let mut report = dnat_report();
        report.verdict = Some(Verdict::PassNotService.name());
        report.meaning = meaning(Some(Verdict::PassNotService));
        report.backend = None;
        report.after = Some(report.before);
        let text = report.text();
        assert!(
            text.contains("counted as pass_not_service: not a Service: passed untouched"),
            "{text}"
        );
        assert!(text.contains("backend:      -\n"), "{text}");
        assert!(
            text.contains("destination:  10.96.0.88:88 -> 10.96.0.88:88\n"),
            "{text}"
        );
    }

    #[test]
    fn text_of_a_reply_names_the_frontend() {
        let mut report = dnat_report();
        report.verdict = Some(Verdict::RevNat.name());
        report.backend = None;
        report.frontend = Some(SocketAddrV4::new(CLUSTER_IP.0, CLUSTER_IP.1));
        report.before = headers(BACKEND, CLIENT);
        report.after = Some(headers(CLUSTER_IP, CLIENT));
        let text = report.text();
        assert!(
            text.contains("backend:      -\nfrontend:     10.96.0.88:88\n"),
            "{text}"
        );
        assert!(
            text.contains("source:       10.244.0.12:80 -> 10.96.0.88:88\n"),
            "{text}"
        );
    }

    #[test]
    fn text_says_what_the_mark_asks_of_the_kernel() {
        let entry = |flags: u8| CtValue {
            flags,
            ..bytemuck::Zeroable::zeroed()
        };
        let mut report = dnat_report();
        report.mark = 0x4000;
        report.mark_for = mark_purpose(0x4000, Some(&entry(FLAG_SNAT)));
        assert!(
            report
                .text()
                .contains("mark:         0x4000: the kernel masquerades the flow\n")
        );
        report.mark = 0x2000;
        report.mark_for = mark_purpose(0x2000, Some(&entry(FLAG_NOTRACK)));
        assert!(
            report
                .text()
                .contains("mark:         0x2000: the kernel's conntrack leaves the flow alone\n")
        );
        assert_eq!(mark_purpose(0, Some(&entry(FLAG_SNAT))), None);
        assert_eq!(mark_purpose(0x4000, None), None);
    }

    #[test]
    fn json_has_the_fields_scripts_read() {
        let json = serde_json::to_value(dnat_report()).expect("serialisable");
        assert_eq!(json["verdict"], "dnat_new");
        assert_eq!(json["action"], "TC_ACT_OK");
        assert_eq!(json["hook"], "pod");
        assert_eq!(json["backend"], "10.244.0.12:80");
        assert_eq!(json["after"]["dst"], "10.244.0.12");
        assert_eq!(json["after"]["dst_port"], 80);
        assert_eq!(json["before"]["src_port"], 49152);
        assert_eq!(json["undone"]["conntrack_entries"], 2);
        assert_eq!(json["mark"], 0);
    }
}
