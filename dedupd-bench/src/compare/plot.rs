//! The comparison's PNG plots (`--plots DIR`): throughput by system, dedupd's throughput as
//! its stored keys grow, and bytes per key; and the soak's curves over time (`dedupd-bench
//! soak --plot FILE`). The only module that imports `plotters`.
//!
//! Text needs a font file: plotters draws glyphs with `ab_glyph` from a TrueType file read
//! at run time, so nothing depends on the machine's font configuration. The file is
//! `DEDUPD_BENCH_FONT` when set, else DejaVu Sans or Liberation Sans from their Debian
//! packages (`fonts-dejavu-core`, `fonts-liberation`); without one no plot is written and
//! the run says why.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::CompareReport;

const FONT_FILES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/liberation2/LiberationSans-Regular.ttf",
];

/// Registers the font once per process (plotters keeps fonts for the process's life).
fn font() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let path = std::env::var_os("DEDUPD_BENCH_FONT")
                .map(PathBuf::from)
                .or_else(|| FONT_FILES.iter().map(PathBuf::from).find(|p| p.exists()))
                .ok_or("no font file for the plots' text: install fonts-dejavu-core or set DEDUPD_BENCH_FONT to a .ttf file")?;
            let bytes = std::fs::read(&path)
                .map_err(|e| format!("cannot read font {}: {e}", path.display()))?;
            // plotters wants the font for the life of the process; it is read once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{} is not a font plotters can read", path.display()))
        })
        .clone()
}

/// Draws every plot into `dir` (created if needed); returns the files written.
pub fn draw_all(report: &CompareReport, dir: &Path) -> Result<Vec<PathBuf>, String> {
    font()?;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let measured: Vec<_> = report.rows.iter().filter(|r| r.measured()).collect();
    let stamp = format!(
        "{} · {} cores · commit {} · {} msgs (per-request rows {})",
        &report.machine.date_utc[..10.min(report.machine.date_utc.len())],
        report.machine.cores,
        report.machine.commit,
        report.params.messages,
        report.params.request_messages
    );
    let mut files = Vec::new();

    let path = dir.join("throughput.png");
    let bars: Vec<(String, f64)> = measured
        .iter()
        .map(|r| (r.system.clone(), r.msgs_per_sec))
        .collect();
    bar_chart(
        &path,
        "messages per second (log scale)",
        &stamp,
        &bars,
        true,
    )
    .map_err(e)?;
    files.push(path);

    let path = dir.join("bytes_per_key.png");
    let mem: Vec<(String, f64)> = measured
        .iter()
        .map(|r| (r.system.clone(), r.memory_bytes_per_key))
        .collect();
    let disk: Vec<(String, f64)> = measured
        .iter()
        .map(|r| (r.system.clone(), r.disk_bytes_per_key))
        .collect();
    {
        let root = BitMapBackend::new(&path, (1200, 1000)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let halves = root.split_evenly((2, 1));
        draw_bars(
            &halves[0],
            "resident memory bytes per stored key",
            &stamp,
            &mem,
            false,
        )
        .map_err(e)?;
        draw_bars(
            &halves[1],
            "disk bytes per stored key (allocated)",
            &stamp,
            &disk,
            false,
        )
        .map_err(e)?;
        root.present().map_err(e)?;
    }
    files.push(path);

    let path = dir.join("throughput_vs_keys.png");
    series_chart(&path, report, &stamp).map_err(e)?;
    files.push(path);
    Ok(files)
}

fn e(err: impl std::fmt::Display) -> String {
    format!("plot: {err}")
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn bar_chart(
    path: &Path,
    title: &str,
    stamp: &str,
    bars: &[(String, f64)],
    log: bool,
) -> DrawResult {
    let root =
        BitMapBackend::new(path, (1200, 100 + 48 * bars.len().max(1) as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    draw_bars(&root, title, stamp, bars, log)?;
    root.present()?;
    Ok(())
}

/// Horizontal bars, one per system, each labelled with its name and value.
fn draw_bars(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    stamp: &str,
    bars: &[(String, f64)],
    log: bool,
) -> DrawResult {
    let n = bars.len().max(1) as f64;
    let max = bars.iter().map(|b| b.1).fold(1.0, f64::max) * 3.0;
    let caption = format!("{title} — {stamp}");
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(8);
    let label = |(name, v): &(String, f64)| format!("{name}: {v:.0}");
    let style = ("sans-serif", 15).into_font();
    if log {
        let mut chart = builder.build_cartesian_2d((1f64..max).log_scale(), -0.5f64..n - 0.5)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .x_label_formatter(&|v| human(*v))
            .draw()?;
        for (i, b) in bars.iter().enumerate() {
            let y = n - 1.0 - i as f64;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(1.0, y - 0.3), (b.1.max(1.0), y + 0.05)],
                Palette99::pick(i).filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                label(b),
                (1.05, y + 0.4),
                style.clone(),
            )))?;
        }
    } else {
        let mut chart = builder.build_cartesian_2d(0f64..max / 2.0, -0.5f64..n - 0.5)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .x_label_formatter(&|v| human(*v))
            .draw()?;
        for (i, b) in bars.iter().enumerate() {
            let y = n - 1.0 - i as f64;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(0.0, y - 0.3), (b.1, y + 0.05)],
                Palette99::pick(i).filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                label(b),
                (0.0, y + 0.4),
                style.clone(),
            )))?;
        }
    }
    Ok(())
}

