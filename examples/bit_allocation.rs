//! What per-channel code widths would gain, for keys and for values, before either format is
//! built.
//!
//! **Keys.** At 72 bytes per token and KV head the keys are most of the error (docs/accuracy.md,
//! "The frontier"): `q4_chan` gives every channel the same 4 bits, yet a channel's share of a
//! score's error is its query weight times its quantization step squared, and both differ by
//! orders of magnitude between channels. This measures, on the eval model, what a format that
//! gives each channel its own code width (chosen per layer and KV head from calibration, the same
//! total bits per row, or per token row of a layer with `--pool layer`) would cost in KL.
//!
//! The keys are quantized as `q*_chan` quantizes them (before RoPE, per channel over each full
//! key page of absolute positions (`--key-page`), the sinks and the open page left exact, the minimum and
//! step rounded to f16 as `quant::quantize_chan` rounds them), then stored in an f16 key stream
//! beside the values of `--values`, which go through the real scheme. Each channel `c` of a KV
//! head is weighted by `w_c = E[(q_c² + q_c'²)/2] · E[r_c²]` over the first chunk: its query
//! energy, averaged with its RoPE partner `c'` (RoPE turns a pre-RoPE channel into its pair by
//! position), times its page range squared; then bits go one step at a time to the channel whose
//! `w_c / (2^b − 1)²` drops most per bit, within `--widths`. A fractional `--bits` trades code
//! bits against the parameters of another key page size (`--key-page`, or the `g` of `--values`)
//! at the same bytes: 3.5 bits in 32-token pages cost what 4 bits in 64-token pages do. The real
//! `q*_chan` scheme runs beside it (at 2 and 4 bits), so the same run checks the simulation
//! against the library's format.
//!
//! **Values** (`--value-bits`). A value row is quantized per token, so its one step spreads its
//! error over its channels; `rot=v` makes that spread even. The simulated row stores one f16
//! minimum and range per token and head (4 bytes, as `q*_tok` with one group per head does) and
//! its codes, the sinks exact and no value window, in a basis fitted per layer and KV head on the
//! first chunk (`--value-basis`): `hadamard`, `rot=v`'s; `aligned`, the same after a reflection
//! that takes the head's principal axis (of `E[v vᵀ]`) to the all-ones direction, so that a row's
//! component along it becomes a constant the row's minimum stores; `pca`, the principal axes,
//! axis `c` of energy `λ_c` divided by `λ_c^(α/2)` (`α` = `--value-norm`, default 1: unit
//! variance) and given its own width by the same greedy allocation, weighted by `λ_c^α`;
//! `pca-mixed`, `pca` with each band of one width mixed by a DCT. The real `q*_tok` format with `rot=v` and no window
//! runs beside them (at 2 and 4 bits) to check the simulation. Each run pairs one key variant
//! (f16, or a `--widths` set) with one value variant.
//!
//! ```sh
//! scripts/fetch-model.sh
//! cargo run --release --example bit_allocation -- --tokens 2048 --bits 4
//! cargo run --release --example bit_allocation -- --tokens 2048 --value-bits 4 \
//!     --widths 1,2,3,4,5,6,7,8 --values 'k=f16,v=f16,g=64,sinks=4'
//! ```

use std::error::Error;

use clap::Parser;
use half::f16;

use hipkv::eval::{self, Attention, CacheAttention, EvalError, Model, ModelConfig};
use hipkv::quant::hadamard_exact;
use hipkv::scheme::{ChannelGroup, LowBits, StreamSet};
use hipkv::{Format, RopeLayout, Scheme, Stream};

#[derive(Parser)]
struct Args {
    /// Llama-family or Gemma-3 GGUF model.
    #[arg(long, default_value = eval::DEFAULT_MODEL)]
    model: std::path::PathBuf,
    /// Tokens of the bundled corpus to run.
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    /// Mean code bits per key element: each pool of channels (`--pool`) shares
    /// `round(bits × channels)` bits per token, so a fraction trades code bits against the
    /// parameters of another `--key-page` at the same bytes.
    #[arg(long, default_value_t = 4.0)]
    bits: f64,
    /// Which channels share one budget of bits, one run per pool and width set: each KV head's
    /// (`head`: every head's rows the same bytes) or all of a layer's KV heads' (`layer`: a
    /// token's row of the layer the same bytes, its heads' shares not).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "head")]
    pool: Vec<Pool>,
    /// Tokens per key page (the span of a channel's minimum and step); default the `g` of
    /// `--values`. Only the simulated keys take it, so it may be a size no scheme has.
    #[arg(long)]
    key_page: Option<usize>,
    /// The scheme of everything but the keys' codes (its keys must be `f16`; its `g`, sinks and
    /// `pre_rope`-free options apply).
    #[arg(long, default_value = "k=f16,v=q4_tok@64,g=64,sinks=4,rv=128,rot=v")]
    values: Scheme,
    /// Code widths a channel may take, one set per run, sets separated by `;` (`''`: none, to
    /// run f16 keys alone beside `--value-bits`).
    #[arg(long, default_value = "1,2,3,4,5,6,7,8;2,3,4,6,8;2,4,8")]
    widths: String,
    /// Mean code bits per value element: simulates the values too, in each `--value-basis`
    /// (`--values` must then store f16 values, unrotated).
    #[arg(long)]
    value_bits: Option<f64>,
    /// Bases the simulated values are quantized in, one run each (`hadamard` only at a whole
    /// `--value-bits`).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "hadamard,pca"
    )]
    value_basis: Vec<Basis>,
    /// Code widths a value axis may take in the `pca` basis, one set per run, sets separated by
    /// `;`.
    #[arg(long, default_value = "1,2,3,4,5,6,7,8")]
    value_widths: String,
    /// Runs every run again with its values aligned (the `aligned` basis applied to the real
    /// value format of `--values`, which must rotate its values: its value window included),
    /// and adds a run with the keys of `--values` (f16).
    #[arg(long)]
    align: bool,
    /// `pca` bases divide each principal axis by its standard deviation to this power (and
    /// weigh its error by its energy to this power).
    #[arg(long, default_value_t = 1.0)]
    value_norm: f64,
}

