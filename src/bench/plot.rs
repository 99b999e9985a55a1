//! `eps bench migrate --plot`: pull latency over time as a PNG, the migration's
//! phases shaded. Text needs a TrueType font, read at run time from the usual
//! system locations (Debian: fonts-dejavu-core) or from `EPS_PLOT_FONT`.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::bench::migrate::MigrateReport;

/// Where a sans-serif TrueType font is looked for, in order.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
];

pub(crate) fn register_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let custom = std::env::var("EPS_PLOT_FONT").ok();
        let candidates = custom.iter().map(String::as_str).chain(FONT_PATHS.iter().copied());
        for p in candidates {
            if let Ok(bytes) = std::fs::read(p) {
                // Registered once per process; plotters keeps a 'static reference.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                return plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                    .map_err(|_| format!("{p} is not a usable TrueType font"));
            }
        }
        Err(format!(
            "no TrueType font found for the plot's text (looked at {}); install fonts-dejavu-core or set EPS_PLOT_FONT=FILE.ttf",
            FONT_PATHS.join(", ")
        ))
    })
    .clone()
}

/// Draws the pulls of `r` (latency in ms against seconds since the first pull) with
/// the preparing, copying and cutover phases shaded, into the PNG at `path`.
pub fn migration(path: &Path, r: &MigrateReport) -> Result<(), String> {
    register_font()?;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let t0 = r.samples.first().map_or(0, |s| s.0);
        let secs = |us: u64| us.saturating_sub(t0) as f64 / 1e6;
        let points: Vec<(f64, f64)> = r.samples.iter().map(|&(at, lat)| (secs(at), lat as f64 / 1e3)).collect();
        let x_max = points.last().map_or(1.0, |p| p.0).max(1e-3) * 1.02;
        let y_max = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-3) * 1.15;
        let root = BitMapBackend::new(path, (1200, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "pulls of a {} MiB shard during {} migrations (p99 steady {:.1} ms, during {:.1} ms)",
            r.snapshot_bytes >> 20,
            r.migrations.len(),
            r.pull_lat_us_p99_steady / 1e3,
            r.pull_lat_us_p99_during / 1e3
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(65)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
        chart.configure_mesh().x_desc("time since the first pull (s)").y_desc("pull latency (ms)").draw()?;
        let bands = [
            ("preparing (target registers memory)", RGBColor(255, 200, 80)),
            ("copying (snapshot)", RGBColor(240, 110, 90)),
            ("cutover (forwarding until the cutover iteration)", RGBColor(120, 170, 240)),
        ];
        for (i, (name, color)) in bands.into_iter().enumerate() {
            let spans = r.migrations.iter().map(|m| match i {
                0 => (m.preparing_us, m.copying_us),
                1 => (m.copying_us, m.cutover_us),
                _ => (m.cutover_us, m.done_us),
            });
            let rects: Vec<_> = spans
                .filter(|&(a, b)| a != 0 && b >= a)
                .map(|(a, b)| {
                    let (x0, x1) = (secs(a), secs(b).max(secs(a) + x_max * 0.002));
                    Rectangle::new([(x0, 0.0), (x1, y_max)], color.mix(0.35).filled())
                })
                .collect();
            chart
                .draw_series(rects)?
                .label(name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.mix(0.6).filled()));
        }
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 2, BLACK.filled())))?
            .label("one pull")
            .legend(|(x, y)| Circle::new((x + 7, y), 3, BLACK.filled()));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| e.to_string())
}
