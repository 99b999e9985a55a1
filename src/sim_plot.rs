//! `eps sim --plot`: slots allocated over time under each policy, and the
//! distribution of feedback latencies, as one PNG.

use std::path::Path;

use eps_sched::{JobRecord, Summary};
use plotters::prelude::*;

const COLORS: [RGBColor; 4] = [RGBColor(200, 60, 40), RGBColor(40, 110, 200), RGBColor(30, 150, 60), RGBColor(120, 60, 160)];

/// Draws `runs` (one per policy) on `slots` slots into the PNG at `path`.
pub fn draw(path: &Path, slots: u32, runs: &[(Summary, Vec<JobRecord>)]) -> Result<(), String> {
    crate::bench::plot::register_font()?;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(800);
        let t_max = runs.iter().flat_map(|(s, _)| s.timeline.last().map(|p| p.0)).fold(1.0, f64::max);
        let mut c = ChartBuilder::on(&left)
            .caption(format!("slots allocated ({slots} in the cluster)"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..t_max * 1.02, 0.0..f64::from(slots) * 1.05)?;
        c.configure_mesh().x_desc("seconds").y_desc("slots").draw()?;
        for (k, (s, _)) in runs.iter().enumerate() {
            let color = COLORS[k % COLORS.len()];
            // A step line: each value holds until the next decision.
            let mut pts = Vec::with_capacity(2 * s.timeline.len());
            for w in s.timeline.windows(2) {
                pts.push((w[0].0, f64::from(w[0].1)));
                pts.push((w[1].0, f64::from(w[0].1)));
            }
            if let Some(&(t, u)) = s.timeline.last() {
                pts.push((t, f64::from(u)));
            }
            c.draw_series(LineSeries::new(pts, color.stroke_width(1)))?
                .label(s.policy.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        c.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.9)).draw()?;
        let lat = |r: &[JobRecord]| {
            let mut v: Vec<f64> = r.iter().filter_map(|j| j.feedback_s.map(|f| f - j.submit_s)).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let x_max = runs.iter().flat_map(|(_, r)| lat(r).last().copied()).fold(1.0, f64::max);
        let mut c = ChartBuilder::on(&right)
            .caption("feedback latency (CDF over jobs)", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((1.0..x_max * 1.1).log_scale(), 0.0..1.0)?;
        c.configure_mesh().x_desc("seconds from submit to feedback (log)").y_desc("fraction of jobs").draw()?;
        for (k, (s, r)) in runs.iter().enumerate() {
            let color = COLORS[k % COLORS.len()];
            let v = lat(r);
            let n = v.len().max(1) as f64;
            let pts = v.iter().enumerate().map(|(i, &x)| (x.max(1.0), (i + 1) as f64 / n));
            c.draw_series(LineSeries::new(pts, color.stroke_width(2)))?
                .label(s.policy.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.9))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("cannot draw {}: {e}", path.display()))
}
