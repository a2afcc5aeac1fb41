//! `hipkv eval`: what each KV-cache scheme costs on a real model.
//!
//! A Llama-family or Gemma-3 GGUF model ([`Model`]) runs on the CPU over a text, once with an
//! `f16` cache (the baseline P) and once per scheme under test (Q), every layer's K and V going
//! through a [`KvCache`] in that scheme. Tokens arrive in chunks as an engine prefills them: each
//! chunk is appended to the cache first and then attends to it, so every past token (and the
//! chunk's own) is read back in its stored form. Per scheme: mean KL(P‖Q) over the full
//! vocabulary with its standard error, its 99th percentile, top-1 agreement, ΔNLL and perplexity
//! on the text's next tokens, bytes per token, and KL by context depth.

mod fit;
mod model;
mod plot;
mod spm;
mod tokenizer;

use std::path::PathBuf;

use candle_core::quantized::gguf_file::{Content, Value};
use rayon::prelude::*;
use serde::Serialize;

use crate::{CacheConfig, Calibration, KvCache, Rope, RopeTable, Scheme};

pub use fit::{Fit, KvShape, fit, parse_bytes};
pub use model::{Architecture, Attention, Model, ModelConfig, ModelSummary, inspect};
pub use plot::{plot_depth, plot_pareto};
pub use tokenizer::Tokenizer;

/// Where `scripts/fetch-model.sh` puts the default model, relative to the repository root.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where `scripts/fetch-model.sh gemma3` puts Gemma-3 270M (Q4_K_M), relative to the repository
/// root.
pub const GEMMA3_MODEL: &str = "models/gemma-3-270m-q4_k_m.gguf";

/// The default text: three chapters of the Python 3.11 tutorial (English prose with Python
/// code), PSF License / Zero-Clause BSD; see `data/corpus/LICENSE.md`.
pub const CORPUS: &str = include_str!("../../data/corpus/python-tutorial.txt");

/// Context-depth buckets `[from, to)` in tokens: a token's depth is its position in the text.
pub const DEPTH_BUCKETS: [(usize, usize); 5] = [
    (0, 512),
    (512, 1024),
    (1024, 2048),
    (2048, 4096),
    (4096, 8192),
];

/// Everything that can go wrong in an evaluation.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(
        "model file {} not found: run `scripts/fetch-model.sh` (downloads SmolLM2-135M-Instruct, Q4_1 GGUF, to {DEFAULT_MODEL}), or pass --model PATH",
        path.display()
    )]
    ModelMissing { path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("GGUF: {0}")]
    Gguf(#[from] candle_core::Error),
    #[error("GGUF metadata has no `{key}`")]
    MissingMetadata { key: String },
    #[error("GGUF file has no tensor `{name}`")]
    MissingTensor { name: String },
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("unsupported model: {what}: {value}")]
    UnsupportedModel { what: &'static str, value: String },
    #[error("tokenizer: {0}")]
    Tokenizer(tokenizers::Error),
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfVocab { token: usize, vocab: usize },
    #[error(
        "the text has {have} tokens, {want} were asked for: pass a longer --text or fewer --tokens"
    )]
    TextTooShort { have: usize, want: usize },
    #[error("{tokens} tokens exceed the model's context of {context}")]
    BeyondContext { tokens: usize, context: usize },
    #[error("{what} must be positive")]
    NotPositive { what: &'static str },
    #[error("no schemes to evaluate")]
    NoSchemes,
    #[error(transparent)]
    Cache(#[from] crate::Error),
    #[error(
        "no font for the plots: tried {}; set HIPKV_FONT to a .ttf file (Debian: apt-get install fonts-dejavu-core)",
        tried.join(", ")
    )]
    NoFont { tried: Vec<String> },
    #[error("plot {}: {source}", path.display())]
    Plot {
        path: PathBuf,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// A metadata value of a GGUF file, or an error naming the key.
pub(crate) fn metadata<'c>(content: &'c Content, key: &str) -> Result<&'c Value, EvalError> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| EvalError::MissingMetadata {
            key: key.to_string(),
        })
}

/// The distinct RoPEs of `model`'s layers, and per layer the index of its RoPE in that list
/// and its position among the layers that share it.
fn rope_groups(model: &ModelConfig) -> (Vec<Rope>, Vec<(usize, usize)>) {
    let mut ropes: Vec<Rope> = Vec::new();
    let mut layers_of: Vec<usize> = Vec::new();
    let route = (0..model.layers)
        .map(|l| {
            let rope = model.layer_rope(l);
            let group = match ropes.iter().position(|r| *r == rope) {
                Some(g) => g,
                None => {
                    ropes.push(rope);
                    layers_of.push(0);
                    ropes.len() - 1
                }
            };
            layers_of[group] += 1;
            (group, layers_of[group] - 1)
        })
        .collect();
    (ropes, route)
}

