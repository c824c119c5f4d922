//! The progress bar, and how long each part took (printed as it ends and
//! kept for the results).

use std::{
    io::IsTerminal,
    time::{Duration, Instant},
};

use indicatif::{ProgressBar, ProgressStyle};

use crate::results::PartTiming;

pub struct Progress {
    bar: ProgressBar,
    /// Without a terminal (CI), or on one that cannot redraw (`TERM=dumb`:
    /// the serial console of `cargo xtask bench --vm`), the bar is hidden:
    /// lines go to stderr.
    plain: bool,
    timings: std::cell::RefCell<Vec<PartTiming>>,
}

impl Progress {
    pub fn new(steps: u64) -> Self {
        let dumb = std::env::var("TERM").is_ok_and(|term| term == "dumb");
        let plain = dumb || !std::io::stderr().is_terminal();
        let bar = if plain {
            ProgressBar::hidden()
        } else {
            let bar = ProgressBar::new(steps);
            let style = ProgressStyle::with_template("{elapsed_precise} [{bar:32.cyan/blue}] {pos}/{len} {wide_msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        };
        Self {
            bar,
            plain,
            timings: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// What is happening now.
    pub fn message(&self, text: &str) {
        self.bar.set_message(text.to_owned());
    }

    /// A line that stays (above the bar).
    pub fn say(&self, line: &str) {
        if self.plain {
            eprintln!("xproxy-bench: {line}");
        } else {
            self.bar.println(line);
        }
    }

    /// One step of the bar done.
    pub fn step(&self) {
        self.bar.inc(1);
    }

    /// Runs `f` as the part `name`: shows it, then prints and keeps its time.
    pub fn part<T>(&self, name: &str, f: impl FnOnce() -> T) -> T {
        self.message(name);
        let started = Instant::now();
        let out = f();
        let seconds = started.elapsed().as_secs_f64();
        self.say(&format!("{name}: {seconds:.1} s"));
        self.timings.borrow_mut().push(PartTiming {
            part: name.to_owned(),
            seconds,
        });
        out
    }

    pub fn timings(&self) -> Vec<PartTiming> {
        self.timings.borrow().clone()
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
