//! Append throughput per scheme: tokens quantized and stored per second, in chunks of 256 tokens
//! × 8 KV heads × head_dim 128 (RoPE applied to keys, as a model's cache would).

mod common;

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use hipkv::synth::{Rng, TokenPool};

use common::{HEAD_DIM, KV_HEADS};

const TOKENS: usize = 256;

fn append(c: &mut Criterion) {
    let pool = TokenPool::new(&mut Rng::new(1), TOKENS, KV_HEADS, HEAD_DIM);
    let mut group = c.benchmark_group("append");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(TOKENS as u64));
    for scheme in common::schemes() {
        let mut cache = common::cache(scheme, TOKENS, &pool);
        group.bench_function(scheme.to_string(), |b| {
            b.iter(|| {
                cache.clear(0).expect("sequence 0");
                pool.fill(&mut cache, 0, 0, TOKENS, TOKENS, 0)
                    .expect("append");
            })
        });
    }
    group.finish();
}

criterion_group!(benches, append);
criterion_main!(benches);
