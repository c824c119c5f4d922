//! SVG charts of the results (plotters): latency vs N per mode, programming
//! time vs N per mode, requests/s vs N per mode. The number of Services is
//! on a log axis; each point is a median, its bar the rounds' min-max. A
//! mode that did not program N Services in the time it was given is drawn
//! at that time as a lower bound (a triangle pointing up), not left out.

use anyhow::{Result, anyhow};
use plotters::{coord::ranged1d::ValueFormatter, prelude::*};

use crate::{
    results::{ModeStatus, Results, Run},
    stats::Summary,
};

const SIZE: (u32, u32) = (900, 540);

/// One chart: its file suffix, its title and the SVG text.
pub struct Rendered {
    pub suffix: &'static str,
    pub title: String,
    pub svg: String,
}

/// One point of a line: (Services, median, min, max, a lower bound only).
type Point = (f64, f64, f64, f64, bool);

/// A mode's points.
type Line = (String, Vec<Point>);

fn color(mode: &str) -> RGBColor {
    match mode {
        "ebpf" => RGBColor(31, 119, 180),
        "iptables" => RGBColor(214, 39, 40),
        "iptables-legacy" => RGBColor(140, 86, 75),
        "nftables" => RGBColor(255, 127, 14),
        "ipvs" => RGBColor(44, 160, 44),
        "userspace" => RGBColor(148, 103, 189),
        _ => RGBColor(127, 127, 127),
    }
}

fn lines(results: &Results, value: impl Fn(&Run) -> Option<Summary>) -> Vec<Line> {
    bounded_lines(results, |run| Some((value(run)?, false)))
}

/// [`lines`] where a value may be a lower bound (`true`).
fn bounded_lines(results: &Results, value: impl Fn(&Run) -> Option<(Summary, bool)>) -> Vec<Line> {
    results
        .modes
        .iter()
        .filter(|m| m.status == ModeStatus::Ran)
        .map(|m| {
            let points = m
                .runs
                .iter()
                .filter_map(|run| {
                    let (s, bound) = value(run)?;
                    s.median
                        .is_finite()
                        .then_some((run.services as f64, s.median, s.min, s.max, bound))
                })
                .collect();
            (m.mode.clone(), points)
        })
        .filter(|(_, points): &Line| !points.is_empty())
        .collect()
}

/// Every chart there is data for.
pub fn render_all(results: &Results) -> Result<Vec<Rendered>> {
    let mut charts = Vec::new();
    let latency = lines(results, |run| Some(run.latency.as_ref()?.clusterip_last.connect_p50_us));
    let baseline = baseline_line(results);
    if !latency.is_empty() {
        let title = "Connect latency (p50) to the last Service, ClusterIP path".to_owned();
        let mut all = latency.clone();
        all.extend(baseline);
        charts.push(Rendered {
            suffix: "latency",
            svg: plot(&title, "connect p50, µs", &all, false)?,
            title,
        });
    }
    let programming = bounded_lines(results, |run| {
        let (seconds, bound) = run.programming.as_ref()?.seconds()?;
        Some((Summary::one(seconds), bound))
    });
    if !programming.is_empty() {
        let mut title = "Programming time: Services delivered -> the last one answers".to_owned();
        if programming.iter().any(|(_, points)| points.iter().any(|p| p.4)) {
            title.push_str(" (triangle: not programmed in the time given, a lower bound)");
        }
        charts.push(Rendered {
            suffix: "programming",
            svg: plot(&title, "seconds", &programming, true)?,
            title,
        });
    }
    let rps = lines(results, |run| {
        Some(run.throughput.as_ref()?.nodeport_short.requests_per_s)
    });
    if !rps.is_empty() {
        let title = "Requests/s through NodePort, a new connection per request".to_owned();
        charts.push(Rendered {
            suffix: "throughput",
            svg: plot(&title, "requests/s", &rps, false)?,
            title,
        });
    }
    Ok(charts)
}

