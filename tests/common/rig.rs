//! A server in miniature for the paged API's tests: one paged cache on a backend, its layers'
//! blocks and a workspace allocated through it, and calls that take host arrays, put them in
//! the backend's memory (setup-time copies, outside the calls under test) and run one call.

use half::{bf16, f16};
use hipkv::Backend;
use hipkv::synth::Rng;

use super::{assert_outputs_close, naive_chunk_offset, paged_chan_int_offsets, rounded_query};
use hipkv::hip::StreamHandle;
use hipkv::paged::{
    BatchLimits, DType, DeviceMemory, KvBatch, Layout, PagedCache, QueryBatch, Workspace,
};

pub struct Rig {
    pub paged: PagedCache,
    pub caches: Vec<DeviceMemory>,
    pub workspace: DeviceMemory,
    pub limits: BatchLimits,
}

/// Host arrays, in the backend's memory.
pub struct Uploaded(pub Vec<DeviceMemory>);

impl Uploaded {
    pub fn addr(&self, i: usize) -> u64 {
        self.0[i].addr()
    }
}

/// `x` as bytes of `dtype`.
pub fn encode(x: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => x
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => x
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}

/// Bytes of `dtype` as f32.
pub fn decode(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

/// `x` rounded through `dtype`, as the calls read it.
pub fn through(x: &[f32], dtype: DType) -> Vec<f32> {
    decode(&encode(x, dtype), dtype)
}

pub fn le_bytes<T: Copy, const N: usize>(xs: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    xs.iter().flat_map(|&x| f(x)).collect()
}

impl Rig {
    pub fn new(layout: Layout, layers: usize, backend: Backend, max_tokens: usize) -> Rig {
        let paged = PagedCache::new(layout, layers, backend).unwrap();
        let limits = BatchLimits { max_tokens };
        let caches = (0..layers)
            .map(|_| paged.alloc(layout.cache_bytes()).unwrap())
            .collect();
        let workspace = paged.alloc(layout.workspace_bytes(limits)).unwrap();
        Rig {
            paged,
            caches,
            workspace,
            limits,
        }
    }

    pub fn layout(&self) -> &Layout {
        self.paged.layout()
    }

    /// Copies each array into a fresh allocation of the backend.
    pub fn upload(&self, parts: &[&[u8]]) -> Uploaded {
        Uploaded(
            parts
                .iter()
                .map(|p| {
                    let mem = self.paged.alloc(p.len().max(1)).unwrap();
                    self.paged
                        .upload(&mem, 0, p, StreamHandle::DEFAULT)
                        .unwrap();
                    mem
                })
                .collect(),
        )
    }

    /// Uploads a write: k, v (`dtype`), slots, sequence slots, positions.
    pub fn stage_write(
        &self,
        k: &[f32],
        v: &[f32],
        dtype: DType,
        slots: &[i64],
        seqs: &[i32],
        positions: &[i32],
    ) -> (KvBatch, Uploaded) {
        let up = self.upload(&[
            &encode(k, dtype),
            &encode(v, dtype),
            &le_bytes(slots, i64::to_le_bytes),
            &le_bytes(seqs, i32::to_le_bytes),
            &le_bytes(positions, i32::to_le_bytes),
        ]);
        let batch = KvBatch {
            tokens: slots.len(),
            dtype,
            k: up.addr(0),
            v: up.addr(1),
            slot_mapping: up.addr(2),
            seq_slots: up.addr(3),
            positions: up.addr(4),
        };
        (batch, up)
    }

    /// One `write_kv` of staged inputs, then `check`.
    pub fn run_write(&self, layer: usize, batch: &KvBatch) -> hipkv::Result<()> {
        // SAFETY: the rig's cache of `layer`, and inputs the caller staged with `stage_write`
        // and keeps alive over the call (which waits in `check`).
        unsafe {
            self.paged.write_kv(
                layer,
                self.caches[layer].addr(),
                batch,
                StreamHandle::DEFAULT,
            )?
        };
        self.paged.check(StreamHandle::DEFAULT)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        dtype: DType,
        slots: &[i64],
        seqs: &[i32],
        positions: &[i32],
    ) -> hipkv::Result<()> {
        let (batch, _inputs) = self.stage_write(k, v, dtype, slots, seqs, positions);
        self.run_write(layer, &batch)
    }

    /// Uploads an attention batch and room for its output.
    #[allow(clippy::too_many_arguments)]
    pub fn stage_attend(
        &self,
        q: &[f32],
        dtype: DType,
        starts: &[i32],
        lens: &[i32],
        tables: &[i32],
        width: usize,
        slots: &[i32],
        scale: f32,
    ) -> (QueryBatch, Uploaded) {
        let up = self.upload(&[
            &encode(q, dtype),
            &vec![0u8; q.len() * dtype.bytes()],
            &le_bytes(starts, i32::to_le_bytes),
            &le_bytes(lens, i32::to_le_bytes),
            &le_bytes(tables, i32::to_le_bytes),
            &le_bytes(slots, i32::to_le_bytes),
        ]);
        let q_lens = starts.windows(2).map(|w| (w[1] - w[0]).max(0) as usize);
        let batch = QueryBatch {
            num_seqs: lens.len(),
            tokens: *starts.last().unwrap() as usize,
            max_q_len: q_lens.max().unwrap_or(0),
            max_seq_len: lens.iter().copied().max().unwrap_or(0).max(0) as usize,
            max_blocks_per_seq: width,
            dtype,
            softmax_scale: scale,
            window: None,
            q: up.addr(0),
            out: up.addr(1),
            query_start_loc: up.addr(2),
            seq_lens: up.addr(3),
            block_tables: up.addr(4),
            seq_slots: up.addr(5),
        };
        (batch, up)
    }

    /// One `attend` of staged inputs, then `check`; the output as f32.
    pub fn run_attend(
        &self,
        layer: usize,
        batch: &QueryBatch,
        inputs: &Uploaded,
    ) -> (hipkv::Result<()>, Vec<f32>) {
        let workspace = Workspace {
            addr: self.workspace.addr(),
            limits: self.limits,
        };
        // SAFETY: the rig's cache of `layer` and workspace, and inputs staged by
        // `stage_attend`, alive over the call (which waits in `check`).
        let queued = unsafe {
            self.paged.attend(
                layer,
                self.caches[layer].addr(),
                batch,
                &workspace,
                StreamHandle::DEFAULT,
            )
        };
        let result = queued.and_then(|()| self.paged.check(StreamHandle::DEFAULT));
        let mut bytes = vec![0u8; inputs.0[1].bytes()];
        self.paged
            .download(&inputs.0[1], 0, &mut bytes, StreamHandle::DEFAULT)
            .unwrap();
        let n = batch.tokens * self.layout().spec().q_heads * self.layout().head_dim();
        (
            result,
            decode(&bytes[..n * batch.dtype.bytes()], batch.dtype),
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        layer: usize,
        q: &[f32],
        dtype: DType,
        starts: &[i32],
        lens: &[i32],
        tables: &[i32],
        width: usize,
        slots: &[i32],
        scale: f32,
    ) -> (hipkv::Result<()>, Vec<f32>) {
        let (batch, inputs) =
            self.stage_attend(q, dtype, starts, lens, tables, width, slots, scale);
        self.run_attend(layer, &batch, &inputs)
    }
}

/// How close an output in `dtype` comes to the f64 reference, relative to its row's largest
/// element: the kernels' 1e-5 in f32, plus the output's own rounding.
pub fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
    }
}

