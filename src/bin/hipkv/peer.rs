//! llama.cpp as an in-process peer of `hipkv bench --peer llama.cpp` (feature `peer-llamacpp`).
//!
//! The same decode step as hipkv's bench rows, built in ggml as llama.cpp builds it: per
//! sequence a K and a V tensor of `context` rows of `kv_heads × head_dim` elements (llama.cpp's
//! cache layout, one row per token), viewed per head and permuted as `llama-graph.cpp` does, and
//! one `ggml_flash_attn_ext` of a single query token with GQA by broadcasting. The CPU backend
//! runs on a persistent thread pool of as many threads as hipkv's, as llama.cpp's tools attach
//! one; a GPU build (`peer-llamacpp-rocm`) runs the same graph on ggml's HIP backend.

use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::time::Instant;

use hipkv::Scheme;
use hipkv::synth::TokenPool;

use crate::{CHUNK, CliError, Peer, Stepper, sequences_for};
use llama_cpp_sys_2 as ggml;
use serde::Serialize;

/// Every `ggml_init` context holds tensor and graph metadata only; the data lives in one backend
/// buffer.
const METADATA_SLACK: usize = 1 << 16;
/// Quantized ggml types pack 32 elements per block (`QK8_0`, `QK4_0`).
const GGML_BLOCK: usize = 32;

/// llama.cpp's cache type that a hipkv scheme is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PeerType {
    #[serde(rename = "f16")]
    F16,
    #[serde(rename = "q8_0")]
    Q8_0,
    #[serde(rename = "q4_0")]
    Q4_0,
}

impl PeerType {
    /// f16 against f16, 8-bit schemes against `q8_0`, every scheme below 8 bits against `q4_0`,
    /// the usual 4-bit choice for llama.cpp's cache.
    pub fn for_scheme(scheme: Scheme) -> PeerType {
        match scheme.k.nominal_bits().max(scheme.v.nominal_bits()) {
            16.. => PeerType::F16,
            8.. => PeerType::Q8_0,
            _ => PeerType::Q4_0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PeerType::F16 => "f16",
            PeerType::Q8_0 => "q8_0",
            PeerType::Q4_0 => "q4_0",
        }
    }

    /// Bytes of one token's row of `width` elements in llama.cpp's cache.
    pub fn row_bytes(self, width: usize) -> usize {
        // SAFETY: a pure function of its arguments.
        unsafe { ggml::ggml_row_size(self.ggml(), width as i64) }
    }