/// Tokens per forward pass of the eval; appended and attended together.
const CHUNK: usize = 512;

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Pool {
    Head,
    Layer,
}

impl Pool {
    /// Channels that share one budget.
    fn channels(self, cfg: &ModelConfig) -> usize {
        match self {
            Pool::Head => cfg.head_dim,
            Pool::Layer => cfg.head_dim * cfg.kv_heads,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Pool::Head => "KV head",
            Pool::Layer => "layer",
        }
    }
}

/// The basis simulated values are quantized in.
#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Basis {
    /// `rot=v`'s orthonormal Walsh–Hadamard transform, every channel at one width.
    Hadamard,
    /// Each KV head's principal axes over the first chunk, scaled to unit variance, each axis at
    /// its own width.
    Pca,
    /// `pca`, then the axes of each width mixed by a DCT.
    PcaMixed,
    /// `hadamard`, after a reflection that takes the head's principal axis to the all-ones
    /// direction, so a row's component along it is a constant the row's minimum absorbs.
    Aligned,
}

/// Full-page bytes per token of one KV head's keys at `bits` per element in `page`-token pages:
/// the codes and, per channel and page, an f16 minimum and step (as `q*_chan` stores them).
fn key_bytes_per_token(bits: f64, head_dim: usize, page: usize) -> f64 {
    let d = head_dim as f64;
    bits * d / 8.0 + 4.0 * d / page as f64
}

/// Bytes per token of one KV head's simulated values: the codes, and an f16 minimum and range.
fn value_bytes_per_token(bits: f64, head_dim: usize) -> f64 {
    bits * head_dim as f64 / 8.0 + 4.0
}

/// Code widths per channel: the weights' greedy allocation of `total` bits, each channel's
/// width one of `widths` (ascending; every channel starts at the first).
fn allocate(w: &[f64], total: i64, widths: &[u32]) -> Vec<u32> {
    let distortion = |w: f64, b: u32| w / f64::from((1u32 << b) - 1).powi(2);
    let mut alloc = vec![widths[0]; w.len()];
    let mut left = total - i64::from(widths[0]) * w.len() as i64;
    let wider = |b: u32| widths.iter().copied().find(|&x| x > b);
    loop {
        let step = (0..w.len())
            .filter_map(|c| {
                let to = wider(alloc[c])?;
                let cost = i64::from(to - alloc[c]);
                let gain = (distortion(w[c], alloc[c]) - distortion(w[c], to)) / cost as f64;
                (cost <= left).then_some((c, to, gain))
            })
            .max_by(|a, b| a.2.total_cmp(&b.2));
        let Some((c, to, _)) = step else {
            return alloc;
        };
        left -= i64::from(to - alloc[c]);
        alloc[c] = to;
    }
}

fn min_max(xs: impl Iterator<Item = f32>) -> (f32, f32) {
    xs.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    })
}

/// Quantizes, in place, the keys of every full page of `keys` (`n × heads × d`, the first at
/// position `first`), channel `c` of head `h` with `widths[h * d + c]` bits over the page's
/// rows past the first `sinks` positions.
fn quantize_pages(
    keys: &mut [f32],
    first: usize,
    heads: usize,
    widths: &[u32],
    g: usize,
    sinks: usize,
) {
    let d = widths.len() / heads;
    let n = keys.len() / (heads * d);
    // Rows past the sinks, page by page; pages are blocks of `g` absolute positions.
    let mut t = sinks.saturating_sub(first).min(n);
    while t < n {
        let page_end = ((first + t) / g + 1) * g - first;
        if page_end > n {
            return; // the open page stays exact, as the residual window keeps it
        }
        for (hc, &b) in widths.iter().enumerate() {
            let (h, c) = (hc / d, hc % d);
            let at = |row: usize| (row * heads + h) * d + c;
            let (lo, hi) = min_max((t..page_end).map(|r| keys[at(r)]));
            let min = f16::from_f32(lo).to_f32();
            let step = f16::from_f32((hi - lo) / ((1u32 << b) - 1) as f32).to_f32();
            for r in t..page_end {
                let code = if step > 0.0 {
                    ((keys[at(r)] - min) / step)
                        .round()
                        .clamp(0.0, ((1u32 << b) - 1) as f32)
                } else {
                    0.0
                };
                keys[at(r)] = min + code * step;
            }
        }
        t = page_end;
    }
}

/// The model's attention with keys quantized at per-channel widths and stored f16.
struct AllocatedKeys {
    inner: CacheAttention,
    cfg: ModelConfig,
    bits: f64,
    pool: Pool,
    page: usize,
    widths: Vec<u32>,
    /// Per layer: each KV head's channel widths, once calibrated.
    alloc: Vec<Option<Vec<u32>>>,
    /// Per layer: positions appended.
    len: Vec<usize>,
}