/// The no-proxy baseline (the median over the modes' topologies), drawn
/// flat across the measured numbers of Services.
fn baseline_line(results: &Results) -> Option<Line> {
    let values: Vec<f64> = results
        .modes
        .iter()
        .filter_map(|m| Some(m.baseline.as_ref()?.bare.clusterip_path.connect_p50_us.median))
        .collect();
    let value = crate::stats::median(&values)?;
    let counts: Vec<f64> = results
        .modes
        .iter()
        .flat_map(|m| m.runs.iter().map(|r| r.services as f64))
        .collect();
    let lo = counts.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = counts.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    lo.is_finite().then(|| {
        (
            "no proxy".to_owned(),
            vec![(lo, value, value, value, false), (hi, value, value, value, false)],
        )
    })
}

fn plot(title: &str, y_desc: &str, lines: &[Line], log_y: bool) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
        let points = || lines.iter().flat_map(|(_, p)| p.iter());
        let x_lo = points().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let x_hi = points().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        let y_lo = points().map(|p| p.2).fold(f64::INFINITY, f64::min);
        let y_hi = points().map(|p| p.3).fold(f64::NEG_INFINITY, f64::max);
        let x_range = (x_lo * 0.8)..(x_hi * 1.25);
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(72);
        if log_y {
            let y_range = (y_lo.max(1e-6) * 0.5)..(y_hi * 2.0);
            let chart = builder
                .build_cartesian_2d(x_range.log_scale(), y_range.log_scale())
                .map_err(|e| anyhow!("{e:?}"))?;
            draw(chart, y_desc, lines)?;
        } else {
            let y_range = 0.0..(y_hi * 1.15).max(1e-9);
            let chart = builder
                .build_cartesian_2d(x_range.log_scale(), y_range)
                .map_err(|e| anyhow!("{e:?}"))?;
            draw(chart, y_desc, lines)?;
        }
        root.present().map_err(|e| anyhow!("{e:?}"))?;
    }
    Ok(svg)
}

fn draw<'a, X, Y>(
    mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    y_desc: &str,
    lines: &[Line],
) -> Result<()>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc("Services")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .max_light_lines(2)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    for (mode, points) in lines {
        let c = color(mode);
        let style = ShapeStyle::from(&c).stroke_width(2);
        chart
            .draw_series(LineSeries::new(points.iter().map(|p| (p.0, p.1)), style))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(mode.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| !p.4)
                    .map(|p| Circle::new((p.0, p.1), 3, c.filled())),
            )
            .map_err(|e| anyhow!("{e:?}"))?;
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| p.4)
                    .map(|p| TriangleMarker::new((p.0, p.1), 7, c.filled())),
            )
            .map_err(|e| anyhow!("{e:?}"))?;
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| p.3 > p.2)
                    .map(|p| PathElement::new(vec![(p.0, p.2), (p.0, p.3)], ShapeStyle::from(&c).stroke_width(1))),
            )
            .map_err(|e| anyhow!("{e:?}"))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_every_mode_that_ran() {
        let results = crate::fixture::results();
        let charts = render_all(&results).expect("charts");
        let suffixes: Vec<&str> = charts.iter().map(|c| c.suffix).collect();
        assert_eq!(suffixes, ["latency", "programming", "throughput"]);
        for chart in &charts {
            assert!(
                chart.svg.starts_with("<svg"),
                "{}",
                &chart.svg[..60.min(chart.svg.len())]
            );
            assert!(chart.svg.contains("ebpf") && chart.svg.contains("iptables"));
            assert!(!chart.svg.contains(">ipvs<"), "a skipped mode has no line");
        }
        assert!(charts[0].svg.contains("no proxy"));
    }

    /// The fixture's iptables run at 1,000 Services timed out: drawn as a
    /// lower bound (a triangle, a polygon in SVG), said in the title.
    #[test]
    fn a_mode_that_timed_out_is_drawn_as_a_lower_bound() {
        let results = crate::fixture::results();
        let charts = render_all(&results).expect("charts");
        let programming = charts
            .iter()
            .find(|c| c.suffix == "programming")
            .expect("programming chart");
        assert!(programming.title.contains("lower bound"), "{}", programming.title);
        assert!(programming.svg.contains("<polygon"), "no triangle drawn");
        let latency = charts.iter().find(|c| c.suffix == "latency").expect("latency chart");
        assert!(!latency.svg.contains("<polygon"), "no bound among the latencies");
    }
}
