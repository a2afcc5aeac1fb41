//! Deterministic synthetic K/V/Q data for tests, benchmarks and `hipkv bench`: Gaussian noise from
//! a seeded SplitMix64, optionally with a few large-magnitude key channels, as real models have.

use crate::cache::KvCache;
use crate::error::Result;

/// A small, seeded, reproducible random source.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform integer in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// `n` standard normal values.
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// Keys shaped like a real model's: unit Gaussian noise plus, in `outlier_channels` fixed channels
/// of every head, a large per-channel offset and spread (`magnitude` times larger).
pub fn keys_with_outlier_channels(
    rng: &mut Rng,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    outlier_channels: usize,
    magnitude: f32,
) -> Vec<f32> {
    let big: Vec<usize> = (0..outlier_channels)
        .map(|i| (i * 37 + 5) % head_dim)
        .collect();
    let mut k = rng.normals(tokens * heads * head_dim);
    for token in k.chunks_exact_mut(head_dim) {
        for (i, &c) in big.iter().enumerate() {
            let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
            token[c] = sign * magnitude * (1.0 + 0.25 * token[c]);
        }
    }
    k
}

/// A block of synthetic tokens (keys with two outlier channels, Gaussian values) appended
/// cyclically to fill caches quickly: generating fresh Gaussians for every token of a long
/// benchmark cache would cost more than quantizing them.
#[derive(Clone, Debug)]
pub struct TokenPool {
    /// `tokens × kv_heads × head_dim`.
    k: Vec<f32>,
    /// Same shape as `k`.
    v: Vec<f32>,
    tokens: usize,
    width: usize,
}

impl TokenPool {
    /// A pool of `tokens` (at least one) tokens of `kv_heads × head_dim` per stream.
    pub fn new(rng: &mut Rng, tokens: usize, kv_heads: usize, head_dim: usize) -> TokenPool {
        let tokens = tokens.max(1);
        let k = keys_with_outlier_channels(rng, tokens, kv_heads, head_dim, 2, 6.0);
        let v = rng.normals(tokens * kv_heads * head_dim);
        TokenPool {
            k,
            v,
            tokens,
            width: kv_heads * head_dim,
        }
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The first `n` tokens (at most all of them) as `(keys, values)`, e.g. for calibration.
    pub fn first(&self, n: usize) -> (&[f32], &[f32]) {
        let end = n.min(self.tokens()) * self.width;
        (&self.k[..end], &self.v[..end])
    }

    /// Appends `len` tokens to `seq` of `layer` in chunks of `chunk` tokens, reading the pool
    /// cyclically from token `offset`; wraps to the pool's start at each chunk that would
    /// run past its end.
    pub fn fill(
        &self,
        cache: &mut KvCache,
        layer: usize,
        seq: usize,
        len: usize,
        chunk: usize,
        offset: usize,
    ) -> Result<()> {
        let pool = self.tokens();
        let chunk = chunk.clamp(1, pool);
        let mut at = offset % pool;
        let mut done = 0;
        while done < len {
            let n = chunk.min(len - done);
            if at + n > pool {
                at = 0;
            }
            let rows = at * self.width..(at + n) * self.width;
            cache.append(layer, seq, &self.k[rows.clone()], &self.v[rows])?;
            done += n;
            at += n;
        }
        Ok(())
    }
}

/// Query blocks of [`crate::quant::QUERY_BLOCK`] values that test how a query is rounded to int8
/// (`quant::quantize_query`): exact halves and the floats beside them (a largest magnitude of
/// 127 makes the scale 1), every half-integer below 127 with 3 floats on either side, zeros of
/// both signs, a constant block, a NaN and infinities, the largest finite values, subnormals,
/// largest magnitudes on either side of the scale's `2^-64` switch
/// ([`crate::quant::TINY_QUERY_SCALE`]) and 2000 random blocks spread over 24 decades.
pub fn query_rounding_blocks() -> Vec<[f32; 32]> {
    let mut blocks: Vec<[f32; 32]> = Vec::new();
    let mut halves = [0f32; 32];
    halves[0] = 127.0;
    for (i, x) in halves.iter_mut().enumerate().skip(1) {
        let h = (i as f32 - 16.0) * 4.0 + 0.5;
        *x = match i % 3 {
            0 => h,
            1 => f32::from_bits(h.to_bits() - 1),
            _ => f32::from_bits(h.to_bits() + 1),
        };
    }
    blocks.push(halves);
    blocks.push(halves.map(|x| -x));
    let near_halves: Vec<f32> = (0..127)
        .flat_map(|k| {
            let h = (k as f32 + 0.5).to_bits();
            (h - 3..=h + 3).map(f32::from_bits)
        })
        .flat_map(|x| [x, -x])
        .collect();
    for chunk in near_halves.chunks(31) {
        let mut b = [127.0; 32];
        b[1..=chunk.len()].copy_from_slice(chunk);
        blocks.push(b);
    }
    blocks.push([0.0; 32]);
    blocks.push(std::array::from_fn(|i| if i % 2 == 0 { -0.0 } else { 0.0 }));
    blocks.push([3.25; 32]);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut b = halves;
        b[7] = bad;
        blocks.push(b);
    }
    blocks.push(std::array::from_fn(|i| {
        if i % 2 == 0 {
            f32::MAX
        } else {
            -f32::MAX / 3.0
        }
    }));
    blocks.push(std::array::from_fn(|i| f32::from_bits(1 + i as u32 * 977)));
    let mut rng = Rng::new(0x2545_f491);
    let switch = (127.0 * crate::quant::TINY_QUERY_SCALE).to_bits();
    for amax in (switch - 4..=switch + 4).map(f32::from_bits) {
        let mut b: [f32; 32] = std::array::from_fn(|_| (2.0 * rng.uniform() - 1.0) * amax);
        b[rng.below(32)] = if rng.below(2) == 0 { amax } else { -amax };
        blocks.push(b);
    }
    for _ in 0..2000 {
        let spread = 10f32.powf((rng.uniform() - 0.5) * 24.0);
        blocks.push(std::array::from_fn(|_| (rng.uniform() - 0.5) * spread));
    }
    blocks
}