/// The model's attention through hipkv [`KvCache`]s in one scheme: each chunk's keys and values
/// are appended (the cache rotates keys by position as the model's RoPE says, and the queries
/// likewise), then the chunk's queries attend causally over the stored tokens. Layers of one RoPE
/// share a cache; a model whose layers differ in RoPE (Gemma-3's sliding-window and global
/// layers) gets one cache per RoPE.
///
/// Sliding-window layers attend within their window ([`KvCache::set_sliding_window`]).
///
/// Outlier thresholds (schemes with `outliers`) are calibrated per layer from that layer's keys
/// (and values, for `outliers=kv`) of the first chunk, just before it is appended; so are the
/// codebooks of `nuq` schemes, after the thresholds.
pub struct CacheAttention {
    /// One cache per distinct RoPE of the model's layers.
    caches: Vec<KvCache>,
    /// Per model layer: its cache and its layer in that cache.
    route: Vec<(usize, usize)>,
    calibrated: Vec<bool>,
    softmax_scale: f32,
}

impl CacheAttention {
    /// Single-sequence caches for `capacity` tokens of `model` in `scheme`.
    pub fn new(
        model: &ModelConfig,
        scheme: Scheme,
        capacity: usize,
    ) -> Result<CacheAttention, EvalError> {
        Self::per_layer(model, &vec![scheme; model.layers], capacity)
    }

