//! A Llama-family or Gemma-3 model read from a GGUF file, run on the CPU, with every layer's
//! attention handed to an [`Attention`] implementation (the hipkv cache in the scheme under test).
//!
//! Gemma-3 as llama.cpp runs it: embeddings scaled by √hidden, RMS-normed queries and keys per
//! head (QK-norm) before RoPE over halves, norms after attention and after the feed-forward
//! block, GELU (tanh) gating, and every sixth layer global (RoPE base from the file) while the
//! others attend to a sliding window with RoPE base 10 000. The file's norm weights already
//! include Gemma's `1 +`.
//!
//! The weights are read as shipped (Q4_1, Q8_0, F32, ...) and dequantized once to f32, which is
//! exact: every quantized weight is `scale · q (+ min)` with f16 parameters, representable in f32.
//! Matmuls then run in f32 (candle's CPU `matmul`), so the activations are not requantized either;
//! llama.cpp instead quantizes activations to 8 bits for its integer dot products, which moves
//! the logits slightly but is identical in every scheme's run, as is everything here but the cache.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::Content;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::fit::KvShape;
use super::tokenizer::Tokenizer;
use super::{EvalError, metadata};
use crate::{Rope, RopeLayout};

/// The model families this module runs (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Gemma3,
}

/// Gemma-3's layer pattern: every sixth layer is global, the others slide (llama.cpp's
/// `set_swa_pattern(6)`).
const GEMMA3_GLOBAL_EVERY: usize = 6;
/// Gemma-3's RoPE base of sliding-window layers (llama.cpp's `rope_freq_base_train_swa`).
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Shape and hyperparameters of a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// Context length the model was trained for.
    pub context: usize,
    pub rms_eps: f32,
    /// RoPE base of the global layers (every layer of a Llama).
    pub rope_base: f32,
    /// Tokens a sliding-window layer attends to (itself and the `window − 1` before it), for
    /// models with such layers.
    pub sliding_window: Option<usize>,
}

/// Gemma-3's extra norms of one block.
struct GemmaNorms {
    /// Per head of Q and of K (`head_dim`), before RoPE.
    q: Vec<f32>,
    k: Vec<f32>,
    /// On the attention output and on the feed-forward output, before each joins the residual.
    post_attention: Vec<f32>,
    post_ffn: Vec<f32>,
}

/// One transformer block's weights, transposed to `in × out` for `x · W`.
struct Block {
    attn_norm: Vec<f32>,
    /// Q, K and V projections side by side: `hidden × (q + 2 kv) · head_dim`.
    qkv: Tensor,
    out: Tensor,
    ffn_norm: Vec<f32>,
    /// Gate and up projections side by side: `hidden × 2 ffn`.
    gate_up: Tensor,
    down: Tensor,
    gemma: Option<GemmaNorms>,
}

/// A Llama-family or Gemma-3 model on the CPU.
pub struct Model {
    config: ModelConfig,
    /// `vocab × hidden`, row per token.
    embedding: Vec<f32>,
    blocks: Vec<Block>,
    output_norm: Vec<f32>,
    /// `hidden × vocab` (the embedding, transposed, when the model ties them).
    lm_head: Tensor,
}

/// Where every layer's attention happens: the model hands over one chunk of `n` tokens' queries,
/// keys and values, all unrotated (`n × heads × head_dim`), and takes back the attention output
/// (`n × q_heads × head_dim`) of those tokens, each attending causally to every token before it
/// and itself (within [`ModelConfig::window`] on sliding-window layers), after RoPE as
/// [`ModelConfig::layer_rope`] says and scaled by [`ModelConfig::softmax_scale`]. Positions
/// continue from the previous chunk.
pub trait Attention {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), EvalError>;
}

/// The `<arch>.*` keys of a GGUF header, named as llama.cpp's conversions name them.
struct ArchKeys<'c> {
    content: &'c Content,
    /// `general.architecture`.
    arch: String,
}

