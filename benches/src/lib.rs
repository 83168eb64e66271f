//! Criterion benchmarks of GdsLLM (in `benches/`): GB/s per layer for each I/O path and
//! tokens per second. This crate holds no library code of its own.
