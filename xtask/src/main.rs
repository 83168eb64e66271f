//! `cargo xtask`: developer tasks (convert, fetch, bindgen, ci).

fn main() {}
