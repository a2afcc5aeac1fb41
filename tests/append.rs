//! Differential tests of the write kernels (`hip/write.hip`), run by the SIMT emulator: a
//! cache on `Backend::Emu` must store exactly the bytes the CPU reference stores, for every
//! format, head_dim, channel group and page size, with sinks, outliers (overflowing their slots
//! too), RoPE before and after quantization, codebooks, and appends that start, fill and cross
//! pages.

mod common;

use common::{config, with_rope};
use hipkv::scheme::KERNEL_FORMATS as FORMATS;
use hipkv::synth::Rng;
use hipkv::{Backend, CacheConfig, KvCache, RopeLayout, StreamSet};

/// Chunk sizes of the appends: single tokens, a chunk ending a page, one filling two pages at
/// once and leaving a third open, and so on; 200 tokens in all.
const CHUNKS: [usize; 8] = [1, 5, 26, 3, 97, 1, 60, 7];

/// Keys with outlier channels and values, `len × kv_heads × head_dim`, with a zero token, a
/// constant token and a token of signed zeros and tiny values (whose f16 is ±0) mixed in.
fn tokens(cfg: &CacheConfig, len: usize, rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    let width = cfg.kv_heads * cfg.head_dim;
    let mut k =
        hipkv::synth::keys_with_outlier_channels(rng, len, cfg.kv_heads, cfg.head_dim, 2, 6.0);
    let mut v = rng.normals(len * width);
    for x in [&mut k, &mut v] {
        x[2 * width..3 * width].fill(0.0);
        x[9 * width..10 * width].fill(1.5);
        for (i, e) in x[40 * width..41 * width].iter_mut().enumerate() {
            *e = match i % 3 {
                0 => -0.0,
                1 => -1e-9,
                _ => 1e-9,
            };
        }
    }
    (k, v)
}

/// Appends the same tokens to a CPU cache and an emulated one, chunk by chunk and alternating
/// between two sequences, and compares everything stored after every append.
fn check(cfg: CacheConfig, outlier_sample_scale: Option<f32>, seed: u64) {
    let mut cfg = cfg;
    cfg.sequences = 2;
    let total: usize = CHUNKS.iter().sum();
    cfg.capacity = total;
    let width = cfg.kv_heads * cfg.head_dim;
    let mut rng = Rng::new(seed);
    let data = [tokens(&cfg, total, &mut rng), tokens(&cfg, total, &mut rng)];
    let mut cpu = KvCache::new(cfg).unwrap();
    let mut emu = KvCache::new(cfg).unwrap();
    emu.set_backend(Backend::Emu).unwrap();
    if let Some(scale) = outlier_sample_scale {
        // Thresholds from shrunken samples put many elements outside them: the slots overflow.
        let (k, v) = &data[0];
        let shrink =
            |x: &[f32]| -> Vec<f32> { x[..64 * width].iter().map(|e| e * scale).collect() };
        for cache in [&mut cpu, &mut emu] {
            cache
                .calibrate_outliers(0, &shrink(k), &shrink(v), 0)
                .unwrap();
        }
    }
    if cfg.scheme.nuq != StreamSet::None {
        // Codebooks fitted to the first sequence's first 64 tokens, as a server would.
        let (k, v) = &data[0];
        for cache in [&mut cpu, &mut emu] {
            cache
                .calibrate_codebooks(0, &k[..64 * width], &v[..64 * width], 0)
                .unwrap();
        }
    }
    let mut start = 0;
    for &n in &CHUNKS {
        for (seq, (k, v)) in data.iter().enumerate() {
            let at = start * width..(start + n) * width;
            for cache in [&mut cpu, &mut emu] {
                cache
                    .append(0, seq, &k[at.clone()], &v[at.clone()])
                    .unwrap();
            }
            let what = format!(
                "{} d={} heads={} seq {seq}, {} tokens",
                cfg.scheme,
                cfg.head_dim,
                cfg.kv_heads,
                start + n
            );
            assert_eq!(emu.len(0, seq).unwrap(), start + n, "{what}");
            let (want, got) = (
                cpu.stored_bytes(0, seq).unwrap(),
                emu.stored_bytes(0, seq).unwrap(),
            );
            assert_eq!(want.len(), got.len(), "{what}: stored bytes");
            if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) {
                panic!(
                    "{what}: byte {i} of {} differs: reference {:#04x}, kernel {:#04x}",
                    want.len(),
                    want[i],
                    got[i]
                );
            }
            assert_eq!(
                emu.outliers_dropped(),
                cpu.outliers_dropped(),
                "{what}: dropped"
            );
        }
        start += n;
    }
    if outlier_sample_scale.is_some_and(|s| s < 1.0) {
        assert!(
            cpu.outliers_dropped() > 0,
            "{}: slots never overflowed",
            cfg.scheme
        );
    }
}

