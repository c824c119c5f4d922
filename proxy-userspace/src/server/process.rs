//! The `process_*` metrics every Kubernetes component exports (Go's
//! process collector), read from /proc at scrape time: CPU time, memory,
//! open and allowed file descriptors, start time.

use std::{fmt, fs};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        MetricType,
        counter::ConstCounter,
        gauge::{ConstGauge, Gauge},
    },
};

/// Reads this process's figures at every scrape.
#[derive(Debug)]
pub struct ProcessCollector;

/// One scrape's figures; a figure /proc did not give is left out.
#[derive(Debug, Default, PartialEq)]
struct Figures {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    start_time_seconds: Option<f64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let f = read_figures();
        if let Some(v) = f.cpu_seconds {
            let m = encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(v).encode(m)?;
        }
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                f.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                f.virtual_bytes,
            ),
            ("process_open_fds", "Number of open file descriptors", f.open_fds),
            ("process_max_fds", "Maximum number of open file descriptors", f.max_fds),
        ];
        for (name, help, value) in gauges {
            if let Some(v) = value {
                let m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
                ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m)?;
            }
        }
        if let Some(v) = f.start_time_seconds {
            let m = encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                None,
                MetricType::Gauge,
            )?;
            let gauge: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
            gauge.set(v);
            gauge.encode(m)?;
        }
        Ok(())
    }
}

fn read_figures() -> Figures {
    let ticks = clock_ticks_per_second();
    let page = page_size();
    let stat = fs::read_to_string("/proc/self/stat").ok();
    let boot = fs::read_to_string("/proc/stat").ok().and_then(|s| boot_time(&s));
    let mut figures = stat
        .as_deref()
        .map(|s| from_stat(s, ticks, page, boot))
        .unwrap_or_default();
    figures.open_fds = fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as u64);
    figures.max_fds = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(soft, _)| soft);
    figures
}

/// CPU time, memory and start time from `/proc/self/stat` (proc(5)):
/// fields after the command name, which is in parentheses and may itself
/// hold spaces and parentheses.
fn from_stat(stat: &str, ticks: f64, page: u64, boot_time: Option<u64>) -> Figures {
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return Figures::default();
    };
    // rest[0] is field 3 (state): utime is field 14, stime 15,
    // starttime 22, vsize 23, rss 24.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let cpu_seconds = field(14)
        .zip(field(15))
        .map(|(user, system)| (user + system) as f64 / ticks);
    let start_time_seconds = field(22)
        .zip(boot_time)
        .map(|(start, boot)| boot as f64 + start as f64 / ticks);
    Figures {
        cpu_seconds,
        resident_bytes: field(24).map(|pages| pages * page),
        virtual_bytes: field(23),
        start_time_seconds,
        open_fds: None,
        max_fds: None,
    }
}

/// `btime` of /proc/stat: when the machine booted, in seconds since the epoch.
fn boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn clock_ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100.0, |t| t as f64)
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|p| u64::try_from(p).ok())
        .unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (x (proxy) 1) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 9 0 1000 123456789 300 \
                    18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let f = from_stat(stat, 100.0, 4096, Some(1_700_000_000));
        assert_eq!(f.cpu_seconds, Some(3.0));
        assert_eq!(f.start_time_seconds, Some(1_700_000_010.0));
        assert_eq!(f.virtual_bytes, Some(123_456_789));
        assert_eq!(f.resident_bytes, Some(300 * 4096));
        assert_eq!(from_stat("garbage", 100.0, 4096, None), Figures::default());
    }

    #[test]
    fn the_scrape_has_every_process_metric() {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(ProcessCollector));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_virtual_memory_bytes ",
            "process_open_fds ",
            "process_max_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }

    #[test]
    fn this_process_reads_back() {
        let f = read_figures();
        assert!(f.resident_bytes.is_some_and(|r| r > 0));
        assert!(f.open_fds.is_some_and(|n| n >= 3));
        assert!(f.start_time_seconds.is_some_and(|s| s > 1.6e9));
    }
}
