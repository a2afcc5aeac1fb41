//! Decode attention on the CPU over one sequence, repeated: the program behind the instruction
//! counts and the compute-versus-memory figures in `docs/performance.md`.
//!
//! ```text
//! cargo run --release --example attend_profile -- SCHEMES [CONTEXT] [CALLS] [SEQUENCES]
//! ```
//!
//! `SCHEMES` is separated by `;`. For each scheme it fills `SEQUENCES` sequences of `CONTEXT`
//! tokens (8 KV heads × GQA 4 × head_dim 128, RoPE, synthetic tokens as `hipkv bench` uses) and
//! makes `CALLS` single-token `attend` calls on sequence 0, which stays in cache when it is
//! small. With more than one sequence, each of those calls is followed by one on the next of
//! the other sequences in turn, which come from DRAM when they are many: equal times mean the
//! kernel is bound by its arithmetic, not by memory. Times are ns per token and KV head.
//!
//! Instructions per token and KV head of one `attend` call: count the whole program at two
//! call counts, so that filling the cache and everything else but the calls cancels out,
//!
//! ```text
//! RAYON_NUM_THREADS=1 valgrind --tool=callgrind target/release/examples/attend_profile q4_tok 1024 2
//! RAYON_NUM_THREADS=1 valgrind --tool=callgrind target/release/examples/attend_profile q4_tok 1024 5
//! ```
//!
//! and divide the difference of the two totals by `3 × CONTEXT × 8`.

use std::hint::black_box;
use std::time::Instant;

use hipkv::Scheme;
use hipkv::synth::{Rng, TokenPool};

/// The criterion benchmarks' shape and cache construction.
#[path = "../benches/common/mod.rs"]
#[allow(dead_code)]
mod common;

use common::{GQA, HEAD_DIM, KV_HEADS};

fn arg(i: usize, default: usize) -> usize {
    std::env::args().nth(i).map_or(default, |s| {
        s.parse()
            .unwrap_or_else(|_| panic!("argument {i}: `{s}` is not a count"))
    })
}

/// Minimum and median of `times` (seconds per call), in ns per token and KV head.
fn summary(times: &mut [f64], context: usize) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    let per = |t: f64| t * 1e9 / (context * KV_HEADS) as f64;
    (per(times[0]), per(times[times.len() / 2]))
}

fn main() -> hipkv::Result<()> {
    let schemes = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "q8;q4_tok;q2_tok;kivi4;kivi2".to_string());
    let (context, calls, sequences) = (arg(2, 2048), arg(3, 4).max(1), arg(4, 1).max(1));
    let pool = TokenPool::new(&mut Rng::new(1), 512, KV_HEADS, HEAD_DIM);
    let q = Rng::new(2).normals(KV_HEADS * GQA * HEAD_DIM);
    let mut out = vec![0f32; q.len()];
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    for name in schemes.split(';') {
        let scheme: Scheme = name.parse()?;
        let mut cache = common::caches(scheme, context, sequences, &pool);
        for seq in 0..sequences {
            pool.fill(&mut cache, 0, seq, context, 512, 37 * seq)?;
        }
        let (mut cached, mut rotating) = (Vec::new(), Vec::new());
        for call in 0..calls {
            let start = Instant::now();
            cache.attend(0, 0, black_box(&q), scale, &mut out)?;
            cached.push(start.elapsed().as_secs_f64());
            if sequences > 1 {
                let seq = 1 + call % (sequences - 1);
                let start = Instant::now();
                cache.attend(0, seq, black_box(&q), scale, &mut out)?;
                rotating.push(start.elapsed().as_secs_f64());
            }
            black_box(&out);
        }
        let (min, median) = summary(&mut cached, context);
        print!("{name:10} sequence 0: min {min:6.1} median {median:6.1}");
        if !rotating.is_empty() {
            let (min, median) = summary(&mut rotating, context);
            print!("   rotating: min {min:6.1} median {median:6.1}");
        }
        println!("   ns per token and KV head");
    }
    Ok(())
}
