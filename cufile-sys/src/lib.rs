//! Raw bindings to NVIDIA's cuFile library (`libcufile.so`), loaded at run time.
//!
//! This crate is for: the bindgen output for `cufile.h`, checked in, and a loader that opens
//! the library with `libloading` so that everything builds and runs where CUDA is absent.
//!
//! It is not for: safety, ownership or policy. Callers should use `gds-io`, which wraps these
//! functions in owning types.