    /// Single-sequence caches for `capacity` tokens of `model`, layer `l` in `schemes[l]`. Only
    /// [`layer_sensitivity`] mixes schemes: [`CacheAttention::scheme`] and the calibration
    /// methods speak for the first layer's.
    fn per_layer(
        model: &ModelConfig,
        schemes: &[Scheme],
        capacity: usize,
    ) -> Result<CacheAttention, EvalError> {
        let (ropes, rope_route) = rope_groups(model);
        // One cache per distinct (RoPE, scheme) pair.
        let mut groups: Vec<(usize, Scheme)> = Vec::new();
        let mut members: Vec<usize> = Vec::new();
        let route: Vec<(usize, usize)> = rope_route
            .iter()
            .zip(schemes)
            .map(|(&(rope, _), &scheme)| {
                let g = match groups.iter().position(|&g| g == (rope, scheme)) {
                    Some(g) => g,
                    None => {
                        groups.push((rope, scheme));
                        members.push(0);
                        groups.len() - 1
                    }
                };
                members[g] += 1;
                (g, members[g] - 1)
            })
            .collect();
        let mut caches = groups
            .iter()
            .zip(&members)
            .map(|(&(rope, scheme), &layers)| {
                KvCache::new(CacheConfig {
                    layers,
                    sequences: 1,
                    kv_heads: model.kv_heads,
                    q_heads: model.q_heads,
                    head_dim: model.head_dim,
                    capacity,
                    scheme,
                    rope: Some(ropes[rope]),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (layer, &(cache, at)) in route.iter().enumerate() {
            caches[cache].set_sliding_window(at, model.window(layer))?;
        }
        Ok(CacheAttention {
            caches,
            route,
            calibrated: vec![false; model.layers],
            softmax_scale: model.softmax_scale(),
        })
    }

    /// Uses `c` (a calibration file of this scheme) instead of calibrating each layer on its
    /// first chunk.
    pub fn apply_calibration(&mut self, c: &Calibration) -> Result<(), EvalError> {
        let cfg = self.caches[0].config();
        c.check_fits(cfg.scheme, self.route.len(), cfg.kv_heads, cfg.head_dim)?;
        for (i, cache) in self.caches.iter_mut().enumerate() {
            let layers = self
                .route
                .iter()
                .zip(&c.layers)
                .filter(|((owner, _), _)| *owner == i)
                .map(|(_, layer)| layer.clone())
                .collect();
            cache.apply_calibration(&Calibration {
                layers,
                ..c.clone()
            })?;
        }
        self.calibrated.iter_mut().for_each(|done| *done = true);
        Ok(())
    }

    /// The calibration of every layer so far, in the model's layer order.
    pub fn calibration(&self) -> Calibration {
        let per_cache: Vec<Calibration> = self.caches.iter().map(KvCache::calibration).collect();
        Calibration {
            layers: self
                .route
                .iter()
                .map(|&(cache, layer)| per_cache[cache].layers[layer].clone())
                .collect(),
            ..per_cache[0].clone()
        }
    }

    pub fn scheme(&self) -> Scheme {
        self.caches[0].config().scheme
    }

    /// Tokens the caches hold at most.
    pub fn capacity(&self) -> usize {
        self.caches[0].config().capacity
    }

    /// Outliers that found no slot, over all layers ([`KvCache::outliers_dropped`]).
    pub fn outliers_dropped(&self) -> u64 {
        self.caches.iter().map(KvCache::outliers_dropped).sum()
    }
}

/// What `hipkv calibrate` writes: `scheme` calibrated on `tokens` (one chunk: every layer's
/// keys and values of those tokens, as the eval calibrates on its first chunk).
pub fn calibrate(model: &Model, tokens: &[u32], scheme: Scheme) -> Result<Calibration, EvalError> {
    let cfg = *model.config();
    if tokens.is_empty() {
        return Err(EvalError::TextTooShort { have: 0, want: 1 });
    }
    if tokens.len() > cfg.context {
        return Err(EvalError::BeyondContext {
            tokens: tokens.len(),
            context: cfg.context,
        });
    }
    let mut attention = CacheAttention::new(&cfg, scheme, tokens.len())?;
    model.forward(tokens, &mut attention)?;
    Ok(attention.calibration())
}

impl Attention for CacheAttention {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EvalError> {
        let (c, l) = self.route[layer];
        let cache = &mut self.caches[c];
        if !self.calibrated[layer] {
            let position = cache.len(l, 0)?;
            cache.calibrate(l, k, v, position)?;
            self.calibrated[layer] = true;
        }
        cache.append(l, 0, k, v)?;
        cache.attend(l, 0, q, self.softmax_scale, out)?;
        Ok(())
    }
}

/// Plain f32 causal attention with RoPE (and sliding windows), no cache and no rounding: the
/// reference that checks the model's forward pass independently of hipkv (tests).
pub struct DenseAttention {
    config: ModelConfig,
    /// One table per distinct RoPE of the model's layers.
    ropes: Vec<RopeTable>,
    /// Per layer: its table.
    rope_of: Vec<usize>,
    capacity: usize,
    /// Per layer: rotated keys and values so far, `tokens × kv_heads × head_dim`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl DenseAttention {
    pub fn new(model: &ModelConfig, capacity: usize) -> DenseAttention {
        let (ropes, route) = rope_groups(model);
        DenseAttention {
            config: *model,
            ropes: ropes
                .into_iter()
                .map(|rope| RopeTable::new(rope, model.head_dim, capacity))
                .collect(),
            rope_of: route.into_iter().map(|(group, _)| group).collect(),
            capacity,
            k: vec![Vec::new(); model.layers],
            v: vec![Vec::new(); model.layers],
        }
    }
}

impl Attention for DenseAttention {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EvalError> {
        let c = &self.config;
        let d = c.head_dim;
        let kv_width = c.kv_heads * d;
        let q_width = c.q_heads * d;
        let start = self.k[layer].len() / kv_width;
        let n = k.len() / kv_width;
        if start + n > self.capacity {
            return Err(EvalError::BeyondContext {
                tokens: start + n,
                context: self.capacity,
            });
        }
        let rope = &self.ropes[self.rope_of[layer]];
        let mut k = k.to_vec();
        for (t, token) in k.chunks_exact_mut(kv_width).enumerate() {
            token
                .chunks_exact_mut(d)
                .for_each(|h| rope.rotate(h, start + t));
        }
        self.k[layer].extend_from_slice(&k);
        self.v[layer].extend_from_slice(v);
        let (keys, values) = (&self.k[layer], &self.v[layer]);
        let scale = c.softmax_scale();
        let window = c.window(layer).unwrap_or(usize::MAX);
        let gqa = c.q_heads / c.kv_heads;
        out.par_chunks_exact_mut(q_width)
            .zip(q.par_chunks_exact(q_width))
            .enumerate()
            .for_each(|(t, (out, q))| {
                let pos = start + t;
                let first = (pos + 1).saturating_sub(window);
                for head in 0..c.q_heads {
                    let kv = head / gqa;
                    let mut qh = q[head * d..(head + 1) * d].to_vec();
                    rope.rotate(&mut qh, pos);
                    let scores: Vec<f64> = (first..=pos)
                        .map(|j| {
                            let kj = &keys[j * kv_width + kv * d..][..d];
                            f64::from(qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale)
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    let o = &mut out[head * d..(head + 1) * d];
                    o.fill(0.0);
                    for (j, wj) in (first..=pos).zip(&w) {
                        let vj = &values[j * kv_width + kv * d..][..d];
                        for (o, x) in o.iter_mut().zip(vj) {
                            *o += (wj / sum) as f32 * x;
                        }
                    }
                }
            });
        Ok(())
    }
}

/// `(log Σ exp(x), argmax)` of one row of logits, in f64.
fn log_sum_exp(logits: &[f32]) -> (f64, usize) {
    let (arg, max) = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(ai, am), (i, &x)| {
            if x > am { (i, x) } else { (ai, am) }
        });
    let max = f64::from(max);
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    (max + sum.ln(), arg)
}

/// What one token's prediction under a scheme costs against the baseline.
#[derive(Clone, Copy, Debug, Default)]
struct TokenStats {
    /// KL(P‖Q) over the whole vocabulary, nats.
    kl: f64,
    /// −log Q(next token).
    nll: f64,
    /// The most likely next token is the same under P and Q.
    top1: bool,
}

/// One token's statistics: `p` the baseline's logits, `q` the scheme's, `next` the true next
/// token. Identical logits give exactly 0 KL.
fn compare(p: &[f32], q: &[f32], next: u32) -> TokenStats {
    let (lse_p, arg_p) = log_sum_exp(p);
    let (lse_q, arg_q) = log_sum_exp(q);
    let kl: f64 = p
        .iter()
        .zip(q)
        .map(|(&a, &b)| {
            let lp = f64::from(a) - lse_p;
            let lq = f64::from(b) - lse_q;
            let pp = lp.exp();
            if pp > 0.0 { pp * (lp - lq) } else { 0.0 }
        })
        .sum();
    TokenStats {
        // Rounding can leave a hair below zero for near-identical rows.
        kl: kl.max(0.0),
        nll: lse_q - f64::from(q[next as usize]),
        top1: arg_p == arg_q,
    }
}

/// Scored positions per block of the noise estimate. The KL of nearby positions is correlated
/// (they share their context), so the standard errors come from the spread of the means of
/// consecutive blocks (batch means), not from the per-token spread, which would understate them.
pub const KL_BLOCK_TOKENS: usize = 64;

/// Mean of `xs` and its standard error `sd / √n` (sample standard deviation); `None` with fewer
/// than two values.
fn mean_and_stderr(xs: &[f64]) -> Option<(f64, f64)> {
    if xs.len() < 2 {
        return None;
    }
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0);
    Some((m, (var / n).sqrt()))
}

/// KL of one depth bucket.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DepthBucket {
    /// First position of the bucket (inclusive).
    pub from: usize,
    /// Last position of the bucket (exclusive).
    pub to: usize,
    /// Tokens of the text in the bucket.
    pub tokens: usize,
    /// Mean KL(P‖Q) over them, nats; `None` when the bucket is empty.
    pub mean_kl: Option<f64>,
    /// Top-1 agreement over them.
    pub top1: Option<f64>,
}

/// The measurement of one scheme.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SchemeReport {
    pub scheme: String,
    /// Mean KL(P‖Q) over the full vocabulary, nats, P the `f16` cache's next-token distribution.
    pub mean_kl: f64,
    /// Standard error of `mean_kl` by batch means over [`KL_BLOCK_TOKENS`]-token blocks;
    /// `None` with fewer than two full blocks.
    pub kl_stderr: Option<f64>,
    /// Mean KL of each full block of [`KL_BLOCK_TOKENS`] scored positions, in text order (what
    /// [`Report::kl_difference`] pairs).
    pub kl_blocks: Vec<f64>,
    /// 99th percentile of the per-token KL.
    pub p99_kl: f64,
    /// Fraction of tokens whose most likely next token is the baseline's.
    pub top1: f64,
    /// Mean negative log-likelihood of the text's next tokens, nats.
    pub nll: f64,
    /// `nll` minus the baseline's.
    pub delta_nll: f64,
    pub perplexity: f64,
    /// Cache bytes per token of the whole model (every layer and KV head, K and V), everything
    /// included (scales, minimums, outlier stores, sinks, residual windows), at the evaluated
    /// length ([`Scheme::memory`]).
    pub bytes_per_token: f64,
    /// Bits per cached element once pages are full ([`Scheme::bytes_per_token`]).
    pub bits_per_element: f64,
    /// Outliers (elements outside the calibrated range) that found no free slot in their token's
    /// sparse store and stayed in the dense row instead, over all layers; 0 without `outliers`.
    pub outliers_dropped: u64,
    pub depth: Vec<DepthBucket>,
}

/// The whole evaluation.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Report {
    /// The model's KV shape: layers, KV heads, head_dim (`hipkv info --eval` checks it).
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens run through the model.
    pub tokens: usize,
    /// Tokens scored: every position that has a next token.
    pub scored: usize,
    pub chunk: usize,
    /// The baseline's (`f16` cache) mean NLL and perplexity.
    pub baseline_nll: f64,
    pub baseline_perplexity: f64,
    pub schemes: Vec<SchemeReport>,
}

/// The scheme every other is compared against.
pub fn baseline_scheme() -> Scheme {
    Scheme::uniform(crate::Format::F16)
}

/// Runs the baseline and every scheme over `tokens`, in chunks of `chunk`, and measures each
/// scheme against the baseline. A scheme with a calibration in `calibrations` (of that scheme)
/// uses it; the others calibrate each layer on its first chunk. `progress` is told the tokens
/// done after every chunk of every run (the total is `tokens.len() × (schemes.len() + 1)`).
pub fn evaluate(
    model: &Model,
    tokens: &[u32],
    schemes: &[Scheme],
    calibrations: &[Calibration],
    chunk: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Report, EvalError> {
    let cfg = *model.config();
    check_run(&cfg, tokens, chunk)?;
    if schemes.is_empty() {
        return Err(EvalError::NoSchemes);
    }
    let n = tokens.len();
    let mut runs = schemes
        .iter()
        .map(|s| {
            let mut run = CacheAttention::new(&cfg, *s, n)?;
            if let Some(c) = calibrations.iter().find(|c| c.scheme.stores_like(s)) {
                run.apply_calibration(c)?;
            }
            Ok(run)
        })
        .collect::<Result<Vec<_>, EvalError>>()?;
    let mut dyn_runs: Vec<&mut dyn Attention> =
        runs.iter_mut().map(|r| r as &mut dyn Attention).collect();
    let (baseline_nll, stats) = measure(model, tokens, chunk, &mut dyn_runs, progress)?;
    let reports = runs
        .iter()
        .zip(&stats)
        .map(|(run, stats)| scheme_report(&cfg, run, stats, baseline_nll))
        .collect();
    Ok(Report {
        layers: cfg.layers,
        kv_heads: cfg.kv_heads,
        head_dim: cfg.head_dim,
        tokens: n,
        scored: n - 1,
        chunk,
        baseline_nll,
        baseline_perplexity: baseline_nll.exp(),
        schemes: reports,
    })
}

/// How much of a scheme's KL each layer causes: the scheme in every layer, then in one layer at a
/// time with the others f16 ([`layer_sensitivity`]).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LayerSensitivity {
    pub scheme: String,
    /// Mean KL with every layer in the scheme.
    pub mean_kl: f64,
    /// Per layer: mean KL with only that layer in the scheme.
    pub layer_kl: Vec<f64>,
}

/// Runs `scheme` over `tokens` in all layers and then in each layer alone (every other layer
/// f16): `layers + 1` runs beside the baseline. Where the layers' KLs sum to about the whole
/// scheme's, they add, and a per-layer choice of precision can be planned from them.
pub fn layer_sensitivity(
    model: &Model,
    tokens: &[u32],
    scheme: Scheme,
    chunk: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<LayerSensitivity, EvalError> {
    let cfg = *model.config();
    check_run(&cfg, tokens, chunk)?;
    let n = tokens.len();
    let mut runs = vec![CacheAttention::new(&cfg, scheme, n)?];
    for layer in 0..cfg.layers {
        let schemes: Vec<Scheme> = (0..cfg.layers)
            .map(|l| {
                if l == layer {
                    scheme
                } else {
                    baseline_scheme()
                }
            })
            .collect();
        runs.push(CacheAttention::per_layer(&cfg, &schemes, n)?);
    }
    let mut dyn_runs: Vec<&mut dyn Attention> =
        runs.iter_mut().map(|r| r as &mut dyn Attention).collect();
    let (_, stats) = measure(model, tokens, chunk, &mut dyn_runs, progress)?;
    let kl = |s: &[TokenStats]| mean(s.iter().map(|s| s.kl));
    Ok(LayerSensitivity {
        scheme: scheme.to_string(),
        mean_kl: kl(&stats[0]),
        layer_kl: stats[1..].iter().map(|s| kl(s)).collect(),
    })
}

/// Mean KL(P‖Q) over `tokens` of each of `runs` (any [`Attention`]: a cache to be measured
/// that is not a [`Scheme`], such as a simulation of a format not built) against the f16
/// cache, run as [`evaluate`] runs schemes.
pub fn mean_kl_of(
    model: &Model,
    tokens: &[u32],
    chunk: usize,
    runs: &mut [&mut dyn Attention],
) -> Result<Vec<f64>, EvalError> {
    check_run(model.config(), tokens, chunk)?;
    let (_, stats) = measure(model, tokens, chunk, runs, &mut |_| {})?;
    Ok(stats.iter().map(|s| mean(s.iter().map(|s| s.kl))).collect())
}

/// The inputs [`evaluate`] and [`mean_kl_of`] refuse.
fn check_run(cfg: &ModelConfig, tokens: &[u32], chunk: usize) -> Result<(), EvalError> {
    if chunk == 0 {
        return Err(EvalError::NotPositive { what: "chunk" });
    }
    if tokens.len() < 2 {
        return Err(EvalError::TextTooShort {
            have: tokens.len(),
            want: 2,
        });
    }
    if tokens.len() > cfg.context {
        return Err(EvalError::BeyondContext {
            tokens: tokens.len(),
            context: cfg.context,
        });
    }
    Ok(())
}

/// Runs the f16 baseline and `runs` over `tokens` chunk by chunk; returns the baseline's mean
/// NLL of the next tokens and each run's statistics per scored position.
fn measure(
    model: &Model,
    tokens: &[u32],
    chunk: usize,
    runs: &mut [&mut dyn Attention],
    progress: &mut dyn FnMut(usize),
) -> Result<(f64, Vec<Vec<TokenStats>>), EvalError> {
    let cfg = *model.config();
    let n = tokens.len();
    let scored = n - 1;
    let mut baseline = CacheAttention::new(&cfg, baseline_scheme(), n)?;
    let mut base_nll = Vec::with_capacity(scored);
    let mut stats: Vec<Vec<TokenStats>> = vec![Vec::with_capacity(scored); runs.len()];
    let mut done = 0;
    for start in (0..n).step_by(chunk) {
        let end = (start + chunk).min(n);
        let ids = &tokens[start..end];
        // Positions of this chunk that have a next token.
        let rows = end.min(scored) - start;
        let next = &tokens[start + 1..start + 1 + rows];
        let p = model.forward(ids, &mut baseline)?;
        done += ids.len();
        progress(done);
        let v = cfg.vocab;
        base_nll.extend(
            p.par_chunks_exact(v)
                .zip(next.par_iter())
                .map(|(p, &t)| log_sum_exp(p).0 - f64::from(p[t as usize]))
                .collect::<Vec<_>>(),
        );
        for (run, stats) in runs.iter_mut().zip(&mut stats) {
            let q = model.forward(ids, *run)?;
            stats.extend(
                p.par_chunks_exact(v)
                    .zip(q.par_chunks_exact(v))
                    .zip(next.par_iter())
                    .map(|((p, q), &t)| compare(p, q, t))
                    .collect::<Vec<_>>(),
            );
            done += ids.len();
            progress(done);
        }
    }
    Ok((mean(base_nll.iter().copied()), stats))
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, count) = xs.fold((0.0, 0usize), |(s, c), x| (s + x, c + 1));
    sum / count.max(1) as f64
}

/// The `q`-quantile of `xs` by nearest rank.
fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied().unwrap_or(0.0)
}