impl AllocatedKeys {
    /// `w_c` of every channel of every KV head, from one chunk's queries and keys.
    fn weights(&self, layer: usize, q: &[f32], k: &[f32]) -> Vec<f64> {
        let (kvh, qh, d) = (self.cfg.kv_heads, self.cfg.q_heads, self.cfg.head_dim);
        let (g, sinks) = (self.page, self.inner.scheme().sinks);
        let partner = |c: usize| match self.cfg.layer_rope(layer).layout {
            RopeLayout::Interleaved => c ^ 1,
            RopeLayout::Halves => (c + d / 2) % d,
        };
        let n = k.len() / (kvh * d);
        let group = qh / kvh;
        let mut w = Vec::with_capacity(kvh * d);
        for h in 0..kvh {
            let mut energy = vec![0f64; d];
            for row in q
                .chunks_exact(d)
                .enumerate()
                .filter(|(i, _)| i % qh / group == h)
            {
                for (e, &x) in energy.iter_mut().zip(row.1) {
                    *e += f64::from(x) * f64::from(x);
                }
            }
            let mut range = vec![0f64; d];
            let pages: Vec<(usize, usize)> = (0..n.div_ceil(g))
                .map(|p| ((p * g).max(sinks), ((p + 1) * g).min(n)))
                .filter(|(a, b)| a < b)
                .collect();
            for &(from, to) in &pages {
                for (c, r) in range.iter_mut().enumerate() {
                    let (lo, hi) = min_max((from..to).map(|t| k[(t * kvh + h) * d + c]));
                    *r += f64::from(hi - lo).powi(2) / pages.len() as f64;
                }
            }
            w.extend((0..d).map(|c| (energy[c] + energy[partner(c)]) / 2.0 * range[c]));
        }
        w
    }
}

impl Attention for AllocatedKeys {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EvalError> {
        let d = self.cfg.head_dim;
        if self.alloc[layer].is_none() {
            let w = self.weights(layer, q, k);
            let total = |channels: usize| (self.bits * channels as f64).round() as i64;
            let alloc = w
                .chunks_exact(self.pool.channels(&self.cfg))
                .flat_map(|p| allocate(p, total(p.len()), &self.widths))
                .collect();
            self.alloc[layer] = Some(alloc);
        }
        let s = self.inner.scheme();
        let mut keys = k.to_vec();
        let alloc = self.alloc[layer].as_deref().unwrap_or_default();
        quantize_pages(
            &mut keys,
            self.len[layer],
            self.cfg.kv_heads,
            alloc,
            self.page,
            s.sinks,
        );
        self.len[layer] += k.len() / (self.cfg.kv_heads * d);
        self.inner.attend(layer, q, &keys, v, out)
    }
}

/// Eigenvalues and orthonormal eigenvectors of the symmetric `n × n` matrix `a` (row-major), by
/// cyclic Jacobi rotations: the eigenvalues, and a row-major matrix whose column `c` is the
/// eigenvector of eigenvalue `c`.
fn symmetric_eigen(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v: Vec<f64> = (0..n * n)
        .map(|i| f64::from(u8::from(i / n == i % n)))
        .collect();
    let norm: f64 = a.iter().map(|x| x * x).sum();
    for _sweep in 0..64 {
        let off: f64 = (0..n * n)
            .filter(|i| i / n != i % n)
            .map(|i| a[i] * a[i])
            .sum();
        if off <= 1e-24 * norm {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq == 0.0 {
                    continue;
                }
                // The rotation that zeroes a[p][q] (Golub and Van Loan, 8.5.2).
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = if theta == 0.0 {
                    1.0
                } else {
                    theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt())
                };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                let turn = |x: f64, y: f64| (c * x - s * y, s * x + c * y);
                for k in 0..n {
                    (a[k * n + p], a[k * n + q]) = turn(a[k * n + p], a[k * n + q]);
                    (v[k * n + p], v[k * n + q]) = turn(v[k * n + p], v[k * n + q]);
                }
                for k in 0..n {
                    (a[p * n + k], a[q * n + k]) = turn(a[p * n + k], a[q * n + k]);
                }
            }
        }
    }
    ((0..n).map(|i| a[i * n + i]).collect(), v)
}

/// A Householder reflection `R = I − 2 w wᵀ` (`w` of unit length, or zero for `R = I`). Its own
/// inverse.
struct Reflection {
    w: Vec<f64>,
}

impl Reflection {
    /// The reflection that takes the principal axis of `rows` (the top eigenvector of their
    /// second moment) to the first coordinate, which `H` spreads evenly over every channel.
    fn principal(rows: &[&[f32]], d: usize) -> Reflection {
        let (energy, u) = second_moment_axes(rows, d);
        let top = (0..d)
            .max_by(|&a, &b| energy[a].total_cmp(&energy[b]))
            .unwrap_or(0);
        let mut w: Vec<f64> = (0..d).map(|k| u[k * d + top]).collect();
        w[0] -= 1.0;
        let norm = w.iter().map(|x| x * x).sum::<f64>().sqrt();
        for x in &mut w {
            *x = if norm > 0.0 { *x / norm } else { 0.0 };
        }
        Reflection { w }
    }

    /// `R`, row-major.
    fn matrix(&self) -> Vec<f64> {
        let d = self.w.len();
        (0..d * d)
            .map(|i| f64::from(u8::from(i / d == i % d)) - 2.0 * self.w[i / d] * self.w[i % d])
            .collect()
    }

    /// `x ← R x`.
    fn apply(&self, x: &mut [f32]) {
        let dot: f64 = self.w.iter().zip(&*x).map(|(w, &v)| w * f64::from(v)).sum();
        for (v, w) in x.iter_mut().zip(&self.w) {
            *v = (f64::from(*v) - 2.0 * w * dot) as f32;
        }
    }
}