impl<'c> ArchKeys<'c> {
    fn new(content: &'c Content) -> Result<ArchKeys<'c>, EvalError> {
        let arch = metadata(content, "general.architecture")?
            .to_string()
            .map_err(EvalError::Gguf)?
            .clone();
        Ok(ArchKeys { content, arch })
    }

    fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.arch)
    }

    fn contains(&self, name: &str) -> bool {
        self.content.metadata.contains_key(&self.key(name))
    }

    fn usize(&self, name: &str) -> Result<usize, EvalError> {
        let v = metadata(self.content, &self.key(name))?;
        let n = v
            .to_u32()
            .map(u64::from)
            .or_else(|_| v.to_u64())
            .map_err(EvalError::Gguf)?;
        Ok(n as usize)
    }

    fn optional(&self, name: &str) -> Result<Option<usize>, EvalError> {
        self.contains(name).then(|| self.usize(name)).transpose()
    }

    fn f32(&self, name: &str) -> Result<f32, EvalError> {
        metadata(self.content, &self.key(name))?
            .to_f32()
            .map_err(EvalError::Gguf)
    }

    /// Query heads, KV heads (the query heads when the file does not say: no GQA) and head_dim
    /// (`attention.key_length`, or else the embedding over the query heads).
    fn attention_shape(&self) -> Result<(usize, usize, usize), EvalError> {
        let q_heads = self.usize("attention.head_count")?;
        let kv_heads = self.optional("attention.head_count_kv")?.unwrap_or(q_heads);
        if q_heads == 0 || kv_heads == 0 || q_heads % kv_heads != 0 {
            return Err(EvalError::UnsupportedModel {
                what: "head counts (query heads a multiple of KV heads)",
                value: format!("{q_heads} query heads, {kv_heads} KV heads"),
            });
        }
        let head_dim = match self.optional("attention.key_length")? {
            Some(d) => d,
            None => {
                let hidden = self.usize("embedding_length")?;
                if hidden % q_heads != 0 {
                    return Err(EvalError::UnsupportedModel {
                        what: "head_dim (no key_length, and hidden not a multiple of the query heads)",
                        value: format!("hidden {hidden}, {q_heads} query heads"),
                    });
                }
                hidden / q_heads
            }
        };
        Ok((q_heads, kv_heads, head_dim))
    }
}

impl ModelConfig {
    /// Reads the `<arch>.*` keys of a GGUF file and checks that this module can run the model.
    pub fn from_gguf(content: &Content) -> Result<ModelConfig, EvalError> {
        let keys = ArchKeys::new(content)?;
        let architecture = match keys.arch.as_str() {
            "llama" => Architecture::Llama,
            "gemma3" => Architecture::Gemma3,
            _ => {
                return Err(EvalError::UnsupportedModel {
                    what: "general.architecture (llama or gemma3)",
                    value: keys.arch.clone(),
                });
            }
        };
        let (q_heads, kv_heads, head_dim) = keys.attention_shape()?;
        let vocab = match keys.optional("vocab_size")? {
            Some(n) => n,
            None => metadata(content, "tokenizer.ggml.tokens")?
                .to_vec()
                .map_err(EvalError::Gguf)?
                .len(),
        };
        if let Some(v) = keys.optional("attention.value_length")?
            && v != head_dim
        {
            return Err(EvalError::UnsupportedModel {
                what: "attention.value_length (equal to key_length)",
                value: v.to_string(),
            });
        }
        let sliding_window = match architecture {
            Architecture::Llama => None,
            Architecture::Gemma3 => Some(keys.usize("attention.sliding_window")?),
        };
        let config = ModelConfig {
            architecture,
            layers: keys.usize("block_count")?,
            hidden: keys.usize("embedding_length")?,
            ffn: keys.usize("feed_forward_length")?,
            q_heads,
            kv_heads,
            head_dim,
            vocab,
            context: keys.usize("context_length")?,
            rms_eps: keys.f32("attention.layer_norm_rms_epsilon")?,
            rope_base: if keys.contains("rope.freq_base") {
                keys.f32("rope.freq_base")?
            } else {
                10_000.0
            },
            sliding_window,
        };
        if let Some(dims) = keys.optional("rope.dimension_count")?
            && dims != head_dim
        {
            return Err(EvalError::UnsupportedModel {
                what: "rope.dimension_count (RoPE over the whole head only)",
                value: dims.to_string(),
            });
        }
        for name in [
            "rope.scaling.type",
            "rope.scaling.factor",
            "final_logit_softcapping",
        ] {
            if let Some(v) = content.metadata.get(&keys.key(name)) {
                return Err(EvalError::UnsupportedModel {
                    what: "RoPE scaling or logit soft-capping (neither is implemented)",
                    value: format!("{}: {v:?}", keys.key(name)),
                });
            }
        }
        Ok(config)
    }

