//! The agent's log output: text or JSON lines on stderr, at klog's
//! verbosity mapped onto tracing's levels. The level comes from `--v` if
//! given, else from `RUST_LOG` (which can name modules), else from the
//! file's `logging.verbosity`.

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, Logging};

/// Starts logging; `v_flag` is `--v` as given on the command line. A
/// second call is a no-op (the first subscriber stays).
pub fn init(logging: Logging, v_flag: Option<u8>) {
    let filter = match v_flag {
        Some(v) => EnvFilter::new(level_of(v)),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level_of(logging.verbosity))),
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Ignored error: a subscriber is already set (tests, or a second call).
    let _ = match logging.format {
        LogFormat::Text => builder.with_ansi(ansi).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// klog's `-v` levels as kube-proxy uses them: 2 is its usual production
/// level (sync summaries), 4 adds per-object detail, 5 and up everything.
fn level_of(verbosity: u8) -> &'static str {
    match verbosity {
        0..=2 => "info",
        3..=4 => "debug",
        _ => "trace",
    }
}

#[cfg(test)]
mod tests {
    use super::level_of;

    #[test]
    fn klog_verbosity_maps_onto_tracing_levels() {
        let levels: Vec<&str> = [0, 2, 3, 4, 5, 9].into_iter().map(level_of).collect();
        assert_eq!(levels, ["info", "info", "debug", "debug", "trace", "trace"]);
    }
}