/// The rows of KV head `h` in `v` (`n × kv_heads × d`, the first at position `first`) that are
/// past the first `sinks` positions.
fn head_rows<'v>(
    v: &'v [f32],
    cfg: &ModelConfig,
    h: usize,
    first: usize,
    sinks: usize,
) -> Vec<&'v [f32]> {
    let (kvh, d) = (cfg.kv_heads, cfg.head_dim);
    v.chunks_exact(kvh * d)
        .enumerate()
        .filter(|(t, _)| first + t >= sinks)
        .map(|(_, row)| &row[h * d..(h + 1) * d])
        .collect()
}

/// One KV head's simulated value basis: a row's coordinates `y = F v` are stored, coordinate `c`
/// at `widths[c]` bits, and read back as `v = I y`.
struct ValueBasis {
    /// `F` and `I`, row-major `d × d`.
    forward: Vec<f64>,
    inverse: Vec<f64>,
    widths: Vec<u32>,
}

/// The eigenvalues and eigenvectors (columns) of the rows' second moment `E[v vᵀ]`.
fn second_moment_axes(rows: &[&[f32]], d: usize) -> (Vec<f64>, Vec<f64>) {
    let mut moment = vec![0f64; d * d];
    for row in rows {
        for i in 0..d {
            for j in 0..d {
                moment[i * d + j] += f64::from(row[i]) * f64::from(row[j]);
            }
        }
    }
    let n = rows.len().max(1) as f64;
    symmetric_eigen(moment.iter().map(|m| m / n).collect(), d)
}

/// `a · b` of two row-major `n × n` matrices.
fn matmul(a: &[f64], b: &[f64], n: usize) -> Vec<f64> {
    (0..n * n)
        .map(|i| (0..n).map(|k| a[i / n * n + k] * b[k * n + i % n]).sum())
        .collect()
}

fn transposed(a: &[f64], n: usize) -> Vec<f64> {
    (0..n * n).map(|i| a[i % n * n + i / n]).collect()
}

/// The orthonormal DCT-II of `m` points, row-major: it spreads one large coordinate over all
/// `m`, at any `m`.
fn dct(m: usize) -> Vec<f64> {
    (0..m * m)
        .map(|i| {
            let (k, x) = ((i / m) as f64, (i % m) as f64);
            let norm = if k == 0.0 { 1.0 } else { 2.0 };
            (norm / m as f64).sqrt() * (std::f64::consts::PI * (x + 0.5) * k / m as f64).cos()
        })
        .collect()
}

impl ValueBasis {
    fn hadamard(d: usize, bits: u32) -> ValueBasis {
        let mut h = vec![0f64; d * d];
        for c in 0..d {
            let mut column = vec![0f32; d];
            column[c] = 1.0;
            hadamard_exact(&mut column);
            for (k, x) in column.into_iter().enumerate() {
                h[k * d + c] = f64::from(x);
            }
        }
        ValueBasis {
            inverse: transposed(&h, d),
            forward: h,
            widths: vec![bits; d],
        }
    }

    /// The principal axes of `rows` (each `d` long), each scaled to unit variance and given its
    /// share of `total` bits; with `mix`, the axes of each width are then mixed by a DCT, so a
    /// row's large coordinate on a weak axis is spread over its band instead of setting the
    /// row's range alone.
    /// `hadamard`, its input first reflected by [`Reflection::principal`].
    fn aligned(rows: &[&[f32]], d: usize, bits: u32) -> ValueBasis {
        let reflect = Reflection::principal(rows, d).matrix();
        let h = ValueBasis::hadamard(d, bits);
        ValueBasis {
            forward: matmul(&h.forward, &reflect, d),
            inverse: matmul(&reflect, &h.inverse, d),
            widths: h.widths,
        }
    }

    fn principal(
        rows: &[&[f32]],
        d: usize,
        total: i64,
        widths: &[u32],
        mix: bool,
        norm: f64,
    ) -> ValueBasis {
        let (energy, u) = second_moment_axes(rows, d);
        // An axis that the first chunk leaves empty must not blow a later row's range up.
        let floor = 1e-6 * energy.iter().copied().fold(0.0, f64::max);
        let scale: Vec<f64> = energy
            .iter()
            .map(|&e| e.max(floor).powf(norm / 2.0))
            .collect();
        let weights: Vec<f64> = scale.iter().map(|s| s * s).collect();
        let widths = allocate(&weights, total, widths);
        // Axes by width, widest first, so each band is a contiguous block.
        let mut order: Vec<usize> = (0..d).collect();
        order.sort_by(|&a, &b| widths[b].cmp(&widths[a]).then(a.cmp(&b)));
        let sigma = |c: usize| scale[c];
        // Row `i` of the forward map is axis `order[i]`, scaled: `(u_c · v) / σ_c`.
        let mut forward: Vec<f64> = (0..d * d)
            .map(|i| u[i % d * d + order[i / d]] / sigma(order[i / d]))
            .collect();
        let mut inverse: Vec<f64> = (0..d * d)
            .map(|i| u[i / d * d + order[i % d]] * sigma(order[i % d]))
            .collect();
        let widths: Vec<u32> = order.iter().map(|&c| widths[c]).collect();
        if mix {
            let mut block = vec![0f64; d * d];
            let mut start = 0;
            while start < d {
                let end = start
                    + widths[start..]
                        .iter()
                        .take_while(|&&b| b == widths[start])
                        .count();
                let m = end - start;
                for (i, x) in dct(m).into_iter().enumerate() {
                    block[(start + i / m) * d + start + i % m] = x;
                }
                start = end;
            }
            forward = matmul(&block, &forward, d);
            inverse = matmul(&inverse, &transposed(&block, d), d);
        }
        ValueBasis {
            forward,
            inverse,
            widths,
        }
    }

