//! Go's duration syntax (`time.ParseDuration` / `Duration.String`), the form
//! every duration in a `KubeProxyConfiguration` is written in: `"30s"`,
//! `"1m0s"`, `"500ms"`, `"1h2m3.5s"`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// Why a duration string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {reason}")]
pub struct DurationError {
    /// The text as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

const NANOS_PER_UNIT: &[(&str, u64)] = &[
    ("ns", 1),
    ("us", 1_000),
    ("\u{b5}s", 1_000),  // U+00B5 micro sign
    ("\u{3bc}s", 1_000), // U+03BC Greek small letter mu
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60 * 1_000_000_000),
    ("h", 3_600 * 1_000_000_000),
];

/// The largest duration Go can represent (`math.MaxInt64` nanoseconds).
const MAX_NANOS: u128 = i64::MAX as u128;

/// Parses a Go duration: an optional sign, then one or more decimal numbers
/// (with an optional fraction), each followed by a unit (`ns`, `us`/`µs`,
/// `ms`, `s`, `m`, `h`). A bare `"0"` is zero. Negative durations are
/// rejected: no duration in the configuration may be negative.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let fail = |reason: &str| DurationError {
        input: input.to_owned(),
        reason: reason.to_owned(),
    };
    let (negative, mut rest) = match input.as_bytes().first() {
        Some(b'-') => (true, &input[1..]),
        Some(b'+') => (false, &input[1..]),
        _ => (false, input),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(fail("empty"));
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let (whole, after_whole) = split_digits(rest);
        let (fraction, after_fraction) = match after_whole.strip_prefix('.') {
            Some(tail) => split_digits(tail),
            None => ("", after_whole),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err(fail("expected a number"));
        }
        let unit_len = after_fraction
            .find(|c: char| c == '.' || c.is_ascii_digit())
            .unwrap_or(after_fraction.len());
        let (unit, tail) = after_fraction.split_at(unit_len);
        if unit.is_empty() {
            return Err(fail("missing unit (ns, us, ms, s, m or h)"));
        }
        let Some(&(_, unit_nanos)) = NANOS_PER_UNIT.iter().find(|(name, _)| *name == unit) else {
            return Err(fail(&format!("unknown unit {unit:?} (expected ns, us, ms, s, m or h)")));
        };
        let unit_nanos = u128::from(unit_nanos);
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            // More digits than fit in a u128 overflow long before MAX_NANOS anyway.
            whole.parse().map_err(|_| fail("too large"))?
        };
        let mut nanos = whole.checked_mul(unit_nanos).ok_or_else(|| fail("too large"))?;
        // Digits past the 18th cannot change the result by a nanosecond.
        let fraction = &fraction[..fraction.len().min(18)];
        if !fraction.is_empty() {
            let digits: u128 = fraction.parse().map_err(|_| fail("bad fraction"))?;
            let scale = 10u128.pow(u32::try_from(fraction.len()).unwrap_or(18));
            nanos += digits * unit_nanos / scale;
        }
        total += nanos;
        if total > MAX_NANOS {
            return Err(fail("too large"));
        }
        rest = tail;
    }
    if negative && total > 0 {
        return Err(fail("must not be negative"));
    }
    // total <= i64::MAX, so it fits in u64.
    Ok(Duration::from_nanos(u64::try_from(total).unwrap_or(u64::MAX)))
}

fn split_digits(s: &str) -> (&str, &str) {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s.split_at(end)
}

/// Formats a duration the way Go's `Duration.String` does: `"0s"`, `"500ms"`,
/// `"1.5µs"`, `"30s"`, `"1m0s"`, `"1h2m3.5s"`.
pub fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}\u{b5}s", decimal(nanos, 3));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", decimal(nanos, 6));
    }
    let hours = nanos / 3_600_000_000_000;
    let minutes = nanos / 60_000_000_000 % 60;
    let seconds = decimal(nanos % 60_000_000_000, 9);
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, m) => format!("{m}m{seconds}s"),
        (h, m) => format!("{h}h{m}m{seconds}s"),
    }
}

