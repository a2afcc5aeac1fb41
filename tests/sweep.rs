//! A seeded sweep of random configurations through the paged API on the emulated device (the
//! HIP kernels' own code): any key format with any value format, sinks, 32- or 64-token blocks,
//! value windows, outlier stores, pre-RoPE keys, rotation, codebooks, head_dim 64/128/256, GQA 1 to 16,
//! f16/bf16/f32, batches of
//! decodes and prefill chunks of random lengths over sequences of random lengths, forks. Each
//! output is compared with a naive attention over the sequence's stored tokens.
//!
//! `HIPKV_SWEEP_CONFIGS` sets how many (default 1000), `HIPKV_SWEEP_SEED` the first seed
//! (default 1). A failure prints the seed and the configuration; replay it alone with
//! `HIPKV_SWEEP_SEED=<seed> HIPKV_SWEEP_CONFIGS=1 cargo test --release --test sweep`.
//! `HIPKV_TEST_BACKEND=hip` runs the sweep on a GPU instead (`common::kernel_backend`).

mod common;

use common::random_codebook;
use common::rig::{Rig, Server, step};
use hipkv::hip::StreamHandle;
use hipkv::paged::{DType, Layout, LayoutSpec};
use hipkv::quant::OutlierThresholds;
use hipkv::scheme::KERNEL_FORMATS as FORMATS;
use hipkv::synth::Rng;
use hipkv::{Rope, RopeLayout, Scheme, Stream};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
        })
        .unwrap_or(default)
}

/// One random configuration, as `(scheme, gqa, head_dim, dtype, steps)`: each step a list of
/// `(sequence, new tokens)`, and `Some(parent)` for a sequence that forks from another first.
struct Config {
    scheme: Scheme,
    kv_heads: usize,
    gqa: usize,
    head_dim: usize,
    dtype: DType,
    steps: Vec<Vec<(usize, usize)>>,
    fork: Option<(usize, usize)>,
}

impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "scheme {} kv_heads {} gqa {} head_dim {} {:?} steps {:?} fork {:?}",
            self.scheme, self.kv_heads, self.gqa, self.head_dim, self.dtype, self.steps, self.fork
        )
    }
}

fn random_config(rng: &mut Rng) -> Config {
    let pick = |rng: &mut Rng, xs: &[&str]| xs[rng.below(xs.len())].to_string();
    let (k, v) = (pick(rng, &FORMATS), pick(rng, &FORMATS));
    let mut scheme = format!("k={k},v={v}");
    if rng.below(3) == 0 {
        scheme += &format!(",sinks={}", 1 + rng.below(6));
    }
    let block = if rng.below(3) == 0 { 64 } else { 32 };
    if block == 64 {
        scheme += ",g=64";
    }
    // A value window of whole blocks, mostly shorter than the sequences (which reach ~140).
    if v != "f16" && rng.below(3) == 0 {
        scheme += &format!(",rv={}", [32, 64, 128][rng.below(3)].max(block));
    }
    let outliers = rng.below(4) == 0;
    if outliers {
        scheme += if rng.below(2) == 0 {
            ",outliers"
        } else {
            ",outliers=kv"
        };
    }
    let pre_rope = rng.below(5) == 0;
    if pre_rope {
        scheme += ",pre_rope";
    }
    // Rotation excludes outlier stores, and rotated keys exclude pre-RoPE keys.
    if !outliers && rng.below(4) == 0 {
        scheme += if pre_rope {
            ",rot=v"
        } else {
            [",rot", ",rot=k", ",rot=v"][rng.below(3)]
        };
    }
    // Mostly head_dim 64: the emulator's time grows with it.
    let head_dim = [64, 64, 64, 128, 256][rng.below(5)];
    let gqa = [1, 2, 4, 8, 16][rng.below(5)];
    let dtype = [DType::F32, DType::F16, DType::BF16][rng.below(3)];
    let seqs = 1 + rng.below(3);
    // A first step that prefills every sequence, then one or two of decodes and chunks.
    let mut steps = vec![
        (0..seqs)
            .map(|s| (s, 1 + rng.below(90)))
            .collect::<Vec<_>>(),
    ];
    for _ in 0..1 + rng.below(2) {
        let mut chunks = Vec::new();
        for s in 0..seqs {
            if rng.below(4) != 0 {
                let n = if rng.below(2) == 0 {
                    1
                } else {
                    1 + rng.below(24)
                };
                chunks.push((s, n));
            }
        }
        steps.push(chunks);
    }
    steps.retain(|s| !s.is_empty());
    let fork = (seqs > 1 && rng.below(3) == 0).then_some((0, seqs));
    let kv_heads = 1 + rng.below(2);
    // Codebooks on the low-bit streams, drawn last: no other choice of a seed depends on them.
    let low = |f: &str| f.starts_with("q4") || f.starts_with("q2");
    if (low(&k) || low(&v)) && rng.below(4) == 0 {
        scheme += match (low(&k), low(&v)) {
            (true, true) => [",nuq", ",nuq=k", ",nuq=v"][rng.below(3)],
            (true, false) => ",nuq=k",
            _ => ",nuq=v",
        };
    }
    Config {
        scheme: scheme.parse().unwrap(),
        kv_heads,
        gqa,
        head_dim,
        dtype,
        steps,
        fork,
    }
}