fn scheme_report(
    cfg: &ModelConfig,
    run: &CacheAttention,
    stats: &[TokenStats],
    baseline_nll: f64,
) -> SchemeReport {
    let scheme = run.scheme();
    let tokens = run.capacity();
    let kl: Vec<f64> = stats.iter().map(|s| s.kl).collect();
    let nll = mean(stats.iter().map(|s| s.nll));
    let top1 = |s: &[TokenStats]| mean(s.iter().map(|s| f64::from(u8::from(s.top1))));
    let depth = DEPTH_BUCKETS
        .iter()
        .map(|&(from, to)| {
            let s = &stats[from.min(stats.len())..to.min(stats.len())];
            DepthBucket {
                from,
                to,
                tokens: s.len(),
                mean_kl: (!s.is_empty()).then(|| mean(s.iter().map(|s| s.kl))),
                top1: (!s.is_empty()).then(|| top1(s)),
            }
        })
        .collect();
    let per_head = scheme.memory(cfg.head_dim, tokens).bytes_per_token();
    let kl_blocks: Vec<f64> = kl
        .chunks_exact(KL_BLOCK_TOKENS)
        .map(|b| mean(b.iter().copied()))
        .collect();
    SchemeReport {
        scheme: scheme.to_string(),
        mean_kl: mean(kl.iter().copied()),
        kl_stderr: mean_and_stderr(&kl_blocks).map(|(_, se)| se),
        kl_blocks,
        p99_kl: quantile(&kl, 0.99),
        top1: top1(stats),
        nll,
        delta_nll: nll - baseline_nll,
        perplexity: nll.exp(),
        bytes_per_token: per_head * (cfg.layers * cfg.kv_heads) as f64,
        bits_per_element: scheme.bytes_per_token(cfg.head_dim) * 8.0 / (2 * cfg.head_dim) as f64,
        outliers_dropped: run.outliers_dropped(),
        depth,
    }
}

