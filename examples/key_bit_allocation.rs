//! What per-channel keys would gain from spending their bits where the scores need them.
//!
//! At 72 bytes per token and KV head the keys are most of the error (docs/accuracy.md, "The
//! frontier"): `q4_chan` gives every channel the same 4 bits, yet a channel's share of a score's
//! error is its query weight times its quantization step squared, and both differ by orders of
//! magnitude between channels. This measures, on the eval model, what a format that gives each
//! channel its own code width (chosen per layer and KV head from calibration, the same total bits
//! per row, or per token row of a layer with `--pool layer`) would cost in KL, before anyone
//! builds it.
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
//! ```sh
//! scripts/fetch-model.sh
//! cargo run --release --example key_bit_allocation -- --tokens 2048 --bits 4
//! ```

use clap::Parser;
use half::f16;

use hipkv::eval::{self, Attention, CacheAttention, EvalError, Model, ModelConfig};
use hipkv::scheme::LowBits;
use hipkv::{Format, RopeLayout, Scheme};

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
    /// Code widths a channel may take, one set per run, sets separated by `;`.
    #[arg(long, default_value = "1,2,3,4,5,6,7,8;2,3,4,6,8;2,4,8")]
    widths: String,
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

/// Full-page bytes per token of one KV head's keys at `bits` per element in `page`-token pages:
/// the codes and, per channel and page, an f16 minimum and step (as `q*_chan` stores them).
fn key_bytes_per_token(bits: f64, head_dim: usize, page: usize) -> f64 {
    let d = head_dim as f64;
    bits * d / 8.0 + 4.0 * d / page as f64
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.values.k != Format::F16 || args.values.pre_rope {
        return Err("--values must have f16 keys and no pre_rope (the keys are simulated)".into());
    }
    let sets: Vec<Vec<u32>> = args
        .widths
        .split(';')
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
            || f64::from(s[0]) > args.bits
            || f64::from(s[s.len() - 1]) < args.bits
    }) {
        return Err("--widths: each set ascending, within 1..=16, spanning --bits".into());
    }
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
    let mut names = Vec::new();
    let mut runs: Vec<Box<dyn Attention>> = Vec::new();
    let real = match args.bits {
        2.0 => Some(LowBits::Two),
        4.0 => Some(LowBits::Four),
        _ => None,
    };
    if let Some(real) = real {
        let scheme = Scheme {
            k: Format::Chan { bits: real },
            pre_rope: true,
            ..args.values
        };
        names.push(format!("{scheme} (the format)"));
        runs.push(Box::new(CacheAttention::new(&cfg, scheme, args.tokens)?));
    }
    if args.bits.fract() == 0.0 {
        names.push(format!("uniform {} bits, simulated", args.bits));
        runs.push(Box::new(simulated(vec![args.bits as u32], Pool::Head)?));
    }
    for set in sets {
        for &pool in &args.pool {
            names.push(format!(
                "widths {{{}}} per {}, simulated",
                set.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
                pool.name()
            ));
            runs.push(Box::new(simulated(set.clone(), pool)?));
        }
    }
    let mut refs: Vec<&mut dyn Attention> = runs
        .iter_mut()
        .map(|r| r.as_mut() as &mut dyn Attention)
        .collect();
    let kls = eval::mean_kl_of(&model, &tokens, CHUNK, &mut refs)?;
    // Full-page bytes per token and KV head; the values' as the scheme stores them, its f16
    // keys taken out.
    let key_bytes = key_bytes_per_token(args.bits, cfg.head_dim, page);
    let value_bytes = args.values.bytes_per_token(cfg.head_dim) - 2.0 * cfg.head_dim as f64;
    println!(
        "keys at {} bits per element on average in {page}-token pages, values: {}, {} tokens; \
         {:.2} bytes per token and KV head ({key_bytes:.2} keys, {value_bytes:.2} values)",
        args.bits,
        args.values,
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
}
