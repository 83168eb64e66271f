//! Progress bars on stderr for long work (convert, fetch, load, synth).

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