/// The byte budgets of `hipkv eval --frontier`, per token and KV head at head_dim 64, counted as
/// [`Scheme::bytes_per_token`] counts (full pages: codes, parameters, outlier stores; the
/// per-sequence f16 sinks and windows apart): llama.cpp's `q8_0` (136), then 72, 56 and 40 (4.5,
/// 3.5 and 2.5 bits per element). At another head_dim, the same fractions of f16's bytes.
pub const FRONTIER_BUDGETS_D64: [f64; 4] = [136.0, 72.0, 56.0, 40.0];

/// One byte budget of the frontier and the scheme of least mean KL within it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FrontierPoint {
    /// Bytes per token per KV head at the model's head_dim.
    pub budget: f64,
    /// The scheme (an index into [`Report::schemes`]) of least mean KL among those whose
    /// [`Report::page_bytes_per_token`] is within the budget; `None` when none is.
    pub best: Option<usize>,
    /// The one of next least mean KL within the budget, to tell whether `best` wins beyond the
    /// noise ([`Report::kl_difference`]).
    pub runner_up: Option<usize>,
}

impl Report {
    /// Bytes per token per KV head of scheme `i` (K and V) in full pages, what the frontier's
    /// budgets count ([`Scheme::bytes_per_token`]).
    pub fn page_bytes_per_token(&self, i: usize) -> f64 {
        self.schemes[i].bits_per_element * (2 * self.head_dim) as f64 / 8.0
    }

