//! Progress bars on stderr for long work (convert, pull, fetch, load, synth). xtask compiles
//! this file too (`#[path]`), with the `convert` and `pull` commands.

use indicatif::{ProgressBar, ProgressStyle};

/// A byte-counting bar with throughput and ETA. Hidden when stderr is not a terminal, so
/// scripts and CI logs stay clean.
pub fn bytes_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("static template is valid")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// Feeds the progress hooks of a conversion, a download, or a pull (downloads, then the
/// conversion) into one bar on stderr.
pub(crate) struct BarProgress {
    bar: ProgressBar,
}

impl BarProgress {
    pub(crate) fn new(what: &str) -> BarProgress {
        BarProgress {
            bar: bytes_bar(0, what),
        }
    }
}

impl gdsllm_convert::Progress for BarProgress {
    fn start(&self, total_bytes: u64) {
        self.bar.set_length(total_bytes);
        self.bar.set_position(0);
        self.bar.reset_eta();
    }
    fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
    }
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl gdsllm_fetch::Progress for BarProgress {
    fn start(&self, total: u64, done: u64) {
        self.bar.reset();
        self.bar.set_length(total);
        self.bar.set_position(done);
    }
    fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
    }
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl gdsllm_store::PullProgress for BarProgress {
    fn phase(&self, what: &str) {
        // File names can be long; the bar keeps its width.
        let short: String = what
            .chars()
            .rev()
            .take(24)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        self.bar.set_message(short);
    }
}
