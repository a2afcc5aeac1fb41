//! Decode attention per scheme: one query token over 4096 cached tokens, 8 KV heads × GQA 4 ×
//! head_dim 128. One sequence of at most 16 MiB stays in this machine's L3, so these are
//! in-cache figures for spotting regressions; `hipkv bench` measures from DRAM.
//!
//! `attend_short`: the same over 128 and 512 tokens, where a step takes tens of µs and what it
//! costs to hand the work to rayon's pool shows (short steps run on the caller's thread, longer
//! ones on the pool: all cores, or `RAYON_NUM_THREADS`), and `kivi2`'s value window holds all
//! or a quarter of the sequence.

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use hipkv::synth::{Rng, TokenPool};
use hipkv::{KvCache, Scheme};

use common::{GQA, HEAD_DIM, KV_HEADS};

const CONTEXT: usize = 4096;

/// One decode step: a query token for every head, its output, and the softmax scale.
struct Step {
    q: Vec<f32>,
    out: Vec<f32>,
    scale: f32,
}

impl Step {
    fn new() -> Self {
        let q = Rng::new(2).normals(KV_HEADS * GQA * HEAD_DIM);
        Step {
            out: vec![0f32; q.len()],
            q,
            scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        }
    }

    /// Benchmarks the step over sequence 0 of `cache` as `id` in `group`.
    fn bench(&mut self, group: &mut BenchmarkGroup<'_, WallTime>, id: String, cache: &KvCache) {
        let Step { q, out, scale } = self;
        group.bench_function(id, |b| {
            b.iter(|| {
                cache
                    .attend(0, 0, black_box(q), *scale, out)
                    .expect("attend");
                black_box(&out);
            })
        });
    }
}

/// A one-sequence cache of `scheme` holding `context` tokens of `pool`.
fn filled(scheme: Scheme, context: usize, pool: &TokenPool) -> KvCache {
    let mut cache = common::cache(scheme, context, pool);
    pool.fill(&mut cache, 0, 0, context, 512, 0).expect("fill");
    cache
}

fn attend(c: &mut Criterion) {
    let pool = TokenPool::new(&mut Rng::new(1), 2048, KV_HEADS, HEAD_DIM);
    let mut step = Step::new();
    let mut group = c.benchmark_group("attend_4k");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for scheme in common::schemes() {
        let cache = filled(scheme, CONTEXT, &pool);
        let bytes = cache.bytes_read(0, 0).expect("sequence 0");
        group.throughput(Throughput::Bytes(bytes as u64));
        step.bench(&mut group, scheme.to_string(), &cache);
    }
    group.finish();
}

fn attend_short(c: &mut Criterion) {
    let pool = TokenPool::new(&mut Rng::new(1), 512, KV_HEADS, HEAD_DIM);
    let mut step = Step::new();
    let mut group = c.benchmark_group("attend_short");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for name in ["q8", "q4_tok", "kivi2"] {
        let scheme = name.parse().expect("known scheme");
        for context in [128, 512] {
            let cache = filled(scheme, context, &pool);
            step.bench(&mut group, format!("{name}/{context}"), &cache);
        }
    }
    group.finish();
}

criterion_group!(benches, attend, attend_short);
criterion_main!(benches);
