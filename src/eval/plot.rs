//! PNG charts of a [`Report`]: KL against bytes per token (the memory/accuracy Pareto chart) and
//! KL against context depth. Text is drawn with a TrueType font read at run time (`HIPKV_FONT`,
//! else DejaVu Sans or Liberation Sans where Debian puts them), so no system font library is
//! linked.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use super::{DEPTH_BUCKETS, EvalError, Report};

const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (960, 720);

/// Registers the plot font once; the result is remembered.
fn font() -> Result<(), EvalError> {
    static REGISTERED: OnceLock<Result<(), Vec<String>>> = OnceLock::new();
    let result = REGISTERED.get_or_init(|| {
        let candidates: Vec<String> = std::env::var("HIPKV_FONT")
            .into_iter()
            .chain(FONT_PATHS.iter().map(|p| p.to_string()))
            .collect();
        for path in &candidates {
            if let Ok(bytes) = std::fs::read(path) {
                // plotters keeps fonts for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(candidates)
    });
    result.clone().map_err(|tried| EvalError::NoFont { tried })
}

fn plot_error<E: std::error::Error + Send + Sync + 'static>(
    path: &Path,
) -> impl Fn(E) -> EvalError {
    let path = path.to_path_buf();
    move |e| EvalError::Plot {
        path: path.clone(),
        source: Box::new(e),
    }
}

/// A power-of-ten range holding every positive value with some room.
fn log_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| *v > 0.0 && v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() {
        return 1e-4..1.0;
    }
    // A quarter decade of room at either end, so no point sits on the frame.
    let lo = 10f64.powf((lo.log10() - 0.25).floor());
    let hi = 10f64.powf((hi.log10() + 0.25).ceil());
    lo..hi
}

fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    COLORS[i % COLORS.len()]
}

/// Mean KL against cache bytes per token, one labelled point per scheme (schemes with KL 0, the
/// baseline itself, cannot sit on the log axis and are left out).
pub fn plot_pareto(report: &Report, title: &str, path: &Path) -> Result<PathBuf, EvalError> {
    font()?;
    let err = plot_error(path);
    let points: Vec<(&str, f64, f64)> = report
        .schemes
        .iter()
        .filter(|s| s.mean_kl > 0.0)
        .map(|s| (s.scheme.as_str(), s.bytes_per_token / 1024.0, s.mean_kl))
        .collect();
    let x_max = report
        .schemes
        .iter()
        .map(|s| s.bytes_per_token / 1024.0)
        .fold(0.0, f64::max)
        * 1.1;
    let y = log_range(points.iter().map(|p| p.2));
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..x_max.max(1.0), y.log_scale())
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc("KV cache KiB per token (all layers and KV heads, everything included)")
        .y_desc("mean KL(P_f16 || Q), nats")
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .draw()
        .map_err(&err)?;
    for (i, &(name, x, kl)) in points.iter().enumerate() {
        let c = color(i);
        // The name to the right of its point, so neighbouring points stay readable.
        let point = EmptyElement::at((x, kl))
            + Circle::new((0, 0), 6, c.filled())
            + Text::new(name.to_string(), (10, -8), (FONT, 15).into_font().color(&c));
        chart.draw_series(std::iter::once(point)).map_err(&err)?;
    }
    root.present().map_err(&err)?;
    Ok(path.to_path_buf())
}

/// Mean KL per context-depth bucket, one line per scheme (empty buckets and KL 0 left out).
pub fn plot_depth(report: &Report, title: &str, path: &Path) -> Result<PathBuf, EvalError> {
    font()?;
    let err = plot_error(path);
    let buckets = DEPTH_BUCKETS
        .iter()
        .filter(|(from, _)| *from < report.scored)
        .count()
        .max(1);
    let y = log_range(
        report
            .schemes
            .iter()
            .flat_map(|s| s.depth.iter().filter_map(|b| b.mean_kl)),
    );
    // Three empty decades below the data hold the legend.
    let y = y.start / 1e3..y.end;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5..buckets as f64 - 0.5, y.log_scale())
        .map_err(&err)?;
    let label = |v: &f64| {
        let i = v.round();
        if (v - i).abs() > 1e-6 || i < 0.0 || i as usize >= buckets {
            return String::new();
        }
        let (from, to) = DEPTH_BUCKETS[i as usize];
        let k = |n: usize| {
            if n >= 1024 {
                format!("{}k", n / 1024)
            } else {
                n.to_string()
            }
        };
        format!("{}-{}", k(from), k(to))
    };
    chart
        .configure_mesh()
        .x_desc("context depth of the predicted token (tokens)")
        .y_desc("mean KL(P_f16 || Q), nats")
        .x_labels(buckets)
        .x_label_formatter(&label)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .draw()
        .map_err(&err)?;
    for (i, s) in report
        .schemes
        .iter()
        .filter(|s| s.mean_kl > 0.0)
        .enumerate()
    {
        let c = color(i);
        let points: Vec<(f64, f64)> = s
            .depth
            .iter()
            .enumerate()
            .filter_map(|(j, b)| b.mean_kl.filter(|kl| *kl > 0.0).map(|kl| (j as f64, kl)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
            .map_err(&err)?
            .label(s.scheme.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(points.into_iter().map(|p| Circle::new(p, 4, c.filled())))
            .map_err(&err)?;
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(&err)?;
    root.present().map_err(&err)?;
    Ok(path.to_path_buf())
}