/// `value / 10^places` as a decimal with trailing zeros (and point) dropped.
fn decimal(value: u128, places: u32) -> String {
    let scale = 10u128.pow(places);
    let (whole, fraction) = (value / scale, value % scale);
    if fraction == 0 {
        return whole.to_string();
    }
    let digits = format!("{fraction:0width$}", width = places as usize);
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// A [`Duration`] read from and shown in Go's syntax; what the configuration
/// file's duration fields deserialize into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GoDuration(pub Duration);

impl FromStr for GoDuration {
    type Err = DurationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_duration(s).map(GoDuration)
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl serde::de::Visitor<'_> for Visitor {
            type Value = GoDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"30s\", \"1m0s\" or \"500ms\"")
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<GoDuration, E> {
                text.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_str(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn parses_go_durations() {
        let cases: &[(&str, Duration)] = &[
            ("0", Duration::ZERO),
            ("-0", Duration::ZERO),
            ("+0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("-0s", Duration::ZERO),
            ("30s", Duration::from_secs(30)),
            ("+30s", Duration::from_secs(30)),
            ("1m0s", Duration::from_secs(60)),
            ("15m0s", Duration::from_secs(900)),
            ("500ms", ms(500)),
            ("1h2m3.5s", Duration::from_millis(3_723_500)),
            ("24h0m0s", Duration::from_secs(86_400)),
            ("1.5h", Duration::from_secs(5_400)),
            (".5s", ms(500)),
            ("1.s", Duration::from_secs(1)),
            ("250us", Duration::from_micros(250)),
            ("250\u{b5}s", Duration::from_micros(250)),
            ("250\u{3bc}s", Duration::from_micros(250)),
            ("7ns", Duration::from_nanos(7)),
            ("1s500ms", ms(1_500)),
            ("0.000000001s", Duration::from_nanos(1)),
            ("1.0000000001s", Duration::from_secs(1)),
            ("2562047h", Duration::from_secs(2_562_047 * 3_600)),
        ];
        for (input, want) in cases {
            assert_eq!(parse_duration(input), Ok(*want), "{input}");
        }
    }

    #[test]
    fn rejects_bad_durations() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("-", "empty"),
            ("30", "missing unit"),
            ("1h30", "missing unit"),
            ("s", "expected a number"),
            (".s", "expected a number"),
            ("3x", "unknown unit \"x\""),
            ("3 s", "unknown unit \" s\""),
            ("1d", "unknown unit \"d\""),
            ("-1s", "must not be negative"),
            ("2562048h", "too large"),
            ("99999999999999999999999999999999999999999h", "too large"),
            ("abc", "expected a number"),
        ];
        for (input, reason) in cases {
            let err = parse_duration(input).expect_err(input);
            assert!(err.reason.contains(reason), "{input}: {err}");
            assert!(err.to_string().contains(&format!("{input:?}")), "{err}");
        }
    }

    #[test]
    fn formats_like_go() {
        let cases: &[(Duration, &str)] = &[
            (Duration::ZERO, "0s"),
            (Duration::from_nanos(7), "7ns"),
            (Duration::from_nanos(1_500), "1.5\u{b5}s"),
            (ms(500), "500ms"),
            (Duration::from_micros(1_250), "1.25ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(900), "15m0s"),
            (Duration::from_millis(3_723_500), "1h2m3.5s"),
            (Duration::from_secs(86_400), "24h0m0s"),
        ];
        for (d, want) in cases {
            assert_eq!(format_duration(*d), *want);
            assert_eq!(parse_duration(want), Ok(*d), "round trip {want}");
        }
    }

    #[test]
    fn deserializes_from_a_string() {
        let d: GoDuration = serde_json::from_value(serde_json::json!("1m30s")).unwrap();
        assert_eq!(d, GoDuration(Duration::from_secs(90)));
        assert_eq!(d.to_string(), "1m30s");
        let err = serde_json::from_value::<GoDuration>(serde_json::json!("soon")).unwrap_err();
        assert!(err.to_string().contains("invalid duration \"soon\""), "{err}");
        let err = serde_json::from_value::<GoDuration>(serde_json::json!(30)).unwrap_err();
        assert!(
            err.to_string().contains("expected a duration string such as \"30s\""),
            "{err}"
        );
    }
}
