//! Differential tests of the HIP attention kernels, run by the SIMT emulator (`Backend::Emu`;
//! a GPU with `HIPKV_TEST_BACKEND=hip`, see `common::kernel_backend`) on a cache the write kernels
//! filled, against the naive f64 reference over the same cache bytes:
//! every key × value format pair, head_dim 64/128/256, GQA 1–16, empty and partial pages, sinks,
//! outliers, RoPE before and after quantization, codebooks, integer-query scores, long contexts
//! with many splits and batches of sequences.

mod common;

use common::{
    assert_outputs_close, config, fill, kernel_backend, naive_attend, queries, with_rope,
};
use hipkv::scheme::KERNEL_FORMATS as FORMATS;
use hipkv::synth::Rng;
use hipkv::{CacheConfig, KvCache, RopeLayout};

/// The kernels compute what the reference computes up to summation order, the `log2(e)` folding
/// of the softmax and the per-group folding of scales and minimums: within 1e-5 of each output
/// row's largest element, as the CPU backend.
const TOLERANCE: f32 = 1e-5;

/// Fills one sequence per entry of `lens`, attends one decode token per sequence on the
/// emulator, and compares each output row with the reference.
fn check(cfg: CacheConfig, lens: &[usize], seed: u64) {
    check_windowed(cfg, lens, seed, None);
}

/// [`check`], the queries attending within a sliding `window`.
fn check_windowed(cfg: CacheConfig, lens: &[usize], seed: u64, window: Option<usize>) {
    let mut cfg = cfg;
    cfg.sequences = lens.len();
    let mut rng = Rng::new(seed);
    let mut cache = KvCache::new(cfg).unwrap();
    cache.set_sliding_window(0, window).unwrap();
    // The write kernels store the tokens (tests/append.rs checks their bytes), then the
    // attention kernels read them: the device path end to end.
    cache.set_backend(kernel_backend()).unwrap();
    for (s, &len) in lens.iter().enumerate() {
        fill(&mut cache, s, len, 13, &mut rng);
    }
    let width = cfg.q_heads * cfg.head_dim;
    let qs: Vec<Vec<f32>> = lens.iter().map(|_| rng.normals(width)).collect();
    let mut outs = vec![vec![0f32; width]; lens.len()];
    let mut queries = queries(&qs, &mut outs);
    let scale = 1.0 / (cfg.head_dim as f32).sqrt();
    cache.attend_many(0, &mut queries, scale).unwrap();
    for (s, (out, q)) in outs.iter().zip(&qs).enumerate() {
        let want = naive_attend(&cache, s, q, scale);
        let what = format!(
            "{} d={} gqa={} seq {s} len={} window {window:?}",
            cfg.scheme,
            cfg.head_dim,
            cfg.gqa(),
            lens[s]
        );
        assert_outputs_close(&cfg.scheme, out, &want, cfg.head_dim, TOLERANCE, &what);
    }
}

/// Every key × value pair of `formats`, with `options` appended to each scheme, on a partial
/// page, exactly one page and a page and a half.
fn check_every_pair<F: std::fmt::Display>(formats: &[F], options: &str, seed: usize) {
    for (i, k) in formats.iter().enumerate() {
        for (j, v) in formats.iter().enumerate() {
            let scheme = format!("k={k},v={v}{options}");
            check(
                config(&scheme, 2, 2, 64, 96),
                &[5, 32, 48],
                (seed + i * 7 + j) as u64,
            );
        }
    }
}

#[test]
fn every_format_pair() {
    check_every_pair(&FORMATS, "", 0);
}

#[test]
fn head_dims_and_gqa_ratios() {
    for d in [64, 128, 256] {
        for gqa in [1, 4, 8, 16] {
            for scheme in ["kivi2", "q8_0", "k=q4_tok,v=q8"] {
                check(config(scheme, 1, gqa, d, 80), &[70], (d + gqa) as u64);
            }
        }
    }
}

#[test]
fn options_sinks_groups_and_outliers() {
    for scheme in [
        "kivi2,sinks=4",
        "kivi2,g=64",
        "kivi4,g=64,sinks=3",
        "kivi2,outliers",
        "k=q2_chan,v=q2_tok,outliers=kv,outlier_slots=1",
        "q4_tok,outliers=kv,sinks=3",
        "k=q4_tok@head,v=q2_tok@64",
        "k=q4_tok@128,v=q4_tok@32",
        "k=f16,v=q8_0,sinks=40",
        "q4_tok,rot",
        "kivi2,rot=v,sinks=2",
        "k=q8,v=q2_chan,rv=64,rot=k",
    ] {
        check(config(scheme, 2, 2, 128, 200), &[3, 50, 130], 11);
    }
}