#[test]
fn every_format_and_head_dim() {
    for (i, f) in FORMATS.iter().enumerate() {
        for d in [64, 128, 256] {
            check(
                config(&format!("k={f},v={f}"), 2, 1, d, 0),
                None,
                10 + i as u64,
            );
        }
    }
}

#[test]
fn channel_groups_page_sizes_and_sinks() {
    for (scheme, d) in [
        ("k=q4_tok@64,v=q2_tok@head", 128),
        ("k=q2_tok@128,v=q4_tok@64,g=64", 256),
        ("k=q2_tok@head,v=q4_tok@head", 64),
        ("kivi2,g=64,sinks=3", 128),
        ("kivi4,sinks=40", 64),
        ("k=q2_chan,v=q8_0,g=64,sinks=1", 256),
        ("k=q8,v=q4_chan,sinks=5", 128),
    ] {
        check(config(scheme, 3, 1, d, 0), None, 20);
    }
}

#[test]
fn outliers_in_the_sparse_store() {
    for (scheme, d, sample_scale) in [
        ("kivi2,outliers", 128, 1.0),
        ("kivi4,outliers=kv,outlier_slots=2", 64, 0.5),
        ("k=q2_tok,v=q8,outliers=kv,outlier_slots=1", 128, 0.3),
        ("k=q8_0,v=q4_tok@64,outliers", 256, 0.4),
        (
            "k=q4_chan,v=f16,g=64,sinks=2,outliers=kv,outlier_slots=3",
            256,
            0.2,
        ),
        ("k=f16,v=q2_chan,outliers=kv,outlier_frac=0.05", 64, 1.0),
    ] {
        check(config(scheme, 2, 1, d, 0), Some(sample_scale), 30);
    }
}

#[test]
fn rope_before_and_after_quantization() {
    for (scheme, layout) in [
        ("kivi2", RopeLayout::Interleaved),
        ("kivi4,pre_rope", RopeLayout::Interleaved),
        ("k=q2_chan,v=q2_tok,pre_rope,outliers", RopeLayout::Halves),
        ("q8_0", RopeLayout::Halves),
    ] {
        let cfg = with_rope(config(scheme, 2, 1, 128, 0), layout);
        check(cfg, scheme.contains("outliers").then_some(0.7), 40);
    }
}

#[test]
fn rotated_rows_are_stored_bit_for_bit() {
    // Every format rotated at every head_dim, with sinks, value windows and per-channel keys.
    for (i, f) in FORMATS.iter().enumerate() {
        for d in [64, 128, 256] {
            check(
                config(&format!("k={f},v={f},rot"), 2, 1, d, 0),
                None,
                50 + i as u64,
            );
        }
    }
    for (scheme, d) in [
        ("kivi2,g=64,sinks=3,rot=v", 128),
        ("k=q4_tok@64,v=q2_tok@head,sinks=2,rv=32,rot=k", 64),
        ("kivi4,rot", 256),
    ] {
        check(config(scheme, 3, 1, d, 0), None, 60);
    }
}

#[test]
fn codebooks_select_codes_as_the_reference() {
    for (scheme, d, sample_scale) in [
        ("q4_tok,nuq", 64, None),
        ("k=q2_tok@64,v=q2_tok@head,nuq", 128, None),
        ("kivi2,nuq,g=64,sinks=3", 256, None),
        ("kivi4,nuq=k", 128, None),
        ("k=q8,v=q2_chan,nuq=v", 64, None),
        ("kivi2,nuq,outliers=kv,outlier_slots=1", 128, Some(0.5)),
        ("k=f16,v=q2_tok@64,rv=32,rot=v,nuq=v", 128, None),
    ] {
        check(config(scheme, 2, 1, d, 0), sample_scale, 70);
    }
    // The 56-byte frontier point: pre-RoPE per-channel keys, rotated 2-bit values, codebooks.
    let frontier = "k=q4_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v,nuq";
    check(
        with_rope(config(frontier, 2, 1, 64, 0), RopeLayout::Halves),
        None,
        71,
    );
}