/// A server's view of its sequences: slot, blocks and length each, and a free list.
pub struct Server {
    pub free: Vec<i32>,
    pub seqs: Vec<(i32, Vec<i32>, usize)>,
    block_tokens: usize,
}

impl Server {
    pub fn new(layout: &Layout, rng: &mut Rng) -> Server {
        let mut free: Vec<i32> = (0..layout.spec().num_blocks as i32).collect();
        // Blocks come in any order: a shuffled free list.
        for i in (1..free.len()).rev() {
            free.swap(i, rng.below(i + 1));
        }
        Server {
            free,
            seqs: Vec::new(),
            block_tokens: layout.block_tokens(),
        }
    }

    /// The slots, sequence slots and positions of `n` new tokens of sequence `s`, taking
    /// blocks as needed.
    pub fn grow(&mut self, s: usize, n: usize) -> (Vec<i64>, Vec<i32>, Vec<i32>) {
        let bt = self.block_tokens;
        let (slot, blocks, len) = &mut self.seqs[s];
        let mut out = (Vec::new(), Vec::new(), Vec::new());
        for p in *len..*len + n {
            if p % bt == 0 {
                blocks.push(self.free.pop().expect("enough blocks"));
            }
            out.0
                .push(i64::from(blocks[p / bt]) * bt as i64 + (p % bt) as i64);
            out.1.push(*slot);
            out.2.push(p as i32);
        }
        *len += n;
        out
    }

    /// The batch of `(sequence, query tokens)`: query_start_loc, seq_lens, block tables (of
    /// `width` columns), sequence slots.
    pub fn batch(
        &self,
        chunks: &[(usize, usize)],
        width: usize,
    ) -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>) {
        let mut starts = vec![0];
        let (mut lens, mut tables, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for &(s, q_len) in chunks {
            let (slot, blocks, len) = &self.seqs[s];
            starts.push(starts.last().unwrap() + q_len as i32);
            lens.push(*len as i32);
            slots.push(*slot);
            let mut row = blocks.clone();
            row.resize(width, 0);
            tables.extend(row);
        }
        (starts, lens, tables, slots)
    }
}