    /// The coordinates of `row`.
    fn coordinates(&self, row: &[f32]) -> Vec<f64> {
        let d = row.len();
        (0..d)
            .map(|c| {
                (0..d)
                    .map(|k| self.forward[c * d + k] * f64::from(row[k]))
                    .sum()
            })
            .collect()
    }

    /// `row`, quantized in this basis and decoded: one f16 minimum and range over the row's
    /// coordinates, each coordinate at its width.
    fn quantize(&self, row: &mut [f32]) {
        let d = row.len();
        let y = self.coordinates(row);
        let (lo, hi) = y
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                (lo.min(x), hi.max(x))
            });
        let min = f64::from(f16::from_f64(lo).to_f32());
        let range = f64::from(f16::from_f64(hi - lo).to_f32());
        let decoded: Vec<f64> = y
            .iter()
            .zip(&self.widths)
            .map(|(&x, &b)| {
                let top = f64::from((1u32 << b) - 1);
                let step = range / top;
                let code = if step > 0.0 {
                    ((x - min) / step).round().clamp(0.0, top)
                } else {
                    0.0
                };
                min + code * step
            })
            .collect();
        for (k, r) in row.iter_mut().enumerate() {
            *r = (0..d)
                .map(|c| self.inverse[k * d + c] * decoded[c])
                .sum::<f64>() as f32;
        }
    }
}

/// An attention whose values are quantized in a [`ValueBasis`] per KV head before it sees them.
struct SimulatedValues {
    inner: Box<dyn Attention>,
    cfg: ModelConfig,
    bits: f64,
    basis: Basis,
    widths: Vec<u32>,
    norm: f64,
    sinks: usize,
    /// Per layer: each KV head's basis, once calibrated.
    bases: Vec<Option<Vec<ValueBasis>>>,
    /// Per layer: positions appended.
    len: Vec<usize>,
}