    /// Whether `layer` attends to a sliding window (Gemma-3: all but every sixth).
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some() && layer % GEMMA3_GLOBAL_EVERY != GEMMA3_GLOBAL_EVERY - 1
    }

    /// Tokens `layer` attends to: its window on a sliding-window layer, else everything.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.is_sliding(layer))
    }

    /// RoPE of `layer`'s queries and keys, as llama.cpp applies it to this architecture's GGUF
    /// tensors: a Llama's Q and K are stored permuted to interleaved pairs, Gemma's are not
    /// (pairs of halves); Gemma's sliding-window layers use base 10 000.
    pub fn layer_rope(&self, layer: usize) -> Rope {
        match self.architecture {
            Architecture::Llama => Rope {
                base: self.rope_base,
                layout: RopeLayout::Interleaved,
            },
            Architecture::Gemma3 => Rope {
                base: if self.is_sliding(layer) {
                    GEMMA3_LOCAL_ROPE_BASE
                } else {
                    self.rope_base
                },
                layout: RopeLayout::Halves,
            },
        }
    }

    /// The attention's score scale, `1/√head_dim` (Gemma-3 270M's `query_pre_attn_scalar` is its
    /// head_dim, as llama.cpp assumes for every Gemma-3 but the 27B).
    pub fn softmax_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Reads one tensor and dequantizes it to f32.
fn read_tensor(
    content: &Content,
    file: &mut BufReader<File>,
    name: &str,
) -> Result<Tensor, EvalError> {
    if !content.tensor_infos.contains_key(name) {
        return Err(EvalError::MissingTensor {
            name: name.to_string(),
        });
    }
    let q = content.tensor(file, name, &Device::Cpu)?;
    Ok(q.dequantize(&Device::Cpu)?)
}

/// Reads a tensor of `rows × cols` (GGUF: `cols` fastest), checking its shape.
fn read_matrix(
    content: &Content,
    file: &mut BufReader<File>,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Tensor, EvalError> {
    let t = read_tensor(content, file, name)?;
    if t.dims() != [rows, cols] {
        return Err(EvalError::TensorShape {
            name: name.to_string(),
            expected: vec![rows, cols],
            got: t.dims().to_vec(),
        });
    }
    Ok(t)
}

fn read_vector(
    content: &Content,
    file: &mut BufReader<File>,
    name: &str,
    len: usize,
) -> Result<Vec<f32>, EvalError> {
    let t = read_tensor(content, file, name)?;
    if t.dims() != [len] {
        return Err(EvalError::TensorShape {
            name: name.to_string(),
            expected: vec![len],
            got: t.dims().to_vec(),
        });
    }
    Ok(t.to_vec1()?)
}

/// `in × out` contiguous, from GGUF's `out × in`.
fn transposed(w: &Tensor) -> Result<Tensor, EvalError> {
    Ok(w.t()?.contiguous()?)
}

/// Opens a GGUF file and reads its header (metadata and tensor directory).
fn open_gguf(path: &Path) -> Result<(Content, BufReader<File>), EvalError> {
    let file = File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            EvalError::ModelMissing {
                path: path.to_path_buf(),
            }
        } else {
            EvalError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let mut file = BufReader::new(file);
    let content = Content::read(&mut file)?;
    Ok((content, file))
}

/// What sizes a GGUF model's KV cache on a card, read from its header alone.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSummary {
    /// `general.architecture` (`llama`, `gemma3`, `qwen3`, ...).
    pub architecture: String,
    pub shape: KvShape,
    /// `<arch>.attention.sliding_window`: tokens a sliding-window layer attends to, for models
    /// that have such layers.
    pub sliding_window: Option<usize>,
    /// Bytes of the weights as stored (every tensor in its stored type: what a GPU engine
    /// loading the file holds).
    pub weight_bytes: u64,
}