/// One step: writes `chunks` (sequence, new tokens) in one batch, attends the same chunks in
/// another, and checks every output against the reference.
pub fn step(
    rig: &Rig,
    server: &mut Server,
    rng: &mut Rng,
    chunks: &[(usize, usize)],
    dtype: DType,
    what: &str,
) {
    step_windowed(rig, server, rng, chunks, dtype, None, what);
}

/// [`step`], attending within a sliding `window`. With one, the step is attended a second
/// time with every block id wholly below its sequence's window replaced by -1 (as a server
/// that has freed them passes them), which must give the same outputs bit for bit.
pub fn step_windowed(
    rig: &Rig,
    server: &mut Server,
    rng: &mut Rng,
    chunks: &[(usize, usize)],
    dtype: DType,
    window: Option<usize>,
    what: &str,
) {
    let spec = *rig.layout().spec();
    let (h, d) = (spec.kv_heads, spec.head_dim);
    let (mut slots, mut seqs, mut positions) = (Vec::new(), Vec::new(), Vec::new());
    for &(s, n) in chunks {
        let (a, b, c) = server.grow(s, n);
        slots.extend(a);
        seqs.extend(b);
        positions.extend(c);
    }
    let tokens = slots.len();
    let k = hipkv::synth::keys_with_outlier_channels(rng, tokens, h, d, 2, 4.0);
    let v = rng.normals(tokens * h * d);
    rig.write(0, &k, &v, dtype, &slots, &seqs, &positions)
        .unwrap_or_else(|e| panic!("{what}: write_kv: {e}"));

    let width = server.seqs.iter().map(|s| s.1.len()).max().unwrap() + 1;
    let (starts, lens, tables, seq_slots) = server.batch(chunks, width);
    let q = rng.normals(tokens * spec.q_heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    let (mut batch, inputs) =
        rig.stage_attend(&q, dtype, &starts, &lens, &tables, width, &seq_slots, scale);
    batch.window = window;
    let (result, out) = rig.run_attend(0, &batch, &inputs);
    result.unwrap_or_else(|e| panic!("{what}: attend: {e}"));
    if let Some(w) = window {
        let bt = rig.layout().block_tokens();
        let mut freed = tables.clone();
        for (i, &(s, n)) in chunks.iter().enumerate() {
            let first_visible = (server.seqs[s].2 - n + 1).saturating_sub(w);
            freed[i * width..i * width + first_visible / bt].fill(-1);
        }
        let (mut batch, inputs) =
            rig.stage_attend(&q, dtype, &starts, &lens, &freed, width, &seq_slots, scale);
        batch.window = window;
        let (result, again) = rig.run_attend(0, &batch, &inputs);
        result.unwrap_or_else(|e| panic!("{what}: attend with the blocks below freed: {e}"));
        let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&again),
            bits(&out),
            "{what}: blocks below the window were read"
        );
    }
    let q = through(&q, dtype);
    let row = spec.q_heads * d;
    // The layer's bytes, for the references of `iq` per-channel keys.
    let mut host = vec![0u8; rig.layout().cache_bytes()];
    rig.paged
        .download(&rig.caches[0], 0, &mut host, StreamHandle::DEFAULT)
        .unwrap();
    for (i, &(s, n)) in chunks.iter().enumerate() {
        let (slot, blocks, len) = &server.seqs[s];
        let (rk, rv) = rig
            .paged
            .read_back(0, &rig.caches[0], blocks, *slot as usize, *len)
            .unwrap();
        let at = starts[i] as usize * row;
        let mut q = q[at..at + n * row].to_vec();
        let mut offsets = None;
        if spec.scheme.rounds_query_per_step() {
            q = rounded_query(&q, &spec.scheme, d);
        } else if spec.scheme.int_query {
            // Per-channel keys: each page's folded query rounded, from the stored pages.
            let bytes = rig.layout().block_bytes();
            let page = |p: usize| {
                let block = blocks[p] as usize;
                &host[block * bytes..(block + 1) * bytes]
            };
            let q_heads = spec.q_heads;
            offsets = Some(paged_chan_int_offsets(
                rig.layout(),
                page,
                *len,
                q_heads,
                &q,
                scale,
            ));
        }
        let want = naive_chunk_offset(
            &rk,
            &rv,
            &q,
            *len,
            h,
            spec.q_heads,
            d,
            scale,
            window,
            offsets.as_deref(),
        );
        assert_outputs_close(
            &spec.scheme,
            &out[at..at + n * row],
            &want,
            d,
            tolerance(dtype),
            &format!("{what}: sequence {s} ({n} of {len})"),
        );
    }
}