fn run(seed: u64, c: &Config) {
    let what = format!("seed {seed}: {c}");
    let layout = Layout::new(LayoutSpec {
        scheme: c.scheme,
        kv_heads: c.kv_heads,
        q_heads: c.kv_heads * c.gqa,
        head_dim: c.head_dim,
        num_blocks: 24,
        max_seqs: 8,
        max_positions: 256,
        rope: Some(Rope {
            base: 10000.0,
            layout: if seed.is_multiple_of(2) {
                RopeLayout::Interleaved
            } else {
                RopeLayout::Halves
            },
        }),
    })
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut rig = Rig::new(layout, 1, common::kernel_backend(), 300);
    let mut rng = Rng::new(seed ^ 0x5eed);
    if let Some(o) = c.scheme.outliers {
        let (h, d) = (c.kv_heads, c.head_dim);
        let k = hipkv::synth::keys_with_outlier_channels(&mut rng, 200, h, d, 2, 4.0);
        let v = rng.normals(200 * h * d);
        let kt = OutlierThresholds::calibrate(&k, h, d, o.fraction).unwrap();
        let vt = o
            .values
            .then(|| OutlierThresholds::calibrate(&v, h, d, o.fraction).unwrap());
        rig.paged
            .set_outlier_thresholds(0, &kt, vt.as_ref())
            .unwrap();
    }
    // Random codebooks: the kernels must decode any valid one as the reference does.
    let book = |stream, rng: &mut Rng| {
        c.scheme
            .low_bits(stream)
            .filter(|_| c.scheme.nuq.applies(stream))
            .map(|bits| random_codebook(bits, rng))
    };
    if c.scheme.nuq.applies(Stream::K) || c.scheme.nuq.applies(Stream::V) {
        let (k, v) = (book(Stream::K, &mut rng), book(Stream::V, &mut rng));
        rig.paged.set_codebooks(0, k.as_ref(), v.as_ref()).unwrap();
    }
    let mut server = Server::new(&layout, &mut rng);
    let seqs = c.steps[0].len();
    for s in 0..seqs {
        server.seqs.push(((s * 3 % 8) as i32, Vec::new(), 0));
    }
    for (i, chunks) in c.steps.iter().enumerate() {
        if i == 1
            && let Some((parent, child)) = c.fork
        {
            // The child shares the parent's full blocks; its partial block is a copy.
            let (pslot, blocks, len) = server.seqs[parent].clone();
            let bt = layout.block_tokens();
            let mut mine = blocks[..len / bt].to_vec();
            if len % bt != 0 {
                let copy = server.free.pop().unwrap();
                let pair = [blocks[len / bt].to_le_bytes(), copy.to_le_bytes()].concat();
                let pairs = rig.upload(&[&pair]);
                // SAFETY: the rig's cache and one uploaded pair, alive over the call.
                unsafe {
                    rig.paged
                        .copy_blocks(
                            rig.caches[0].addr(),
                            pairs.addr(0),
                            1,
                            StreamHandle::DEFAULT,
                        )
                        .unwrap()
                };
                mine.push(copy);
            }
            rig.paged
                .fork(pslot as usize, 7, StreamHandle::DEFAULT)
                .unwrap();
            server.seqs.push((7, mine, len));
            let extra: Vec<(usize, usize)> = chunks.iter().copied().chain([(child, 3)]).collect();
            step(&rig, &mut server, &mut rng, &extra, c.dtype, &what);
            continue;
        }
        step(&rig, &mut server, &mut rng, chunks, c.dtype, &what);
    }
}

#[test]
fn random_configurations_match_the_reference_on_the_emulated_device() {
    let first = env("HIPKV_SWEEP_SEED", 1);
    let n = env("HIPKV_SWEEP_CONFIGS", 1000);
    let start = std::time::Instant::now();
    for seed in first..first + n {
        let config = random_config(&mut Rng::new(seed));
        // A failing configuration names its seed: the panic message carries it.
        run(seed, &config);
    }
    println!(
        "{n} configurations from seed {first} in {:.1} s",
        start.elapsed().as_secs_f64()
    );
}