/// A GGUF model's KV shape and weight bytes, of any architecture that names them the way
/// llama.cpp's conversions do (`<arch>.block_count`, `<arch>.attention.head_count_kv`,
/// `<arch>.attention.key_length` or else the embedding over the query heads), without loading
/// the weights.
pub fn inspect(path: &Path) -> Result<ModelSummary, EvalError> {
    let (content, _) = open_gguf(path)?;
    let keys = ArchKeys::new(&content)?;
    let (_, kv_heads, head_dim) = keys.attention_shape()?;
    let shape = KvShape {
        layers: keys.usize("block_count")?,
        kv_heads,
        head_dim,
    };
    let weight_bytes = content
        .tensor_infos
        .values()
        .map(|t| {
            let dtype = t.ggml_dtype;
            (t.shape.elem_count() / dtype.block_size() * dtype.type_size()) as u64
        })
        .sum();
    Ok(ModelSummary {
        sliding_window: keys.optional("attention.sliding_window")?,
        architecture: keys.arch,
        shape,
        weight_bytes,
    })
}

impl Model {
    /// Loads a Llama-family or Gemma-3 GGUF file and its tokenizer.
    pub fn load(path: &Path) -> Result<(Model, Tokenizer), EvalError> {
        let (content, mut file) = open_gguf(path)?;
        let config = ModelConfig::from_gguf(&content)?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let c = config;
        let (q_width, kv_width) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let embedding = read_matrix(&content, &mut file, "token_embd.weight", c.vocab, c.hidden)?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            let w = read_matrix(&content, &mut file, "output.weight", c.vocab, c.hidden)?;
            transposed(&w)?
        } else {
            transposed(&embedding)?
        };
        let embedding = embedding.flatten_all()?.to_vec1()?;
        let mut blocks = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let name = |w: &str| format!("blk.{l}.{w}.weight");
            let mut matrix =
                |w: &str, rows, cols| read_matrix(&content, &mut file, &name(w), rows, cols);
            let q = matrix("attn_q", q_width, c.hidden)?;
            let k = matrix("attn_k", kv_width, c.hidden)?;
            let v = matrix("attn_v", kv_width, c.hidden)?;
            let out = matrix("attn_output", c.hidden, q_width)?;
            let gate = matrix("ffn_gate", c.ffn, c.hidden)?;
            let up = matrix("ffn_up", c.ffn, c.hidden)?;
            let down = matrix("ffn_down", c.hidden, c.ffn)?;
            let mut vector = |w: &str, len| read_vector(&content, &mut file, &name(w), len);
            let gemma = match c.architecture {
                Architecture::Llama => None,
                Architecture::Gemma3 => Some(GemmaNorms {
                    q: vector("attn_q_norm", c.head_dim)?,
                    k: vector("attn_k_norm", c.head_dim)?,
                    post_attention: vector("post_attention_norm", c.hidden)?,
                    post_ffn: vector("post_ffw_norm", c.hidden)?,
                }),
            };
            blocks.push(Block {
                attn_norm: read_vector(&content, &mut file, &name("attn_norm"), c.hidden)?,
                qkv: transposed(&Tensor::cat(&[&q, &k, &v], 0)?)?,
                out: transposed(&out)?,
                ffn_norm: read_vector(&content, &mut file, &name("ffn_norm"), c.hidden)?,
                gate_up: transposed(&Tensor::cat(&[&gate, &up], 0)?)?,
                down: transposed(&down)?,
                gemma,
            });
        }
        let output_norm = read_vector(&content, &mut file, "output_norm.weight", c.hidden)?;
        Ok((
            Model {
                config,
                embedding,
                blocks,
                output_norm,
                lm_head,
            },
            tokenizer,
        ))
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs one chunk of tokens through the model, each layer's attention through `attention`,
    /// and returns the logits of every token of the chunk (`n × vocab`).
    pub fn forward(
        &self,
        tokens: &[u32],
        attention: &mut dyn Attention,
    ) -> Result<Vec<f32>, EvalError> {
        let c = &self.config;
        let n = tokens.len();
        let (q_width, kv_width) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut x = Vec::with_capacity(n * c.hidden);
        for &t in tokens {
            let t = t as usize;
            if t >= c.vocab {
                return Err(EvalError::TokenOutOfVocab {
                    token: t,
                    vocab: c.vocab,
                });
            }
            x.extend_from_slice(&self.embedding[t * c.hidden..(t + 1) * c.hidden]);
        }
        if c.architecture == Architecture::Gemma3 {
            let scale = (c.hidden as f32).sqrt();
            x.iter_mut().for_each(|x| *x *= scale);
        }
        let mut attn = vec![0.0f32; n * q_width];
        for (l, b) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &b.attn_norm, c.rms_eps);
            let qkv = matmul(&h, n, &b.qkv)?;
            let width = q_width + 2 * kv_width;
            let mut q = Vec::with_capacity(n * q_width);
            let mut k = Vec::with_capacity(n * kv_width);
            let mut v = Vec::with_capacity(n * kv_width);
            for row in qkv.chunks_exact(width) {
                q.extend_from_slice(&row[..q_width]);
                k.extend_from_slice(&row[q_width..q_width + kv_width]);
                v.extend_from_slice(&row[q_width + kv_width..]);
            }
            if let Some(g) = &b.gemma {
                q = rms_norm(&q, &g.q, c.rms_eps);
                k = rms_norm(&k, &g.k, c.rms_eps);
            }
            attention.attend(l, &q, &k, &v, &mut attn)?;
            let mut o = matmul(&attn, n, &b.out)?;
            if let Some(g) = &b.gemma {
                o = rms_norm(&o, &g.post_attention, c.rms_eps);
            }
            add(&mut x, &o);
            let h = rms_norm(&x, &b.ffn_norm, c.rms_eps);
            let gate_up = matmul(&h, n, &b.gate_up)?;
            let activation = match c.architecture {
                Architecture::Llama => silu,
                Architecture::Gemma3 => gelu_tanh,
            };
            let act: Vec<f32> = gate_up
                .par_chunks_exact(2 * c.ffn)
                .flat_map_iter(|row| {
                    let (g, u) = row.split_at(c.ffn);
                    g.iter().zip(u).map(|(&g, &u)| activation(g) * u)
                })
                .collect();
            let mut f = matmul(&act, n, &b.down)?;
            if let Some(g) = &b.gemma {
                f = rms_norm(&f, &g.post_ffn, c.rms_eps);
            }
            add(&mut x, &f);
        }
        let h = rms_norm(&x, &self.output_norm, c.rms_eps);
        matmul(&h, n, &self.lm_head)
    }
}

/// `x · w` for `x` of `n` rows.
fn matmul(x: &[f32], n: usize, w: &Tensor) -> Result<Vec<f32>, EvalError> {
    let x = Tensor::from_slice(x, (n, x.len() / n), &Device::Cpu)?;
    Ok(x.matmul(w)?.flatten_all()?.to_vec1()?)
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let mut out = vec![0.0; x.len()];
    out.par_chunks_exact_mut(d)
        .zip(x.par_chunks_exact(d))
        .for_each(|(o, x)| {
            let ms = x.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / d as f64;
            let inv = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
            for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
                *o = x * inv * w;
            }
        });
    out
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`, llama.cpp's `ggml_gelu`).
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
}