    /// Bytes per token per KV head of scheme `i`, everything included at the evaluated length
    /// (sinks and the residual and value windows shared by the sequence's tokens).
    pub fn head_bytes_per_token(&self, i: usize) -> f64 {
        self.schemes[i].bytes_per_token / (self.layers * self.kv_heads) as f64
    }

    /// For each of [`FRONTIER_BUDGETS_D64`] (scaled to the model's head_dim), the measured scheme
    /// of least mean KL that fits in it.
    pub fn frontier(&self) -> Vec<FrontierPoint> {
        FRONTIER_BUDGETS_D64
            .iter()
            .map(|b| {
                let budget = b * self.head_dim as f64 / 64.0;
                let mut fits: Vec<usize> = (0..self.schemes.len())
                    .filter(|&i| self.page_bytes_per_token(i) <= budget)
                    .collect();
                fits.sort_by(|&a, &b| self.schemes[a].mean_kl.total_cmp(&self.schemes[b].mean_kl));
                FrontierPoint {
                    budget,
                    best: fits.first().copied(),
                    runner_up: fits.get(1).copied(),
                }
            })
            .collect()
    }

    /// Mean KL of scheme `a` minus scheme `b` over the same full blocks of text, and the
    /// standard error of that difference (paired batch means: the schemes see the same tokens,
    /// so their noise largely cancels in the difference); `None` with fewer than two blocks.
    pub fn kl_difference(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        let diffs: Vec<f64> = self.schemes[a]
            .kl_blocks
            .iter()
            .zip(&self.schemes[b].kl_blocks)
            .map(|(x, y)| x - y)
            .collect();
        mean_and_stderr(&diffs)
    }
}

