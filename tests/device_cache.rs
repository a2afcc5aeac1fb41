//! The device-resident cache end to end. `Backend::Emu` is the HIP backend's code path with host
//! memory for device memory and the SIMT emulator for launches, so these tests exercise on every
//! machine what a GPU runs: allocation, uploads of tokens and block tables, append and attention
//! kernels, downloads, moves between backends, errors that leave the cache as it was, and free.
//! Where a GPU is usable the same tests run on `Backend::Hip` too.

mod common;

use common::{assert_rows_close, attend_as_reference, config, queries, with_rope};
use hipkv::backend::HipStatus;
use hipkv::synth::Rng;
use hipkv::{Backend, CacheConfig, Error, KvCache, Query, RopeLayout};

/// The device backends this machine can run.
fn device_backends() -> Vec<Backend> {
    let mut backends = vec![Backend::Emu];
    if HipStatus::probe().obstacle().is_none() {
        backends.push(Backend::Hip);
    }
    backends
}

fn tokens(cfg: &CacheConfig, n: usize, rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    let k = hipkv::synth::keys_with_outlier_channels(rng, n, cfg.kv_heads, cfg.head_dim, 2, 6.0);
    (k, rng.normals(n * cfg.kv_heads * cfg.head_dim))
}

/// Two layers, three sequences: a device cache allocated as such and a CPU cache get the same
/// appends (chunks that open, fill and cross pages); after each, every stored byte agrees, and
/// decode attention over all sequences at once agrees within the kernels' tolerance.
#[test]
fn a_device_cache_stores_and_attends_as_the_cpu_cache() {
    for backend in device_backends() {
        for scheme in ["q8", "kivi2,sinks=4,outliers", "k=q4_tok,v=q8_0,pre_rope"] {
            let mut cfg = with_rope(config(scheme, 2, 4, 64, 160), RopeLayout::Interleaved);
            cfg.layers = 2;
            cfg.sequences = 3;
            let mut rng = Rng::new(5);
            let mut cpu = KvCache::new(cfg).unwrap();
            let mut dev = KvCache::with_backend(cfg, backend).unwrap();
            assert_eq!(dev.backend(), backend);
            assert_eq!(dev.allocated_bytes(), cpu.allocated_bytes(), "{scheme}");
            if cfg.scheme.outliers.is_some() {
                let (k, v) = tokens(&cfg, 150, &mut rng);
                for layer in 0..2 {
                    cpu.calibrate_outliers(layer, &k, &v, 0).unwrap();
                    dev.calibrate_outliers(layer, &k, &v, 0).unwrap();
                }
            }
            for (step, n) in [1, 40, 3, 70, 33].into_iter().enumerate() {
                for layer in 0..2 {
                    for seq in 0..3 {
                        let (k, v) = tokens(&cfg, n, &mut rng);
                        cpu.append(layer, seq, &k, &v).unwrap();
                        dev.append(layer, seq, &k, &v).unwrap();
                        assert_eq!(
                            dev.stored_bytes(layer, seq).unwrap(),
                            cpu.stored_bytes(layer, seq).unwrap(),
                            "{backend:?} {scheme} step {step} layer {layer} seq {seq}"
                        );
                    }
                }
                assert_eq!(dev.outliers_dropped(), cpu.outliers_dropped());
                let qs: Vec<Vec<f32>> = (0..3)
                    .map(|_| rng.normals(cfg.q_heads * cfg.head_dim))
                    .collect();
                let mut outs = vec![vec![0f32; cfg.q_heads * cfg.head_dim]; 3];
                let mut queries = queries(&qs, &mut outs);
                dev.attend_many(1, &mut queries, 0.125).unwrap();
                for (seq, (out, q)) in outs.iter().zip(&qs).enumerate() {
                    let mut want = vec![0f32; q.len()];
                    cpu.attend(1, seq, q, 0.125, &mut want).unwrap();
                    let what = format!("{backend:?} {scheme} step {step} seq {seq}");
                    assert_rows_close(out, &want, cfg.head_dim, 1e-5, &what);
                }
            }
        }
    }
}