    fn ggml(self) -> ggml::ggml_type {
        match self {
            PeerType::F16 => ggml::GGML_TYPE_F16,
            PeerType::Q8_0 => ggml::GGML_TYPE_Q8_0,
            PeerType::Q4_0 => ggml::GGML_TYPE_Q4_0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("llama.cpp's {0} backend did not start")]
    Backend(&'static str),
    #[error(
        "this hipkv's llama.cpp has no GPU backend: build it with the `peer-llamacpp-rocm` \
         feature to compare on a GPU"
    )]
    NoGpu,
    #[error("llama.cpp's thread pool of {0} threads did not start")]
    ThreadPool(usize),
    #[error(
        "llama.cpp's {ty} blocks hold 32 elements, so head_dim must be a multiple of 32, not {head_dim}"
    )]
    HeadDim { ty: &'static str, head_dim: usize },
    #[error("ggml could not allocate the {0} tensors")]
    Alloc(&'static str),
    #[error("ggml's graph compute failed with status {0}")]
    Compute(i32),
}

/// The model shape of a step.
#[derive(Clone, Copy, Debug)]
pub struct PeerShape {
    pub kv_heads: usize,
    pub q_heads: usize,
    pub head_dim: usize,
}

/// A ggml backend and, on the CPU, the thread pool its graphs run on.
pub struct LlamaCpp {
    backend: NonNull<ggml::ggml_backend>,
    threadpool: Option<NonNull<ggml::ggml_threadpool>>,
    description: String,
}

impl LlamaCpp {
    /// ggml's CPU backend on a thread pool of `threads` threads (ggml's default polling, as
    /// llama.cpp's tools start it).
    pub fn cpu(threads: usize) -> Result<LlamaCpp, PeerError> {
        // SAFETY: no arguments; a null return is checked.
        let backend = NonNull::new(unsafe { ggml::ggml_backend_cpu_init() })
            .ok_or(PeerError::Backend("CPU"))?;
        let n_threads = i32::try_from(threads).unwrap_or(i32::MAX);
        // SAFETY: plain values in, a plain struct out.
        let mut params = unsafe { ggml::ggml_threadpool_params_default(n_threads) };
        // SAFETY: `params` is a valid, initialised struct that ggml only reads.
        let threadpool = NonNull::new(unsafe { ggml::ggml_threadpool_new(&mut params) });
        let Some(pool) = threadpool else {
            // SAFETY: `backend` came from `ggml_backend_cpu_init` and is freed once.
            unsafe { ggml::ggml_backend_free(backend.as_ptr()) };
            return Err(PeerError::ThreadPool(threads));
        };
        // SAFETY: both are live; the pool outlives the backend's use of it (`Drop` frees the
        // backend first).
        unsafe {
            ggml::ggml_backend_cpu_set_n_threads(backend.as_ptr(), n_threads);
            ggml::ggml_backend_cpu_set_threadpool(backend.as_ptr(), pool.as_ptr());
        }
        let mut description = format!("CPU backend ({}), {threads} threads", cpu_features());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: reads a constant compiled into ggml.
        if std::arch::is_x86_feature_detected!("avx2") && unsafe { ggml::ggml_cpu_has_avx2() } == 0
        {
            description += " (WARNING: built without the AVX2 this CPU has, which favours hipkv; \
                             scripts/peer-llamacpp.sh builds it for this CPU)";
        }
        Ok(LlamaCpp {
            backend,
            threadpool,
            description,
        })
    }

    /// ggml's first GPU backend; none unless llama.cpp was built with the `peer-llamacpp-rocm`
    /// feature.
    pub fn gpu() -> Result<LlamaCpp, PeerError> {
        // SAFETY: a null parameter string asks for the device's defaults; null is checked.
        let backend = NonNull::new(unsafe {
            ggml::ggml_backend_init_by_type(ggml::GGML_BACKEND_DEVICE_TYPE_GPU, ptr::null())
        })
        .ok_or(PeerError::NoGpu)?;
        Ok(LlamaCpp {
            backend,
            threadpool: None,
            description: "GPU backend".to_string(),
        })
    }

    /// What ran, for the report: the backend, and on the CPU the instruction sets ggml was
    /// built with.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Puts the CPU thread pool to sleep between the peer's timed blocks, so that its polling
    /// threads do not take cores from hipkv's; the next compute wakes it.
    pub fn pause(&self) {
        if let Some(pool) = self.threadpool {
            // SAFETY: the pool is live until `Drop`.
            unsafe { ggml::ggml_threadpool_pause(pool.as_ptr()) };
        }
    }
}

impl Drop for LlamaCpp {
    fn drop(&mut self) {
        // SAFETY: both were created in `cpu`/`gpu` and are freed exactly once, the backend
        // (which uses the pool) first.
        unsafe {
            ggml::ggml_backend_free(self.backend.as_ptr());
            if let Some(pool) = self.threadpool {
                ggml::ggml_threadpool_free(pool.as_ptr());
            }
        }
    }
}

/// The instruction sets ggml's CPU code was compiled for (a build without AVX2 on a machine
/// with it would make the comparison unfair; `scripts/peer-llamacpp.sh bench` sets them).
pub fn cpu_features() -> String {
    // SAFETY: these only read constants compiled into ggml.
    let features = unsafe {
        [
            ("AVX", ggml::ggml_cpu_has_avx()),
            ("AVX2", ggml::ggml_cpu_has_avx2()),
            ("FMA", ggml::ggml_cpu_has_fma()),
            ("F16C", ggml::ggml_cpu_has_f16c()),
            ("AVX-VNNI", ggml::ggml_cpu_has_avx_vnni()),
            ("AVX512", ggml::ggml_cpu_has_avx512()),
        ]
    };
    let on: Vec<&str> = features
        .iter()
        .filter(|(_, has)| *has != 0)
        .map(|(name, _)| *name)
        .collect();
    if on.is_empty() {
        "no SIMD beyond SSE2".to_string()
    } else {
        on.join("+")
    }
}

/// One decode step per sequence, built once: `sequences` caches of `context` tokens of one
/// type, one query, and a graph per sequence.
pub struct PeerSteps {
    peer: Rc<LlamaCpp>,
    ctx: NonNull<ggml::ggml_context>,
    buffer: Option<NonNull<ggml::ggml_backend_buffer>>,
    graphs: Vec<NonNull<ggml::ggml_cgraph>>,
    /// Each graph's result, `q_heads × head_dim` f32.
    outputs: Vec<*mut ggml::ggml_tensor>,
    bytes_per_step: usize,
}

impl PeerSteps {
    /// Builds the caches, filled cyclically from `pool` (sequence `s` from token `s × stride`,
    /// as hipkv's rows are), quantized by ggml's own quantizers, and one step per sequence for
    /// `query` (`q_heads × head_dim`).
    pub fn new(
        peer: Rc<LlamaCpp>,
        shape: PeerShape,
        ty: PeerType,
        (context, sequences): (usize, usize),
        (pool, stride): (&TokenPool, usize),
        query: &[f32],
    ) -> Result<PeerSteps, PeerError> {
        if ty != PeerType::F16 && !shape.head_dim.is_multiple_of(GGML_BLOCK) {
            return Err(PeerError::HeadDim {
                ty: ty.name(),
                head_dim: shape.head_dim,
            });
        }
        // What ggml would abort on, as panics here: GQA by broadcasting needs whole groups.
        assert!(shape.kv_heads > 0 && shape.q_heads.is_multiple_of(shape.kv_heads));
        assert_eq!(query.len(), shape.q_heads * shape.head_dim);
        let width = shape.kv_heads * shape.head_dim;
        // Per sequence: K, V, their per-head views and permutations, the output.
        let tensors = 1 + 7 * sequences;
        // SAFETY: no arguments.
        let metadata = unsafe {
            tensors * ggml::ggml_tensor_overhead() + sequences * ggml::ggml_graph_overhead()
        } + METADATA_SLACK;
        let params = ggml::ggml_init_params {
            mem_size: metadata,
            mem_buffer: ptr::null_mut(),
            no_alloc: true,
        };
        // SAFETY: ggml allocates `mem_size` bytes of metadata itself; null is checked.
        let ctx =
            NonNull::new(unsafe { ggml::ggml_init(params) }).ok_or(PeerError::Alloc("metadata"))?;
        let backend = peer.backend.as_ptr();
        let mut steps = PeerSteps {
            peer,
            ctx,
            buffer: None,
            graphs: Vec::with_capacity(sequences),
            outputs: Vec::with_capacity(sequences),
            bytes_per_step: 0,
        };
        let c = ctx.as_ptr();
        let d = shape.head_dim as i64;
        let (kv_heads, q_heads, n_kv) =
            (shape.kv_heads as i64, shape.q_heads as i64, context as i64);
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let mut caches = Vec::with_capacity(sequences);
        // SAFETY: every tensor is made in the live context `c` from tensors of that context,
        // with shapes ggml checks (its asserts abort; the shapes here satisfy them: head_dim a
        // multiple of the block size, q_heads a multiple of kv_heads).
        unsafe {
            let q = ggml::ggml_new_tensor_4d(c, ggml::GGML_TYPE_F32, d, 1, q_heads, 1);
            for _ in 0..sequences {
                let k = ggml::ggml_new_tensor_2d(c, ty.ggml(), width as i64, n_kv);
                let v = ggml::ggml_new_tensor_2d(c, ty.ggml(), width as i64, n_kv);
                let per_head = |t: *mut ggml::ggml_tensor| {
                    let row = ty.row_bytes(shape.head_dim);
                    let token = ty.row_bytes(width);
                    let view = ggml::ggml_view_3d(c, t, d, kv_heads, n_kv, row, token, 0);
                    ggml::ggml_permute(c, view, 0, 2, 1, 3)
                };
                let out = ggml::ggml_flash_attn_ext(
                    c,
                    q,
                    per_head(k),
                    per_head(v),
                    ptr::null_mut(),
                    scale,
                    0.0,
                    0.0,
                );
                ggml::ggml_flash_attn_ext_set_prec(out, ggml::GGML_PREC_F32);
                let graph =
                    NonNull::new(ggml::ggml_new_graph(c)).ok_or(PeerError::Alloc("graph"))?;
                ggml::ggml_build_forward_expand(graph.as_ptr(), out);
                steps.graphs.push(graph);
                steps.outputs.push(out);
                caches.push((k, v));
            }
            let buffer = ggml::ggml_backend_alloc_ctx_tensors(c, backend);
            steps.buffer = Some(NonNull::new(buffer).ok_or(PeerError::Alloc("cache"))?);
            set(q, 0, query.as_ptr().cast(), std::mem::size_of_val(query));
        }

        let row_bytes = ty.row_bytes(width);
        steps.bytes_per_step = 2 * context * row_bytes;
        let (pool_k, pool_v) = pool.first(pool.tokens());
        let pool_k = quantize(ty, pool_k, width);
        let pool_v = quantize(ty, pool_v, width);
        let pool_tokens = pool.tokens();
        for (seq, &(k, v)) in caches.iter().enumerate() {
            let mut token = 0;
            let mut at = (seq * stride) % pool_tokens;
            while token < context {
                let n = (context - token).min(pool_tokens - at);
                let src = at * row_bytes..(at + n) * row_bytes;
                // SAFETY: `k` and `v` are allocated in the buffer, `context × row_bytes` long;
                // the write covers rows `token..token + n` of them, from a slice of that length.
                unsafe {
                    set(
                        k,
                        token * row_bytes,
                        pool_k[src.clone()].as_ptr().cast(),
                        n * row_bytes,
                    );
                    set(
                        v,
                        token * row_bytes,
                        pool_v[src].as_ptr().cast(),
                        n * row_bytes,
                    );
                }
                token += n;
                at = (at + n) % pool_tokens;
            }
        }
        Ok(steps)
    }

    /// Runs the decode step of sequence `seq` to completion.
    pub fn run(&mut self, seq: usize) -> Result<(), PeerError> {
        let graph = self.graphs[seq % self.graphs.len()];
        // SAFETY: the graph's tensors live in `self.buffer`, the backend in `self.peer`; the
        // call returns when the step is done (the GPU backend synchronizes).
        let status =
            unsafe { ggml::ggml_backend_graph_compute(self.peer.backend.as_ptr(), graph.as_ptr()) };
        if status == ggml::GGML_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(PeerError::Compute(status))
        }
    }
}