/// Parses a scheme list: separated by `;`, or by `,` where each scheme starts with a preset
/// name or `k=` (so `f16,q8,kivi2,pre_rope` is three schemes, the last with `pre_rope`).
pub fn parse_schemes(list: &str) -> crate::Result<Vec<Scheme>> {
    let parts: Vec<String> = if list.contains(';') {
        list.split(';').map(|s| s.trim().to_string()).collect()
    } else {
        let mut parts: Vec<String> = Vec::new();
        for item in list.split(',').map(str::trim) {
            let starts = crate::scheme::preset_names().any(|p| p == item) || item.starts_with("k=");
            match parts.last_mut() {
                Some(last) if !starts => {
                    last.push(',');
                    last.push_str(item);
                }
                _ => parts.push(item.to_string()),
            }
        }
        parts
    };
    parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| p.parse())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_logits_have_zero_kl_and_agree() {
        let p = [0.5f32, -1.0, 3.0, 2.0];
        let s = compare(&p, &p, 2);
        assert_eq!(s.kl, 0.0);
        assert!(s.top1);
        let (lse, arg) = log_sum_exp(&p);
        assert_eq!(arg, 2);
        assert!((s.nll - (lse - 3.0)).abs() < 1e-12);
    }

    #[test]
    fn kl_matches_a_hand_computed_value() {
        // P = (1/2, 1/2), Q = (1/4, 3/4): KL = ½ ln 2 + ½ ln(2/3).
        let p = [0.0f32, 0.0];
        let q = [0.0f32, 3f32.ln()];
        let s = compare(&p, &q, 0);
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((s.kl - want).abs() < 1e-6, "{} vs {want}", s.kl);
        assert!(!s.top1);
        assert!((s.nll - 4f64.ln()).abs() < 1e-6);
    }

    #[test]
    fn stderr_is_the_sample_sd_over_root_n() {
        assert_eq!(mean_and_stderr(&[1.0]), None);
        // Mean 2.5, sample variance 5/3, standard error √(5/3 / 4).
        let (m, se) = mean_and_stderr(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(m, 2.5);
        assert!((se - (5.0f64 / 12.0).sqrt()).abs() < 1e-15);
        assert_eq!(mean_and_stderr(&[7.0, 7.0, 7.0]), Some((7.0, 0.0)));
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let xs: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(quantile(&xs, 0.99), 198.0);
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
    }

    #[test]
    fn scheme_lists_split_on_scheme_starts() {
        let s = parse_schemes("f16,q8,kivi2,pre_rope,kivi2,outliers,pre_rope").unwrap();
        let names: Vec<String> = s.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            names,
            ["f16", "q8", "kivi2,pre_rope", "kivi2,pre_rope,outliers"]
        );
        let s = parse_schemes("kv4,kv3,sinks=0,kv2").unwrap();
        let names: Vec<String> = s.iter().map(|s| s.to_string()).collect();
        assert_eq!(names, ["kv4", "kv3,sinks=0", "kv2"]);
        let s = parse_schemes("k=q2_chan,v=q4_tok;q8").unwrap();
        assert_eq!(s.len(), 2);
        assert!(parse_schemes("f16,bogus").is_err());
    }

    #[test]
    fn the_frontier_takes_the_least_kl_within_each_budget() {
        // Full-page bytes per token per KV head given; the totals are 10 bytes more (windows).
        let scheme = |name: &str, bytes: f64, mean_kl: f64| SchemeReport {
            scheme: name.into(),
            mean_kl,
            kl_stderr: Some(0.0),
            kl_blocks: vec![mean_kl; 2],
            p99_kl: 0.0,
            top1: 1.0,
            nll: 0.0,
            delta_nll: 0.0,
            perplexity: 1.0,
            bytes_per_token: 3.0 * (bytes + 10.0),
            bits_per_element: bytes * 8.0 / 128.0,
            outliers_dropped: 0,
            depth: Vec::new(),
        };
        let report = Report {
            layers: 3,
            kv_heads: 1,
            head_dim: 64,
            tokens: 2,
            scored: 1,
            chunk: 2,
            baseline_nll: 0.0,
            baseline_perplexity: 1.0,
            schemes: vec![
                scheme("a", 136.0, 1e-3),
                scheme("b", 132.0, 2e-3),
                scheme("c", 72.5, 1e-4),
                scheme("d", 70.0, 0.5),
                scheme("e", 56.0, 0.2),
            ],
        };
        let best: Vec<Option<usize>> = report.frontier().iter().map(|p| p.best).collect();
        // c is best overall but 0.5 byte over 72; nothing fits 40.
        assert_eq!(best, [Some(2), Some(4), Some(4), None]);
        let next: Vec<Option<usize>> = report.frontier().iter().map(|p| p.runner_up).collect();
        assert_eq!(next, [Some(0), Some(3), None, None]);
        let (d, se) = report.kl_difference(0, 2).unwrap();
        assert!((d - 9e-4).abs() < 1e-15 && se == 0.0, "{d} ± {se}");
        assert_eq!(report.head_bytes_per_token(4), 66.0);
        let mut wide = report.clone();
        wide.head_dim = 256;
        assert_eq!(wide.frontier()[1].budget, 288.0);
    }
}