impl SimulatedValues {
    fn calibrate(&self, v: &[f32], first: usize) -> Vec<ValueBasis> {
        let (kvh, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        let total = (self.bits * d as f64).round() as i64;
        (0..kvh)
            .map(|h| match self.basis {
                Basis::Hadamard => ValueBasis::hadamard(d, self.bits as u32),
                Basis::Aligned => {
                    let rows = head_rows(v, &self.cfg, h, first, self.sinks);
                    ValueBasis::aligned(&rows, d, self.bits as u32)
                }
                Basis::Pca | Basis::PcaMixed => {
                    let rows = head_rows(v, &self.cfg, h, first, self.sinks);
                    let mix = self.basis == Basis::PcaMixed;
                    ValueBasis::principal(&rows, d, total, &self.widths, mix, self.norm)
                }
            })
            .collect()
    }
}

impl Attention for SimulatedValues {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EvalError> {
        let (kvh, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        let first = self.len[layer];
        if self.bases[layer].is_none() {
            self.bases[layer] = Some(self.calibrate(v, first));
        }
        let bases = self.bases[layer].as_deref().unwrap_or_default();
        let mut values = v.to_vec();
        for (t, row) in values.chunks_exact_mut(kvh * d).enumerate() {
            if first + t >= self.sinks {
                for (basis, head) in bases.iter().zip(row.chunks_exact_mut(d)) {
                    basis.quantize(head);
                }
            }
        }
        self.len[layer] += v.len() / (kvh * d);
        self.inner.attend(layer, q, k, &values, out)
    }
}

/// An attention whose values are reflected per KV head by [`Reflection::principal`] before a
/// `rot=v` scheme stores them, and whose output is reflected back: the `aligned` basis in the
/// scheme's own format, value window included.
struct AlignedValues {
    inner: Box<dyn Attention>,
    cfg: ModelConfig,
    sinks: usize,
    /// Per layer: each KV head's reflection, once calibrated.
    reflections: Vec<Option<Vec<Reflection>>>,
    /// Per layer: positions appended.
    len: Vec<usize>,
}

impl Attention for AlignedValues {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EvalError> {
        let (kvh, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        let first = self.len[layer];
        if self.reflections[layer].is_none() {
            let fit = |h| Reflection::principal(&head_rows(v, &self.cfg, h, first, self.sinks), d);
            self.reflections[layer] = Some((0..kvh).map(fit).collect());
        }
        let reflections = self.reflections[layer].as_deref().unwrap_or_default();
        let mut values = v.to_vec();
        for (head, r) in values.chunks_exact_mut(d).zip(reflections.iter().cycle()) {
            r.apply(head);
        }
        self.inner.attend(layer, q, k, &values, out)?;
        // Each query head's output back through its KV head's reflection.
        let group = self.cfg.q_heads / kvh;
        for (i, head) in out.chunks_exact_mut(d).enumerate() {
            reflections[i % self.cfg.q_heads / group].apply(head);
        }
        self.len[layer] += v.len() / (kvh * d);
        Ok(())
    }
}

/// A run and the name it is printed under.
type NamedRun = (String, Box<dyn Attention>);

/// Width sets, `;`-separated lists of `,`-separated widths, each ascending, within 1..=16 and
/// spanning `bits` (none for an empty `text`).
fn width_sets(text: &str, bits: f64, flag: &str) -> Result<Vec<Vec<u32>>, Box<dyn Error>> {
    let sets: Vec<Vec<u32>> = text
        .split(';')
        .filter(|set| !set.trim().is_empty())
        .map(|set| {
            set.split(',')
                .map(|b| b.trim().parse::<u32>())
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<_, _>>()?;
    if sets.iter().any(|s| {
        s.is_empty()
            || s.windows(2).any(|p| p[0] >= p[1])
            || s[0] == 0
            || s[s.len() - 1] > 16
            || f64::from(s[0]) > bits
            || f64::from(s[s.len() - 1]) < bits
    }) {
        return Err(format!("{flag}: each set ascending, within 1..=16, spanning its bits").into());
    }
    Ok(sets)
}

fn set_name(set: &[u32]) -> String {
    let widths: Vec<String> = set.iter().map(u32::to_string).collect();
    format!("{{{}}}", widths.join(","))
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    if args.values.k != Format::F16 || args.values.pre_rope {
        return Err("--values must have f16 keys and no pre_rope (the keys are simulated)".into());
    }
    let sets = width_sets(&args.widths, args.bits, "--widths")?;
    if args.align && (args.value_bits.is_some() || !args.values.rotation.applies(Stream::V)) {
        return Err(
            "--align needs --values that rotate their values (rot=v), and no --value-bits".into(),
        );
    }
    if let Some(bits) = args.value_bits {
        if args.values.v != Format::F16 || args.values.rotation.applies(Stream::V) {
            return Err("--value-bits needs --values with f16 values, unrotated".into());
        }
        let one_width = |b: &Basis| matches!(b, Basis::Hadamard | Basis::Aligned);
        if bits.fract() != 0.0 && args.value_basis.iter().any(one_width) {
            return Err("--value-basis hadamard and aligned need a whole --value-bits".into());
        }
    }
    let value_sets = match args.value_bits {
        Some(bits) => width_sets(&args.value_widths, bits, "--value-widths")?,
        None => Vec::new(),
    };
    // A page that straddles two chunks would be quantized over the second chunk's rows only.
    let page = args.key_page.unwrap_or(args.values.group_tokens);
    if !CHUNK.is_multiple_of(page) {
        return Err(format!("--key-page must divide the eval's {CHUNK}-token chunk").into());
    }
    let (model, tokenizer) = Model::load(&args.model)?;
    let cfg = *model.config();
    let mut tokens = tokenizer.encode(eval::CORPUS)?;
    if tokens.len() < args.tokens {
        return Err(EvalError::TextTooShort {
            have: tokens.len(),
            want: args.tokens,
        }
        .into());
    }
    tokens.truncate(args.tokens);

    let simulated = |widths: Vec<u32>, pool: Pool| -> Result<AllocatedKeys, EvalError> {
        Ok(AllocatedKeys {
            inner: CacheAttention::new(&cfg, args.values, args.tokens)?,
            cfg,
            bits: args.bits,
            pool,
            page,
            widths,
            alloc: vec![None; cfg.layers],
            len: vec![0; cfg.layers],
        })
    };
    let real_bits = |bits: f64| match bits {
        2.0 => Some(LowBits::Two),
        4.0 => Some(LowBits::Four),
        _ => None,
    };
    let mut names = Vec::new();
    let mut runs: Vec<Box<dyn Attention>> = Vec::new();
    match args.value_bits {
        None => {
            // The key variants, built again for each pass.
            let key_runs = || -> Result<Vec<NamedRun>, EvalError> {
                let mut keys: Vec<NamedRun> = Vec::new();
                if args.align {
                    let exact = CacheAttention::new(&cfg, args.values, args.tokens)?;
                    keys.push((format!("{} (keys f16)", args.values), Box::new(exact)));
                }
                if let Some(real) = real_bits(args.bits) {
                    let scheme = Scheme {
                        k: Format::Chan { bits: real },
                        pre_rope: true,
                        ..args.values
                    };
                    let run = CacheAttention::new(&cfg, scheme, args.tokens)?;
                    keys.push((format!("{scheme} (the format)"), Box::new(run)));
                }
                if args.bits.fract() == 0.0 {
                    let run = simulated(vec![args.bits as u32], Pool::Head)?;
                    keys.push((
                        format!("uniform {} bits, simulated", args.bits),
                        Box::new(run),
                    ));
                }
                for set in &sets {
                    for &pool in &args.pool {
                        let name =
                            format!("widths {} per {}, simulated", set_name(set), pool.name());
                        keys.push((name, Box::new(simulated(set.clone(), pool)?)));
                    }
                }
                Ok(keys)
            };
            for (name, run) in key_runs()? {
                names.push(name);
                runs.push(run);
            }
            if args.align {
                for (name, inner) in key_runs()? {
                    names.push(format!("{name}; values aligned"));
                    runs.push(Box::new(AlignedValues {
                        inner,
                        cfg,
                        sinks: args.values.sinks,
                        reflections: (0..cfg.layers).map(|_| None).collect(),
                        len: vec![0; cfg.layers],
                    }));
                }
            }
        }
        Some(value_bits) => {
            if let Some(real) = real_bits(value_bits) {
                let scheme = Scheme {
                    v: Format::Tok {
                        bits: real,
                        group: ChannelGroup::Head,
                    },
                    rotation: StreamSet::Values,
                    value_window: 0,
                    ..args.values
                };
                names.push(format!("{scheme} (the format)"));
                runs.push(Box::new(CacheAttention::new(&cfg, scheme, args.tokens)?));
            }
            let mut values: Vec<(Basis, Vec<u32>, String)> = Vec::new();
            for &basis in &args.value_basis {
                match basis {
                    Basis::Hadamard => {
                        let name = format!("values Hadamard-rotated, {value_bits} bits");
                        values.push((basis, vec![value_bits as u32], name));
                    }
                    Basis::Aligned => {
                        let name = format!(
                            "values Hadamard-rotated after aligning the principal axis, \
                             {value_bits} bits"
                        );
                        values.push((basis, vec![value_bits as u32], name));
                    }
                    Basis::Pca | Basis::PcaMixed => values.extend(value_sets.iter().map(|set| {
                        let mixed = if basis == Basis::PcaMixed {
                            ", mixed"
                        } else {
                            ""
                        };
                        let name =
                            format!("values on principal axes{mixed}, widths {}", set_name(set));
                        (basis, set.clone(), name)
                    })),
                }
            }
            let mut keys: Vec<Option<(&Vec<u32>, Pool)>> = vec![None];
            for set in &sets {
                keys.extend(args.pool.iter().map(|&pool| Some((set, pool))));
            }
            for key in &keys {
                for (basis, widths, value_name) in &values {
                    let (inner, key_name): (Box<dyn Attention>, String) = match key {
                        None => (
                            Box::new(CacheAttention::new(&cfg, args.values, args.tokens)?),
                            "keys f16".into(),
                        ),
                        Some((set, pool)) => (
                            Box::new(simulated(set.to_vec(), *pool)?),
                            format!("keys widths {} per {}", set_name(set), pool.name()),
                        ),
                    };
                    names.push(format!("{key_name}; {value_name}, simulated"));
                    runs.push(Box::new(SimulatedValues {
                        inner,
                        cfg,
                        bits: value_bits,
                        basis: *basis,
                        widths: widths.clone(),
                        norm: args.value_norm,
                        sinks: args.values.sinks,
                        bases: (0..cfg.layers).map(|_| None).collect(),
                        len: vec![0; cfg.layers],
                    }));
                }
            }
        }
    }
    let mut refs: Vec<&mut dyn Attention> = runs
        .iter_mut()
        .map(|r| r.as_mut() as &mut dyn Attention)
        .collect();
    let kls = eval::mean_kl_of(&model, &tokens, CHUNK, &mut refs)?;
    // Full-page bytes per token and KV head; the values' as the scheme stores them, its f16
    // keys taken out, or as the simulation does.
    let d = cfg.head_dim as f64;
    let key_bytes = key_bytes_per_token(args.bits, cfg.head_dim, page);
    let value_bytes = match args.value_bits {
        Some(bits) => value_bytes_per_token(bits, cfg.head_dim),
        None => args.values.bytes_per_token(cfg.head_dim) - 2.0 * d,
    };
    let values = match args.value_bits {
        Some(bits) => format!("{bits} bits per element, per token"),
        None => args.values.to_string(),
    };
    println!(
        "keys at {} bits per element on average in {page}-token pages, values: {values}, \
         {} tokens; {:.2} bytes per token and KV head ({key_bytes:.2} keys, {value_bytes:.2} \
         values)",
        args.bits,
        args.tokens,
        key_bytes + value_bytes
    );
    for (name, kl) in names.iter().zip(kls) {
        println!("{kl:10.3e}  {name}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_spends_every_bit_on_the_heaviest_channels() {
        let w = [1.0, 1e4, 1.0, 1e2];
        let alloc = allocate(&w, 16, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(alloc.iter().sum::<u32>(), 16);
        assert!(alloc[1] >= alloc[3] && alloc[3] >= alloc[0] && alloc[0] == alloc[2]);
        assert!(alloc.iter().all(|&b| (1..=8).contains(&b)));
        // Equal weights keep the uniform width.
        assert_eq!(allocate(&[3.0; 8], 32, &[1, 2, 4, 8]), vec![4; 8]);
        // Only the given widths are used, and bits that no step fits are left unspent.
        let banded = allocate(&w, 12, &[2, 4, 8]);
        assert!(banded.iter().all(|b| [2, 4, 8].contains(b)), "{banded:?}");
        assert!(banded.iter().sum::<u32>() <= 12);
    }

    #[test]
    fn simulated_key_bytes_are_what_the_chan_formats_store() {
        for (bits, low) in [(2.0, LowBits::Two), (4.0, LowBits::Four)] {
            for g in [32, 64] {
                for d in [64, 128, 256] {
                    let f16 = Scheme {
                        group_tokens: g,
                        ..Scheme::new(Format::F16, Format::F16)
                    };
                    let chan = Scheme {
                        k: Format::Chan { bits: low },
                        ..f16
                    };
                    let stored = chan.bytes_per_token(d) - f16.bytes_per_token(d) / 2.0;
                    assert_eq!(key_bytes_per_token(bits, d, g), stored, "{chan} at d = {d}");
                }
            }
        }
    }

    #[test]
    fn a_shared_pool_moves_bits_to_the_heavier_head_and_spends_a_fractional_budget() {
        // Two heads of four channels, one far heavier, sharing 4 bits per channel on average.
        let w = [1e3, 2e3, 1e3, 3e3, 1.0, 2.0, 1.0, 3.0];
        let alloc = allocate(&w, 32, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(alloc.iter().sum::<u32>(), 32);
        let heavy: u32 = alloc[..4].iter().sum();
        assert!(heavy > 16, "{alloc:?}");
        // 3.5 bits per channel over {3, 4}: half the channels each, the heaviest at 4.
        let alloc = allocate(&[1.0, 5.0, 2.0, 4.0], 14, &[3, 4]);
        assert_eq!(alloc, vec![3, 4, 3, 4]);
    }

    #[test]
    fn pages_are_quantized_within_half_a_step_and_sinks_and_the_open_page_stay_exact() {
        let (heads, d, g, sinks) = (2, 4, 8, 3);
        let n = 21; // positions 5..26: pages [8, 16), [16, 24) full; [5, 8) a full page's tail.
        let first = 5;
        let keys: Vec<f32> = (0..n * heads * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let widths = [2, 3, 4, 8, 1, 2, 3, 4];
        let mut quantized = keys.clone();
        quantize_pages(&mut quantized, first, heads, &widths, g, sinks);
        for t in 0..n {
            let pos = first + t;
            for (hc, &b) in widths.iter().enumerate() {
                let i = t * heads * d + hc;
                if pos >= 24 {
                    assert_eq!(quantized[i], keys[i], "open page, position {pos}");
                    continue;
                }
                let page = pos / g * g;
                let col: Vec<f32> = (page.max(first)..page + g)
                    .map(|p| keys[(p - first) * heads * d + hc])
                    .collect();
                let (lo, hi) = min_max(col.iter().copied());
                let step = (hi - lo) / ((1u32 << b) - 1) as f32;
                assert!(
                    (quantized[i] - keys[i]).abs() <= step * 0.5 + 0.02,
                    "position {pos}, channel {hc}, {b} bits"
                );
            }
        }
        assert_ne!(quantized, keys);
    }

    #[test]
    fn eigenvectors_diagonalize_a_symmetric_matrix() {
        let n = 6;
        let b: Vec<f64> = (0..n * n)
            .map(|i| ((i * 31 % 17) as f64 - 8.0) / 3.0)
            .collect();
        // a = b bᵀ: symmetric, positive semidefinite.
        let a: Vec<f64> = (0..n * n)
            .map(|i| (0..n).map(|k| b[i / n * n + k] * b[i % n * n + k]).sum())
            .collect();
        let (values, u) = symmetric_eigen(a.clone(), n);
        for i in 0..n {
            for j in 0..n {
                // u diag(values) uᵀ = a, and uᵀu = 1.
                let back: f64 = (0..n)
                    .map(|c| u[i * n + c] * values[c] * u[j * n + c])
                    .sum();
                assert!((back - a[i * n + j]).abs() < 1e-9, "a[{i}][{j}]");
                let dot: f64 = (0..n).map(|k| u[k * n + i] * u[k * n + j]).sum();
                assert!((dot - f64::from(u8::from(i == j))).abs() < 1e-12);
            }
        }
        assert!(values.iter().all(|&v| v > -1e-9));
    }

    #[test]
    fn value_bases_invert_and_rows_come_back_within_half_a_step() {
        let d = 16;
        let rows: Vec<Vec<f32>> = (0..64)
            .map(|t| {
                (0..d)
                    .map(|c| ((t * 7 + c * 13) % 23) as f32 / (1.0 + c as f32) - 0.3)
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let widths = [1, 2, 3, 4, 5, 6, 7, 8];
        let pca = ValueBasis::principal(&refs, d, 4 * d as i64, &widths, false, 1.0);
        let mixed = ValueBasis::principal(&refs, d, 4 * d as i64, &widths, true, 1.0);
        assert_eq!(pca.widths.iter().sum::<u32>(), 4 * d as u32);
        assert_eq!(pca.widths, mixed.widths);
        // Bands are contiguous, widest first, and the widest axis carries the most energy.
        assert!(
            pca.widths.windows(2).all(|w| w[0] >= w[1]),
            "{:?}",
            pca.widths
        );
        let energy = |row: usize| {
            (0..d)
                .map(|k| pca.inverse[k * d + row].powi(2))
                .sum::<f64>()
        };
        assert!((1..d).all(|c| energy(c) <= energy(0) * (1.0 + 1e-9)));
        for basis in [pca, mixed, ValueBasis::hadamard(d, 4)] {
            let identity = matmul(&basis.inverse, &basis.forward, d);
            for (i, x) in identity.iter().enumerate() {
                assert!((x - f64::from(u8::from(i / d == i % d))).abs() < 1e-9);
            }
            for row in &rows {
                let mut got = row.clone();
                basis.quantize(&mut got);
                let (want, back) = (basis.coordinates(row), basis.coordinates(&got));
                let (lo, hi) = want
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
                for c in 0..d {
                    let step = (hi - lo) / f64::from((1u32 << basis.widths[c]) - 1);
                    let err = (back[c] - want[c]).abs();
                    // Half a step, and the f16 parameters' and f32 row's rounding.
                    assert!(
                        err <= step * 0.5 + 2e-3 * (hi - lo),
                        "axis {c}: {err} > {step}/2"
                    );
                }
            }
        }
    }

    #[test]
    fn the_reflection_takes_the_principal_axis_to_the_first_coordinate_and_back() {
        let d = 8;
        // Rows along one direction, with a little of every other.
        let axis: Vec<f32> = (0..d).map(|c| (c as f32 - 2.5) / 4.0).collect();
        let rows: Vec<Vec<f32>> = (0..40)
            .map(|t| {
                let a = 3.0 + (t % 7) as f32;
                axis.iter()
                    .enumerate()
                    .map(|(c, x)| a * x + 0.01 * ((t * 5 + c * 3) % 11) as f32)
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let r = Reflection::principal(&refs, d);
        let mut image = axis.clone();
        r.apply(&mut image);
        // The axis lands on ±e_0 (up to the rows' noise).
        let length = axis.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((image[0].abs() - length).abs() < 1e-2 * length, "{image:?}");
        assert!(
            image[1..].iter().all(|x| x.abs() < 2e-2 * length),
            "{image:?}"
        );
        // `apply` is the matrix, and the matrix is its own inverse.
        let m = r.matrix();
        let row = &rows[3];
        let mut applied = row.clone();
        r.apply(&mut applied);
        for (i, got) in applied.iter().enumerate() {
            let want: f64 = (0..d).map(|k| m[i * d + k] * f64::from(row[k])).sum();
            assert!((f64::from(*got) - want).abs() < 1e-5);
        }
        r.apply(&mut applied);
        assert!(applied.iter().zip(row).all(|(a, b)| (a - b).abs() < 1e-5));
    }
}
