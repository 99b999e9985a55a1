//! `eps soak --plot`: resident memory per role (top) and push_pull latency
//! (bottom) over the soak, each fault a vertical line coloured by its kind.

use std::path::Path;

use plotters::prelude::*;

use super::faults::Kind;
use super::{ROLES, Soaked};

fn color(k: Kind) -> RGBColor {
    match k {
        Kind::ServerKill => RGBColor(220, 50, 47),
        Kind::ScaleOut => RGBColor(38, 139, 210),
        Kind::ScaleIn => RGBColor(42, 161, 152),
        Kind::ServerStall => RGBColor(203, 75, 22),
        Kind::WorkerStall => RGBColor(211, 54, 130),
        Kind::ControlKill => RGBColor(88, 110, 117),
        Kind::ServerCut => RGBColor(133, 153, 0),
    }
}

pub(crate) fn draw(path: &Path, s: &Soaked) -> Result<(), String> {
    crate::bench::plot::register_font()?;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let x_max = s.seconds.max(1.0);
        let root = BitMapBackend::new(path, (1200, 900)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(450);
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let rss_max = s.ticks.iter().flat_map(|t| t.rss).map(mib).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(&top)
            .caption(format!("eps soak: {} faults; resident memory per role", s.faults.faults.len()), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(65)
            .build_cartesian_2d(0f64..x_max, 0f64..rss_max)?;
        chart.configure_mesh().x_desc("seconds").y_desc("RSS anon + shmem, summed (MiB)").draw()?;
        faults(&mut chart, s, 0.0, rss_max)?;
        let palette = [RGBColor(0, 0, 0), RGBColor(38, 139, 210), RGBColor(133, 153, 0)];
        for (r, name) in ROLES.iter().enumerate() {
            let c = palette[r];
            chart
                .draw_series(LineSeries::new(s.ticks.iter().map(|t| (t.t, mib(t.rss[r]))), c.stroke_width(2)))?
                .label(format!("{name}s"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
        }
        chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.85)).draw()?;

        // Latency, log scale: stalls reach seconds, steady steps milliseconds.
        let ms = |us: f64| (us / 1e3).max(0.01);
        let lat_max = s.lat.iter().map(|l| ms(l.p99_us)).fold(1.0, f64::max) * 2.0;
        let lat_min = s.lat.iter().map(|l| ms(l.p50_us)).fold(lat_max, f64::min) / 2.0;
        let mut chart = ChartBuilder::on(&bottom)
            .caption("push_pull latency per worker and second", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(65)
            .build_cartesian_2d(0f64..x_max, (lat_min..lat_max).log_scale())?;
        chart.configure_mesh().x_desc("seconds").y_desc("latency (ms)").draw()?;
        faults(&mut chart, s, lat_min, lat_max)?;
        for (name, c, pick) in [
            ("p50", RGBColor(38, 139, 210), (|l: &super::Lat| l.p50_us) as fn(&super::Lat) -> f64),
            ("p99", RGBColor(220, 50, 47), |l: &super::Lat| l.p99_us),
        ] {
            chart
                .draw_series(s.lat.iter().map(|l| Circle::new((l.t, ms(pick(l))), 2, c.filled())))?
                .label(name)
                .legend(move |(x, y)| Circle::new((x + 7, y), 3, c.filled()));
        }
        for k in Kind::ALL {
            let c = color(k);
            chart
                .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
                .label(k.name())
                .legend(move |(x, y)| PathElement::new([(x + 7, y - 6), (x + 7, y + 6)], c.stroke_width(2)));
        }
        chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.85)).draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| e.to_string())
}

/// A vertical line at each fault, from `y_min` to `y_max`.
fn faults<DB: DrawingBackend, Y: Ranged<ValueType = f64>>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>,
    s: &Soaked,
    y_min: f64,
    y_max: f64,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    for f in &s.faults.faults {
        let c = color(f.kind);
        chart.draw_series(LineSeries::new([(f.at_s, y_min), (f.at_s, y_max)], c.mix(0.6).stroke_width(1)))?;
    }
    Ok(())
}
