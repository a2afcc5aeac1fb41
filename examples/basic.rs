//! Store a 1000-token prompt's keys and values in a few schemes, attend with one decode query,
//! and compare each scheme's memory and output with the f16 cache's, on the best backend this
//! machine has: the GPU when one is usable, else the CPU (`HIPKV_BACKEND=cpu|emu|hip` forces
//! one).
//!
//! `cargo run --release --example basic`

use hipkv::synth::{Rng, keys_with_outlier_channels};
use hipkv::{Backend, CacheConfig, KvCache, Scheme};

const KV_HEADS: usize = 4;
const Q_HEADS: usize = 16;
const HEAD_DIM: usize = 128;
const TOKENS: usize = 1000;

/// Attention output for query `q` over a cache holding `k`, `v`, and the bytes it allocated.
fn attend(
    backend: Backend,
    scheme: Scheme,
    k: &[f32],
    v: &[f32],
    q: &[f32],
) -> hipkv::Result<(Vec<f32>, usize)> {
    let config = CacheConfig {
        layers: 1,
        sequences: 1,
        kv_heads: KV_HEADS,
        q_heads: Q_HEADS,
        head_dim: HEAD_DIM,
        capacity: TOKENS,
        scheme,
        rope: None,
    };
    let mut cache = KvCache::with_backend(config, backend)?;
    // Outlier thresholds and codebooks (schemes with `outliers`, `nuq`) come from sample
    // tokens; here the prompt itself.
    cache.calibrate(0, k, v, 0)?;
    cache.append(0, 0, k, v)?;
    let mut out = vec![0f32; q.len()];
    cache.attend(0, 0, q, 1.0 / (HEAD_DIM as f32).sqrt(), &mut out)?;
    Ok((out, cache.allocated_bytes()))
}

fn rms(x: impl Iterator<Item = f32>) -> f32 {
    let (sum, n) = x.fold((0.0, 0), |(s, n), x| (s + x * x, n + 1));
    (sum / n as f32).sqrt()
}

fn main() -> hipkv::Result<()> {
    let mut rng = Rng::new(42);
    let k = keys_with_outlier_channels(&mut rng, TOKENS, KV_HEADS, HEAD_DIM, 2, 6.0);
    let v = rng.normals(TOKENS * KV_HEADS * HEAD_DIM);
    let q = rng.normals(Q_HEADS * HEAD_DIM);

    let (backend, not_gpu) = Backend::from_env()?;
    let (want, f16_bytes) = attend(backend, "f16".parse()?, &k, &v, &q)?;
    println!(
        "{TOKENS} tokens, {KV_HEADS} KV heads, {Q_HEADS} query heads, head_dim {HEAD_DIM}: \
         one decode step on the {} backend",
        backend.name()
    );
    if let Some(why) = not_gpu {
        println!("(not on a GPU: {why})");
    }
    println!(
        "{:<16} {:>10} {:>8}  output error vs f16 (relative RMS)",
        "scheme", "KiB", "vs f16"
    );
    for name in [
        "f16",
        "q8",
        "q4_tok",
        "kivi4",
        "q2_tok",
        "kivi2",
        "kivi2,outliers",
    ] {
        let (got, bytes) = attend(backend, name.parse()?, &k, &v, &q)?;
        let err = rms(got.iter().zip(&want).map(|(g, w)| g - w)) / rms(want.iter().copied());
        println!(
            "{name:<16} {:>10.1} {:>7.2}×  {:.2}%",
            bytes as f64 / 1024.0,
            f16_bytes as f64 / bytes as f64,
            100.0 * err
        );
    }
    Ok(())
}