#[cfg(test)]
impl PeerSteps {
    /// The last result of sequence `seq`'s step.
    fn output(&self, seq: usize) -> Vec<f32> {
        let out = self.outputs[seq];
        // SAFETY: `out` is an allocated f32 tensor of the buffer; `nbytes` is its length.
        unsafe {
            let mut host = vec![0f32; ggml::ggml_nbytes(out) / 4];
            ggml::ggml_backend_tensor_get(out, host.as_mut_ptr().cast(), 0, 4 * host.len());
            host
        }
    }
}

impl Drop for PeerSteps {
    fn drop(&mut self) {
        // SAFETY: the buffer (if allocated) and the context were made in `new` and are freed
        // once, the buffer first since the context's tensors point into it.
        unsafe {
            if let Some(buffer) = self.buffer {
                ggml::ggml_backend_buffer_free(buffer.as_ptr());
            }
            ggml::ggml_free(self.ctx.as_ptr());
        }
    }
}

/// Writes `len` bytes at `offset` into an allocated tensor.
///
/// # Safety
/// `tensor` must be allocated and at least `offset + len` bytes long; `src` must be readable
/// for `len` bytes.
unsafe fn set(tensor: *mut ggml::ggml_tensor, offset: usize, src: *const c_void, len: usize) {
    // SAFETY: as the caller promises.
    unsafe { ggml::ggml_backend_tensor_set(tensor, src, offset, len) };
}

