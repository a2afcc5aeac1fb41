//! CPU decode attention against the naive reference, for every scheme and shape.

mod common;

use common::{attend_as_reference, config, fill, naive_attend, queries, rel_err, with_rope};
use hipkv::scheme::PRESETS;
use hipkv::synth::Rng;
use hipkv::{KvCache, RopeLayout};

/// Attention equals the naive f64 reference over the dequantized cache within 1e-5 of each
/// output row's largest element: the math is identical up to summation order and the
/// `log2(e)` folding of the softmax.
const TOLERANCE: f32 = 1e-5;

fn check(cfg: hipkv::CacheConfig, len: usize, chunk: usize, q_len: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut cache = KvCache::new(cfg).unwrap();
    fill(&mut cache, 0, len, chunk, &mut rng);
    let q = rng.normals(q_len * cfg.q_heads * cfg.head_dim);
    let scale = 1.0 / (cfg.head_dim as f32).sqrt();
    let what = format!(
        "{} d={} gqa={} len={len} q_len={q_len}",
        cfg.scheme,
        cfg.head_dim,
        cfg.gqa()
    );
    attend_as_reference(&cache, &q, scale, &what);
}

#[test]
fn every_preset_matches_the_reference() {
    for (i, scheme) in PRESETS.iter().enumerate() {
        for (len, q_len) in [(1, 1), (31, 1), (32, 1), (77, 3), (300, 1)] {
            check(config(scheme, 2, 4, 64, 320), len, 7, q_len, i as u64);
        }
    }
}

#[test]
fn head_dims_and_gqa_ratios() {
    for d in [64, 128, 256] {
        for gqa in [1, 4, 8, 16] {
            check(
                config("kivi4", 1, gqa, d, 128),
                70,
                16,
                2,
                d as u64 + gqa as u64,
            );
            check(config("q8_0", 2, gqa, d, 128), 45, 45, 1, 3);
        }
    }
}

#[test]
fn options_sinks_groups_outliers_and_rope() {
    for scheme in [
        "kivi2,sinks=4",
        "kivi2,g=64",
        "kivi2,outliers",
        "k=q2_chan,v=q2_tok,outliers=kv,outlier_slots=1",
        "q4_tok,outliers=kv,sinks=3",
        "k=q4_tok@head,v=q2_tok@64",
        "k=q8,v=q2_chan",
        "k=f16,v=q8_0,sinks=40",
    ] {
        for (len, q_len) in [(3, 1), (50, 5), (200, 1)] {
            check(config(scheme, 2, 2, 128, 256), len, 9, q_len, 11);
        }
    }
    for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
        for scheme in [
            "f16",
            "kivi2",
            "kivi2,pre_rope",
            "kivi4,pre_rope",
            "k=q4_tok,v=q4_tok,pre_rope",
            "kivi4,pre_rope,outliers,sinks=2",
            "q8,pre_rope",
            "kv3",
            "kv2",
        ] {
            check(
                with_rope(config(scheme, 1, 3, 64, 200), layout),
                150,
                20,
                4,
                5,
            );
        }
        // Pre-RoPE keys at the other head_dims' unrolled loops, 4- and 2-bit ones rotated as
        // they are decoded.
        for d in [128, 256] {
            for scheme in ["kv4", "kv2"] {
                check(
                    with_rope(config(scheme, 1, 4, d, 200), layout),
                    150,
                    20,
                    2,
                    6,
                );
            }
        }
    }
}

#[test]
fn long_context_uses_many_splits() {
    check(config("kivi4", 2, 4, 64, 4096), 4000, 512, 1, 9);
    check(config("q8", 1, 1, 128, 2100), 2083, 1000, 2, 10);
    // Pre-RoPE keys far from position 0: each block's query rows are turned back by a far row
    // of the RoPE table, and its keys turned by the table's first rows.
    for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
        check(
            with_rope(config("kv4", 1, 4, 128, 4096), layout),
            4000,
            512,
            1,
            14,
        );
        check(
            with_rope(config("kv2", 2, 4, 64, 4096), layout),
            4000,
            512,
            2,
            15,
        );
    }
}

/// A step small enough to run on the caller's thread and one large enough to go to the pool,
/// inside a pool of three threads whatever the machine has: both match the reference.
#[test]
fn short_steps_on_the_caller_and_long_ones_on_the_pool() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| {
        for scheme in ["kivi2", "q8", "k=q4_chan,v=q4_tok,rv=32"] {
            check(config(scheme, 2, 4, 64, 4096), 70, 16, 1, 12);
            check(config(scheme, 2, 4, 64, 4096), 4000, 512, 1, 13);
        }
    });
}

/// Several sequences of different lengths in one batched call, each equal to its own reference.
#[test]
fn batched_sequences_of_different_lengths() {
    let mut cfg = config("kivi2,sinks=2", 2, 4, 64, 300);
    cfg.sequences = 3;
    let mut cache = KvCache::new(cfg).unwrap();
    let mut rng = Rng::new(4);
    let lens = [5, 290, 64];
    for (s, &len) in lens.iter().enumerate() {
        fill(&mut cache, s, len, 13, &mut rng);
    }
    let width = cfg.q_heads * cfg.head_dim;
    let qs: Vec<Vec<f32>> = lens.iter().map(|_| rng.normals(width)).collect();
    let mut outs = vec![vec![0f32; width]; 3];
    let mut queries = queries(&qs, &mut outs);
    cache.attend_many(0, &mut queries, 0.125).unwrap();
    for (s, (out, q)) in outs.iter().zip(&qs).enumerate() {
        assert!(
            rel_err(out, &naive_attend(&cache, s, q, 0.125)) <= TOLERANCE,
            "seq {s}"
        );
    }
}

#[test]
fn outlier_corrections_on_heavy_tailed_data() {
    common::check_heavy_tailed_outliers(hipkv::Backend::Cpu);
}

/// `iq` computes the attention of the rounded query exactly (see the helper).
#[test]
fn integer_query_attends_with_the_rounded_query() {
    common::check_integer_query(hipkv::Backend::Cpu);
}

#[test]
fn integer_query_is_refused_where_it_does_not_apply() {
    for scheme in [
        "f16,iq",
        "fp8,iq",
        "kivi4,iq,pre_rope",
        "q4_tok,iq,nuq=k",
        "q8,iq,pre_rope",
    ] {
        let mut cfg = config(scheme, 1, 2, 64, 64);
        if scheme.contains("pre_rope") {
            cfg = with_rope(cfg, RopeLayout::Halves);
        }
        let Err(err) = KvCache::new(cfg) else {
            panic!("{scheme}: accepted");
        };
        assert!(
            matches!(err, hipkv::Error::Unsupported(ref m) if m.contains("iq")),
            "{scheme}: {err}"
        );
    }
}
