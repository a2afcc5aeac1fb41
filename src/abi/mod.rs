//! The device ABI: the params structs of `hip/include/hipkv_abi.h`, passed by value to every
//! kernel launch (on a GPU, and in the emulator through the same bytes).
//!
//! `generated.rs` is written by bindgen (`scripts/regen-abi.sh`) and committed, so users need no
//! libclang; its layout assertions check every size and offset at compile time, and
//! `tests/abi.rs` fails when it no longer matches the header.

#[allow(non_camel_case_types, non_upper_case_globals, dead_code)]
mod generated;

pub use generated::*;

/// `HIPKV_ROWS(head_dim)` (a function-like macro bindgen does not translate): query rows one
/// attention wave computes. `tests/formats_agree.rs` checks it against the header.
pub const fn hipkv_rows(_head_dim: u32) -> u32 {
    4
}

/// `HIPKV_VALUE_TOKENS(head_dim)`: tokens one trip of an attention wave's value loop
/// accumulates (a lane takes at least 4 channels of a token). `tests/formats_agree.rs` checks it
/// against the header.
pub const fn hipkv_value_tokens(head_dim: u32) -> u32 {
    let lanes = HIPKV_WAVE * 4;
    if head_dim < lanes {
        lanes / head_dim
    } else {
        1
    }
}