/// Rows of `width` f32 elements in ggml's `ty` encoding, by ggml's reference quantizers.
fn quantize(ty: PeerType, rows: &[f32], width: usize) -> Vec<u8> {
    let n_rows = rows.len() / width;
    let row_bytes = ty.row_bytes(width);
    let mut out = vec![0u8; n_rows * row_bytes];
    // SAFETY: `rows` holds `n_rows × width` f32 and `out` `n_rows × row_bytes` bytes, what the
    // quantizer reads and writes; `width` is a multiple of the block size (checked in `new`).
    let written = unsafe {
        ggml::ggml_quantize_chunk(
            ty.ggml(),
            rows.as_ptr(),
            out.as_mut_ptr().cast(),
            0,
            n_rows as i64,
            width as i64,
            ptr::null(),
        )
    };
    debug_assert_eq!(written, out.len());
    out
}

/// llama.cpp as `hipkv bench`'s peer: for each context, the caches of each type a row asks for,
/// built once and kept until the context changes.
pub struct LlamaCppBench<'a> {
    llama: Rc<LlamaCpp>,
    shape: PeerShape,
    pool: &'a TokenPool,
    query: &'a [f32],
    working_set: usize,
    context: usize,
    built: Vec<(PeerType, PeerSteps)>,
}