#[test]
fn rope_in_the_cache_and_pre_rope_keys() {
    for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
        for scheme in [
            "f16",
            "kivi2",
            "kivi2,pre_rope",
            "q8,pre_rope",
            "k=q4_tok,v=q4_tok,pre_rope,outliers",
            "kivi4,pre_rope,outliers,sinks=2",
            "kivi4,pre_rope,rot=v",
            "q2_tok,rot",
        ] {
            check(with_rope(config(scheme, 1, 3, 64, 200), layout), &[150], 5);
        }
    }
}

/// Codebooks (`fill` calibrates them) on every pair of low-bit formats, on one stream beside
/// another format, and with the options that share their decode: outlier corrections, pre-RoPE
/// keys, rotated values, sinks, value windows.
#[test]
fn codebooks_decode_in_every_loop() {
    check_every_pair(&["q4_tok", "q2_tok", "q4_chan", "q2_chan"], ",nuq", 100);
    for (scheme, d) in [
        ("k=q2_chan,v=q8,nuq=k", 128),
        ("k=f16,v=q4_tok@64,nuq=v", 256),
        ("kivi2,nuq,outliers=kv,sinks=2", 128),
        ("k=q4_tok,v=q2_chan,nuq,outliers=kv,outlier_slots=1", 64),
        ("kivi2,nuq,rv=32,rot=v", 256),
    ] {
        check(config(scheme, 2, 4, d, 200), &[3, 50, 130], 12);
    }
    for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
        for scheme in [
            "kivi2,pre_rope,nuq",
            "k=q4_tok,v=q2_tok,pre_rope,outliers,nuq=k",
            "k=q4_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v,nuq",
        ] {
            check(with_rope(config(scheme, 1, 3, 64, 200), layout), &[150], 6);
        }
    }
}

/// The frontier presets, at every head_dim, with sequences long enough for quantized values
/// before the value window (kv4: pre-RoPE keys, rotated values; kv3 and kv2 add codebooks).
#[test]
fn frontier_presets_at_every_head_dim() {
    for (i, name) in hipkv::scheme::FRONTIER_PRESETS.iter().enumerate() {
        for (j, d) in [64, 128, 256].into_iter().enumerate() {
            check(
                with_rope(config(name, 1, 4, d, 400), RopeLayout::Halves),
                &[330, 64],
                20 + 3 * i as u64 + j as u64,
            );
        }
    }
}

#[test]
fn long_contexts_use_many_splits() {
    check(config("kivi4", 2, 4, 64, 1100), &[1100, 700], 9);
    check(config("q8", 1, 1, 128, 700), &[683], 10);
    // Pre-RoPE keys deep in a context: each key turns by its row in its block and the query
    // back by the block's first position, which must agree with the key turned to its own
    // position within the bound at large angles too.
    for (layout, lens) in [
        (RopeLayout::Interleaved, [4100, 2999]),
        (RopeLayout::Halves, [3333, 4100]),
    ] {
        check(with_rope(config("kv4", 1, 4, 128, 4100), layout), &lens, 11);
    }
}

/// Within a sliding window the splits share out only the blocks the window reaches, starting
/// inside a block, past the sinks and into the value window and the open page.
#[test]
fn sliding_windows_over_many_splits() {
    for (scheme, window) in [("kivi4,sinks=4", 333), ("q8", 64), ("kivi2,rv=32", 1)] {
        check_windowed(
            config(scheme, 2, 8, 64, 1100),
            &[1100, 700, 300, 3],
            window as u64,
            Some(window),
        );
    }
    check_windowed(config("q4_tok", 1, 2, 256, 500), &[500], 3, Some(100));
}

#[test]
fn an_empty_split_and_sequences_of_one_token() {
    // Sequence lengths that leave trailing splits without pages, and one-token sequences.
    check(
        config("kivi2,sinks=2", 1, 4, 64, 300),
        &[1, 2, 3, 290, 129],
        4,
    );
}

/// The integer-query scores (`iq`): dot4 over the rounded query's codes in the kernels' order.
#[test]
fn integer_query_attends_with_the_rounded_query() {
    common::check_integer_query(kernel_backend());
}

#[test]
fn outlier_corrections_on_heavy_tailed_data() {
    common::check_heavy_tailed_outliers(kernel_backend());
}