/// A CPU cache moved to a device and back keeps every byte, and tokens appended on the device
/// are the bytes the CPU would have stored.
#[test]
fn moving_a_cache_between_backends_keeps_every_byte() {
    for backend in device_backends() {
        let cfg = with_rope(config("kivi4,sinks=3", 2, 2, 128, 300), RopeLayout::Halves);
        let mut rng = Rng::new(9);
        let (k, v) = tokens(&cfg, 300, &mut rng);
        let width = cfg.kv_heads * cfg.head_dim;
        let mut reference = KvCache::new(cfg).unwrap();
        reference.append(0, 0, &k, &v).unwrap();

        let mut moved = KvCache::new(cfg).unwrap();
        moved
            .append(0, 0, &k[..100 * width], &v[..100 * width])
            .unwrap();
        let before = moved.stored_bytes(0, 0).unwrap();
        moved.set_backend(backend).unwrap();
        assert_eq!(moved.backend(), backend);
        assert_eq!(moved.stored_bytes(0, 0).unwrap(), before);
        moved
            .append(0, 0, &k[100 * width..], &v[100 * width..])
            .unwrap();
        moved.set_backend(Backend::Cpu).unwrap();
        assert_eq!(moved.backend(), Backend::Cpu);
        assert_eq!(
            moved.stored_bytes(0, 0).unwrap(),
            reference.stored_bytes(0, 0).unwrap(),
            "{backend:?}"
        );
        let q = rng.normals(cfg.q_heads * cfg.head_dim);
        let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        moved.attend(0, 0, &q, 0.1, &mut a).unwrap();
        reference.attend(0, 0, &q, 0.1, &mut b).unwrap();
        assert_eq!(a, b, "{backend:?}: the same bytes on the same backend");
    }
}

/// Bad input on a device cache is a typed error and the cache is left exactly as it was: a
/// full cache, NaN, wrong shapes, uncalibrated outliers, chunked queries (decode only).
#[test]
fn device_errors_leave_the_cache_as_it_was() {
    for backend in device_backends() {
        let cfg = config("kivi2", 2, 4, 64, 70);
        let width = cfg.kv_heads * cfg.head_dim;
        let mut rng = Rng::new(3);
        let mut cache = KvCache::with_backend(cfg, backend).unwrap();
        let (k, v) = tokens(&cfg, 70, &mut rng);
        cache
            .append(0, 0, &k[..50 * width], &v[..50 * width])
            .unwrap();
        let before = cache.stored_bytes(0, 0).unwrap();
        let unchanged = |cache: &KvCache, what: &str| {
            assert_eq!(cache.len(0, 0).unwrap(), 50, "{backend:?} {what}");
            assert_eq!(
                cache.stored_bytes(0, 0).unwrap(),
                before,
                "{backend:?} {what}"
            );
        };

        let err = cache
            .append(0, 0, &k[..21 * width], &v[..21 * width])
            .unwrap_err();
        assert!(matches!(err, Error::CacheFull { len: 50, .. }), "{err}");
        unchanged(&cache, "full");

        let mut bad = k[..2 * width].to_vec();
        bad[width + 5] = f32::NAN;
        let err = cache.append(0, 0, &bad, &v[..2 * width]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NonFinite {
                    token: 1,
                    channel: 5,
                    ..
                }
            ),
            "{err}"
        );
        unchanged(&cache, "NaN");

        let err = cache
            .append(0, 0, &k[..width], &v[..2 * width])
            .unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
        unchanged(&cache, "shape");

        // A query chunk (prefill) attends causally on every backend.
        let q = rng.normals(2 * cfg.q_heads * cfg.head_dim);
        attend_as_reference(&cache, &q, 0.1, &format!("{backend:?} chunk"));
        unchanged(&cache, "chunked query");

        let mut outliers =
            KvCache::with_backend(config("kivi2,outliers", 2, 4, 64, 70), backend).unwrap();
        let err = outliers.append(0, 0, &k[..width], &v[..width]).unwrap_err();
        assert!(
            matches!(err, Error::OutliersNotCalibrated { layer: 0 }),
            "{err}"
        );
        assert_eq!(outliers.len(0, 0).unwrap(), 0);

        // The last 20 tokens still fit, and a cleared sequence takes new ones.
        cache
            .append(0, 0, &k[50 * width..], &v[50 * width..])
            .unwrap();
        assert_eq!(cache.len(0, 0).unwrap(), 70);
        cache.clear(0).unwrap();
        cache
            .append(0, 0, &k[..10 * width], &v[..10 * width])
            .unwrap();
        let q = rng.normals(cfg.q_heads * cfg.head_dim);
        attend_as_reference(&cache, &q, 0.1, &format!("{backend:?} after clear"));
    }
}