impl<'a> LlamaCppBench<'a> {
    pub fn new(
        llama: LlamaCpp,
        shape: PeerShape,
        pool: &'a TokenPool,
        query: &'a [f32],
        working_set: usize,
    ) -> LlamaCppBench<'a> {
        LlamaCppBench {
            llama: Rc::new(llama),
            shape,
            pool,
            query,
            working_set,
            context: 0,
            built: Vec::new(),
        }
    }
}

impl Peer for LlamaCppBench<'_> {
    fn describe(&self) -> String {
        format!(
            "llama.cpp (llama-cpp-sys-2), {}: ggml_flash_attn_ext over K/V laid out as \
             llama.cpp's cache, no mask, f32 precision",
            self.llama.description()
        )
    }

    fn steps(
        &mut self,
        scheme: Scheme,
        context: usize,
    ) -> Result<(&'static str, &mut dyn Stepper), CliError> {
        if context != self.context {
            // One context's caches at a time: they are the size of hipkv's working set each.
            self.built.clear();
            self.context = context;
        }
        let ty = PeerType::for_scheme(scheme);
        let at = match self.built.iter().position(|(t, _)| *t == ty) {
            Some(at) => at,
            None => {
                let width = self.shape.kv_heads * self.shape.head_dim;
                let sequences = sequences_for(self.working_set, 2 * context * ty.row_bytes(width));
                let steps = PeerSteps::new(
                    Rc::clone(&self.llama),
                    self.shape,
                    ty,
                    (context, sequences),
                    (self.pool, CHUNK),
                    self.query,
                )?;
                self.built.push((ty, steps));
                self.built.len() - 1
            }
        };
        Ok((ty.name(), &mut self.built[at].1))
    }
}

impl Stepper for PeerSteps {
    fn sequences(&self) -> usize {
        self.graphs.len()
    }

    fn bytes_per_step(&self) -> usize {
        self.bytes_per_step
    }

    /// The wall clock of the compute call, which returns when the step is done.
    fn step(&mut self, seq: usize) -> Result<f64, CliError> {
        let t = Instant::now();
        self.run(seq)?;
        Ok(t.elapsed().as_secs_f64())
    }

    fn rest(&mut self) {
        self.peer.pause();
    }
}

#[cfg(test)]
mod tests {
    use hipkv::synth::Rng;

    use super::*;

