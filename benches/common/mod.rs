//! Shape and cache construction shared by the criterion benchmarks.

use hipkv::{CacheConfig, KvCache, Rope, RopeLayout, Scheme};

pub const KV_HEADS: usize = 8;
pub const GQA: usize = 4;
pub const HEAD_DIM: usize = 128;

/// Every preset, then the options that change what attention reads or how it decodes.
pub fn schemes() -> Vec<Scheme> {
    hipkv::scheme::PRESETS
        .iter()
        .copied()
        .chain(["kivi2,outliers", "kivi2,pre_rope", "kivi2,nuq"])
        .chain(["q8,iq", "q8_0,iq", "q4_tok,iq", "q2_tok,iq"])
        .map(|s| s.parse().expect("known scheme"))
        .collect()
}

/// A one-layer, one-sequence cache with RoPE (as `hipkv bench` builds), calibrated from `pool`
/// when the scheme stores outliers.
pub fn cache(scheme: Scheme, capacity: usize, pool: &hipkv::synth::TokenPool) -> KvCache {
    caches(scheme, capacity, 1, pool)
}

/// As [`cache`], with `sequences` sequences.
pub fn caches(
    scheme: Scheme,
    capacity: usize,
    sequences: usize,
    pool: &hipkv::synth::TokenPool,
) -> KvCache {
    let mut cache = KvCache::new(CacheConfig {
        layers: 1,
        sequences,
        kv_heads: KV_HEADS,
        q_heads: KV_HEADS * GQA,
        head_dim: HEAD_DIM,
        capacity,
        scheme,
        rope: Some(Rope {
            base: 10000.0,
            layout: RopeLayout::Interleaved,
        }),
    })
    .expect("valid bench configuration");
    let (k, v) = pool.first(capacity);
    cache.calibrate(0, k, v, 0).expect("calibration");
    cache
}
