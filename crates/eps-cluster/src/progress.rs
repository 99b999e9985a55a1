//! Progress of long commands (`eps train`, `eps soak`, `eps sim`): a bar on
//! a terminal (indicatif), redrawn in place, with the last report as its
//! message; plain lines when stderr is piped or logs are JSON, so that logs
//! and tests read the same lines as always.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A command's progress towards `total` steps.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    /// Progress of `what` over `total` units (a bar only on a terminal, with text logs).
    pub fn new(total: u64, what: &str) -> Self {
        let text = eps_metrics::log::format() == eps_metrics::log::LogFormat::Text;
        Self::with(total, what, text && std::io::stderr().is_terminal())
    }

    /// As [`Progress::new`], with or without the bar.
    pub fn with(total: u64, what: &str, bar: bool) -> Self {
        let bar = bar.then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(4));
            let style =
                ProgressStyle::with_template(&format!("{what} [{{bar:30}}] {{pos}}/{{len}} {{elapsed}} (eta {{eta}}) {{msg}}"))
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> ");
            b.set_style(style);
            b
        });
        Self { bar }
    }

    /// Whether a bar is drawn.
    pub fn is_bar(&self) -> bool {
        self.bar.is_some()
    }

    /// At `pos`; `line` is the latest report: the bar's message, or a line.
    pub fn update(&self, pos: u64, line: &str) {
        match &self.bar {
            Some(b) => {
                b.set_position(pos);
                b.set_message(line.trim().to_string());
            }
            None => eps_proto::say!("{line}"),
        }
    }

    /// At `pos`, with `msg` on the bar; nothing without a bar (for progress
    /// that has no line of its own).
    pub fn tick(&self, pos: u64, msg: &str) {
        if let Some(b) = &self.bar {
            b.set_position(pos);
            b.set_message(msg.to_string());
        }
    }

    /// A line that stays (printed above the bar).
    pub fn line(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None => eps_proto::say!("{line}"),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_a_terminal_there_is_no_bar() {
        // Tests run with stderr captured or piped.
        assert!(!super::Progress::new(10, "t").is_bar() || std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let p = super::Progress::with(10, "t", true);
        assert!(p.is_bar());
        p.update(3, "step 3/10");
        assert_eq!(p.bar.as_ref().map(|b| b.position()), Some(3));
    }
}
