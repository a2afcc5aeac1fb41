//! The device ABI: Rust mirrors of the params structs in `hip/include/hipkv_abi.h`, passed by
//! value to every kernel launch (on a GPU, and in the emulator through the same bytes).
//! `tests/abi.rs` checks every size and field offset against the C header as compiled.

#![allow(non_camel_case_types)]

/// `hipkv_stream_layout`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct hipkv_stream_layout {
    pub rows: u32,
    pub row_bytes: u32,
    pub params: u32,
    pub counts: u32,
    pub slots: u32,
    pub outlier_slots: u32,
    pub group: u32,
    pub residual: u32,
}

/// `hipkv_attn_params`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct hipkv_attn_params {
    pub pool: *const u8,
    pub page_bytes: u64,
    pub head_block_bytes: u32,
    pub kv_heads: u32,
    pub gqa: u32,
    pub head_dim: u32,
    pub group_tokens: u32,
    pub sinks: u32,
    pub splits: u32,
    pub pages_per_split: u32,
    pub pre_rope: u32,
    pub rope_pairs_interleaved: u32,
    pub k: hipkv_stream_layout,
    pub v: hipkv_stream_layout,
    pub seq_len: *const u32,
    pub block_table: *const *const u32,
    pub sinks_k: *const *const u16,
    pub sinks_v: *const *const u16,
    pub residual_k: *const *const u16,
    pub residual_v: *const *const u16,
    pub q: *const f32,
    pub q_group_sums: *const f32,
    pub rope_cos_sin: *const f32,
    pub partial_acc: *mut f32,
    pub partial_max: *mut f32,
    pub partial_sum: *mut f32,
}

/// `hipkv_combine_params`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct hipkv_combine_params {
    pub partial_acc: *const f32,
    pub partial_max: *const f32,
    pub partial_sum: *const f32,
    pub out: *mut f32,
    pub rows: u32,
    pub gqa: u32,
    pub splits: u32,
    pub head_dim: u32,
}

/// `HIPKV_MAX_GQA`: query heads per KV head the attention kernels handle.
pub const HIPKV_MAX_GQA: u32 = 16;
/// `HIPKV_THREADS`: work-items per workgroup (one wave32).
pub const HIPKV_THREADS: u32 = 32;