/// dedupd claim-only's msgs/s per series step against the messages released so far
/// (stored keys grow with them, by the share of new ids).
fn series_chart(path: &Path, report: &CompareReport, stamp: &str) -> DrawResult {
    let root = BitMapBackend::new(path, (1200, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let points: Vec<(f64, f64)> = report
        .series
        .iter()
        .map(|p| (p.messages as f64, p.msgs_per_sec))
        .collect();
    let xmax = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let ymax = points.iter().map(|p| p.1).fold(1.0, f64::max) * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("dedupd claim-only msgs/s as claims accumulate — {stamp}"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
    chart
        .configure_mesh()
        .x_desc("messages released (stored keys ≈ messages × (1 − dup rate))")
        .y_desc("msgs/s")
        .x_label_formatter(&|v| human(*v))
        .y_label_formatter(&|v| human(*v))
        .draw()?;
    chart.draw_series(LineSeries::new(
        points.iter().copied(),
        BLUE.stroke_width(2),
    ))?;
    chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, BLUE.filled())))?;
    root.present()?;
    Ok(())
}

/// 1234567 → "1.2M".
fn human(v: f64) -> String {
    match v.abs() {
        a if a >= 1e9 => format!("{:.1}G", v / 1e9),
        a if a >= 1e6 => format!("{:.1}M", v / 1e6),
        a if a >= 1e3 => format!("{:.0}k", v / 1e3),
        _ => format!("{v:.0}"),
    }
}

/// One curve of a soak panel: its legend, points `(seconds, value)` and colour.
type Curve<'a> = (&'a str, Vec<(f64, f64)>, RGBColor);

/// The soak's curves over time (`dedupd-bench soak --plot FILE`), one panel per figure:
/// memory and disk, ack latency against the p99 limit, throughput and backlog, claims
/// stored, and the generations sealed, merged and dropped.
pub fn draw_soak(report: &dedupd::bench::SoakReport, path: &Path) -> Result<(), String> {
    font()?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|x| format!("cannot create {}: {x}", dir.display()))?;
    }
    let s = &report.samples;
    let curve = |f: fn(&dedupd::bench::SoakSample) -> f64| -> Vec<(f64, f64)> {
        s.iter().map(|x| (x.t_s, f(x))).collect()
    };
    let p = &report.params;
    let title = format!(
        "dedupd soak: {:.0} s at {:.0} msgs/s ({:.0} % of {:.0} measured), {} shards, TTL {:.0} s — {}",
        p.duration.as_secs_f64(),
        report.offered_msgs_per_sec,
        p.load * 100.0,
        report.capacity_msgs_per_sec,
        report.shards,
        p.ttl.as_secs_f64(),
        if report.passed() { "PASS" } else { "FAIL" }
    );
    let root = BitMapBackend::new(path, (1200, 1500)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let root = root.titled(&title, ("sans-serif", 20)).map_err(e)?;
    let panels = root.split_evenly((5, 1));
    let limit = dedupd::bench::soak::P99_LIMIT * report.first_minute_p99_ms;
    let drawn = [
        soak_panel(
            &panels[0],
            "memory and disk (MiB)",
            &[
                ("RSS", curve(|x| x.rss_bytes as f64 / 1048576.0), BLUE),
                (
                    "disk allocated",
                    curve(|x| x.disk_allocated_bytes as f64 / 1048576.0),
                    RED,
                ),
            ],
            None,
        ),
        soak_panel(
            &panels[1],
            "ack latency per interval (ms, from the scheduled time)",
            &[
                ("p50", curve(|x| x.p50_ms), GREEN),
                ("p99", curve(|x| x.p99_ms), BLUE),
            ],
            Some((limit, "2 x first-minute p99")),
        ),
        soak_panel(
            &panels[2],
            "throughput (msgs/s) and backlog (msgs)",
            &[
                ("acked msgs/s", curve(|x| x.msgs_per_sec), BLUE),
                ("backlog", curve(|x| x.backlog as f64), RED),
            ],
            None,
        ),
        soak_panel(
            &panels[3],
            "claims stored (expired, not yet dropped, included)",
            &[("claims", curve(|x| x.claims as f64), BLUE)],
            None,
        ),
        soak_panel(
            &panels[4],
            "generations: sealed now; seals, merges, dropped by expiry since the start",
            &[
                ("sealed now", curve(|x| x.sealed_generations as f64), BLUE),
                ("seals", curve(|x| x.seals as f64), GREEN),
                ("merges", curve(|x| x.merges as f64), MAGENTA),
                ("dropped", curve(|x| x.dropped_generations as f64), RED),
            ],
            None,
        ),
    ];
    for d in drawn {
        d.map_err(e)?;
    }
    root.present().map_err(e)
}

fn soak_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    curves: &[Curve<'_>],
    hline: Option<(f64, &str)>,
) -> DrawResult {
    let xmax = curves
        .iter()
        .flat_map(|c| c.1.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let ymax = curves
        .iter()
        .flat_map(|c| c.1.iter().map(|p| p.1))
        .chain(hline.map(|h| h.0))
        .fold(1e-9, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_label_formatter(&|v| match ymax {
            m if m < 100.0 => format!("{v:.1}"),
            m if m < 10_000.0 => format!("{v:.0}"),
            _ => human(*v),
        })
        .draw()?;
    for (name, points, colour) in curves {
        let colour = *colour;
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
            });
    }
    if let Some((y, name)) = hline {
        chart
            .draw_series(LineSeries::new(
                [(0.0, y), (xmax, y)],
                BLACK.stroke_width(1),
            ))?
            .label(name)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}