    /// Softmax attention of one query token over `tokens` rows of `kv_heads × head_dim`, in f64.
    fn reference(shape: PeerShape, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let d = shape.head_dim;
        let width = shape.kv_heads * d;
        let tokens = k.len() / width;
        let gqa = shape.q_heads / shape.kv_heads;
        let mut out = vec![0f32; shape.q_heads * d];
        for h in 0..shape.q_heads {
            let kv = (h / gqa) * d;
            let qh = &q[h * d..(h + 1) * d];
            let scores: Vec<f64> = (0..tokens)
                .map(|t| {
                    let kt = &k[t * width + kv..t * width + kv + d];
                    qh.iter()
                        .zip(kt)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for (c, o) in out[h * d..(h + 1) * d].iter_mut().enumerate() {
                let acc: f64 = (0..tokens)
                    .map(|t| weights[t] * v[t * width + kv + c] as f64)
                    .sum();
                *o = (acc / total) as f32;
            }
        }
        out
    }

    /// Rows of `width` elements in `ty` decoded by ggml's own dequantizer.
    fn dequantize(ty: PeerType, rows: &[f32], width: usize) -> Vec<f32> {
        let codes = quantize(ty, rows, width);
        let mut out = vec![0f32; rows.len()];
        // SAFETY: the traits are static; `to_float` reads the `rows.len()` elements' codes
        // that `quantize` wrote and writes as many f32.
        unsafe {
            let to_float = (*ggml::ggml_get_type_traits(ty.ggml())).to_float.unwrap();
            to_float(codes.as_ptr().cast(), out.as_mut_ptr(), rows.len() as i64);
        }
        out
    }

    /// The peer's step is the attention hipkv's rows compute, over the tokens it was filled
    /// with (cyclically from the pool, sequence `s` from token `s × stride`) as its cache type
    /// stores them, for every cache type.
    #[test]
    fn peer_step_is_the_attention_of_its_tokens() {
        let shape = PeerShape {
            kv_heads: 2,
            q_heads: 6,
            head_dim: 64,
        };
        let width = shape.kv_heads * shape.head_dim;
        let pool = TokenPool::new(&mut Rng::new(3), 40, shape.kv_heads, shape.head_dim);
        let query = Rng::new(4).normals(shape.q_heads * shape.head_dim);
        let (context, sequences, stride) = (100, 2, 7);
        let llama = Rc::new(LlamaCpp::cpu(2).unwrap());
        // The largest output is about 0.75. What is left is llama.cpp's own rounding: the
        // query as f16 (f16 cache) or q8_0 (quantized caches), f16 accumulators.
        for (ty, bound) in [
            (PeerType::F16, 4e-3),
            (PeerType::Q8_0, 1e-2),
            (PeerType::Q4_0, 1e-2),
        ] {
            let mut steps = PeerSteps::new(
                Rc::clone(&llama),
                shape,
                ty,
                (context, sequences),
                (&pool, stride),
                &query,
            )
            .unwrap();
            assert_eq!(steps.bytes_per_step, 2 * context * ty.row_bytes(width));
            let (pool_k, pool_v) = pool.first(pool.tokens());
            let (pool_k, pool_v) = (dequantize(ty, pool_k, width), dequantize(ty, pool_v, width));
            for seq in 0..sequences {
                steps.run(seq).unwrap();
                let rows = |src: &[f32]| -> Vec<f32> {
                    (0..context)
                        .flat_map(|t| {
                            let at = (seq * stride + t) % pool.tokens();
                            src[at * width..(at + 1) * width].to_vec()
                        })
                        .collect()
                };
                let expect = reference(shape, &query, &rows(&pool_k), &rows(&pool_v));
                let got = steps.output(seq);
                let worst = got
                    .iter()
                    .zip(&expect)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst < bound, "{}: seq {seq} differs by {worst}", ty.name());
            }
        }
    }

    #[test]
    fn quantized_types_need_whole_blocks() {
        let shape = PeerShape {
            kv_heads: 1,
            q_heads: 1,
            head_dim: 48,
        };
        let pool = TokenPool::new(&mut Rng::new(3), 8, 1, 48);
        let llama = Rc::new(LlamaCpp::cpu(1).unwrap());
        let err = PeerSteps::new(llama, shape, PeerType::Q4_0, (8, 2), (&pool, 1), &[0.0; 48]);
        assert!(matches!(err, Err(PeerError::HeadDim { head_dim: 48, .. })));
    }

    #[test]
    fn schemes_meet_the_type_of_their_width() {
        let ty = |s: &str| PeerType::for_scheme(s.parse().unwrap());
        assert_eq!(ty("f16"), PeerType::F16);
        assert_eq!(ty("q8"), PeerType::Q8_0);
        assert_eq!(ty("q8_0"), PeerType::Q8_0);
        assert_eq!(ty("fp8"), PeerType::Q8_0);
        assert_eq!(ty("kivi4"), PeerType::Q4_0);
        assert_eq!(ty("kivi2"), PeerType::Q4_0);
        assert_eq!(ty("k=q4_chan,v=q2_tok@64"), PeerType::Q4_0);
    }
}
