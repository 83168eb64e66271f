//! `gdsllm`: run, chat, convert, verify, synth, pull, plan, bench, doctor and serve.

fn main() {}
