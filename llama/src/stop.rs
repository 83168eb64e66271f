//! Stop strings over streamed text: text that might be the start of a stop string is held back
//! until the next token decides, so a reader of the stream never sees any part of a stop
//! string. The one matcher of the workspace: [`crate::generate::SeqStep`] (so `gdsllm run` and
//! batched generation) and the server's streaming responses use it.

/// What [`StopMatcher::push`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that can be sent now.
    pub emit: String,
    /// A stop string was found; generation must end and `emit` is the last text.
    pub stopped: bool,
}

/// Holds back streamed text until it is known not to start a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return StopOutcome {
                emit: std::mem::take(&mut self.held),
                stopped: false,
            };
        }
        let first_stop = self.stops.iter().filter_map(|s| self.held.find(s)).min();
        if let Some(at) = first_stop {
            let emit = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome {
                emit,
                stopped: true,
            };
        }
        let keep = self.partial_suffix_len();
        let split = self.held.len() - keep;
        let rest = self.held.split_off(split);
        let emit = std::mem::replace(&mut self.held, rest);
        StopOutcome {
            emit,
            stopped: false,
        }
    }

    /// Releases held text at the end of generation (no stop string completed).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string.
    fn partial_suffix_len(&self) -> usize {
        let held = &self.held;
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().saturating_sub(1).min(held.len());
            for len in (best + 1..=max).rev() {
                let start = held.len() - len;
                if held.is_char_boundary(start)
                    && stop.as_bytes().starts_with(&held.as_bytes()[start..])
                {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.emit);
            if o.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    /// (Was `generate.rs`'s test of its own matcher, whose job this one now does.)
    #[test]
    fn stop_strings_are_found_and_partial_ones_held_back() {
        let stops = ["</s>", "\n\n"];
        // The earliest stop string ends the text before it.
        assert_eq!(run(&stops, &["abc</s>def"]), ("abc".into(), true));
        assert_eq!(run(&stops, &["a\n\nb</s>"]), ("a".into(), true));
        assert_eq!(run(&stops, &["abc"]), ("abc".into(), false));
        // The longest tail that may start a stop string is held back.
        let held = |text: &str| {
            let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
            let mut m = StopMatcher::new(&stops);
            text.len() - m.push(text).emit.len()
        };
        assert_eq!(held("abc</"), 2);
        assert_eq!(held("abc\n"), 1);
        assert_eq!(held("abc"), 0);
    }

    #[test]
    fn stop_split_across_pieces_is_never_emitted() {
        assert_eq!(
            run(&["END"], &["ab", "cE", "N", "Dxy"]),
            ("abc".into(), true)
        );
    }

    #[test]
    fn partial_match_that_fails_is_released() {
        assert_eq!(run(&["END"], &["aE", "Nb", "c"]), ("aENbc".into(), false));
        assert_eq!(run(&["END"], &["aEN"]), ("aEN".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["zz", "b"], &["azzb"]), ("a".into(), true));
        assert_eq!(run(&["b", "zz"], &["abzz"]), ("a".into(), true));
    }

    #[test]
    fn held_text_is_withheld_until_decided() {
        let mut m = StopMatcher::new(&["\n\n".to_string()]);
        assert_eq!(m.push("hi\n").emit, "hi");
        let o = m.push("\nmore");
        assert_eq!((o.emit.as_str(), o.stopped), ("", true));
    }

    #[test]
    fn multibyte_text_is_split_on_char_boundaries() {
        assert_eq!(run(&["éx"], &["aé", "éy"]), ("aééy".into(), false));
        assert_eq!(run(&["éx"], &["aé", "x"]), ("a".into(), true));
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false));
    }
}