/// The bench's timing call: a device reports the time of its kernels, the CPU reports none (the
/// call is the work), and both compute the same attention.
#[test]
fn timed_attention_reports_device_time_only() {
    let cfg = config("q4_tok", 2, 2, 64, 64);
    let mut rng = Rng::new(4);
    let (k, v) = tokens(&cfg, 64, &mut rng);
    let q = rng.normals(cfg.q_heads * cfg.head_dim);
    let mut outs = Vec::new();
    for backend in [Backend::Cpu].into_iter().chain(device_backends()) {
        let mut cache = KvCache::with_backend(cfg, backend).unwrap();
        cache.append(0, 0, &k, &v).unwrap();
        let mut out = vec![0f32; q.len()];
        let mut queries = [Query {
            seq: 0,
            q: &q,
            out: &mut out,
        }];
        let seconds = cache.attend_many_timed(0, &mut queries, 0.1).unwrap();
        match backend {
            Backend::Cpu => assert_eq!(seconds, None),
            _ => assert!(seconds.is_some_and(|s| s > 0.0), "{backend:?}: {seconds:?}"),
        }
        outs.push(out);
    }
    for out in &outs[1..] {
        assert_rows_close(out, &outs[0], 64, 1e-5, "timed attention");
    }
}

/// A cache larger than memory is `OutOfMemory` on every backend, not an abort; one larger than
/// the address space is refused before any arithmetic can wrap.
#[test]
fn a_cache_too_large_is_out_of_memory_not_an_abort() {
    // 2^15 sequences × 2^20 tokens × 64 KV heads × 1024 bytes: 2 PiB of f16 (in 2^30 blocks,
    // which i32 block ids still address).
    let mut huge = config("f16", 64, 1, 256, 1 << 20);
    huge.sequences = 1 << 15;
    let want = (1u128 << 35) * 64 * 1024;
    for backend in [Backend::Cpu].into_iter().chain(device_backends()) {
        match KvCache::with_backend(huge, backend) {
            Err(Error::OutOfMemory { bytes, .. }) => assert!(bytes >= want / 2, "{bytes}"),
            Err(Error::Hip(e)) if backend == Backend::Hip => {
                assert_eq!(e.name, "hipErrorOutOfMemory", "{e}")
            }
            other => panic!("{backend:?}: expected OutOfMemory, got {other:?}"),
        }
    }
    let mut absurd = huge;
    absurd.layers = usize::MAX / 2;
    let err = KvCache::new(absurd).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { backend: "any", .. }),
        "{err}"
    );
}

/// More sinks than tokens: every token is a sink, and every head's sink rows have their place
/// (the rows are laid out per head, so an unclamped count would put the second head's beyond
/// its buffer).
#[test]
fn more_sinks_than_capacity_keeps_every_head() {
    for backend in [Backend::Cpu].into_iter().chain(device_backends()) {
        let cfg = config("kivi4,sinks=40", 3, 2, 64, 24);
        let mut rng = Rng::new(8);
        let mut cache = KvCache::with_backend(cfg, backend).unwrap();
        assert_eq!(cache.config().scheme.sinks, 24);
        let (k, v) = tokens(&cfg, 24, &mut rng);
        cache.append(0, 0, &k, &v).unwrap();
        let (back_k, _) = cache.read_back(0, 0).unwrap();
        let f16 = |x: &[f32]| -> Vec<f32> {
            x.iter().map(|&e| half::f16::from_f32(e).to_f32()).collect()
        };
        assert_eq!(
            back_k,
            f16(&k),
            "{backend:?}: sinks are stored exactly in f16"
        );
        let q = rng.normals(cfg.q_heads * cfg.head_dim);
        attend_as_reference(&cache, &q, 0.125, &format!("{backend:?} all sinks"));
    }
}
