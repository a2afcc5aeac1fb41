//! Where attention runs. The CPU backend is the reference engine and the fallback everywhere.

pub(crate) mod cpu;
mod simd;
