//! A continuous-batching server loop over hipkv's paged API: the calls an inference server
//! makes each step, with its own block allocator and sequence slots.
//!
//! ```text
//! cargo run --release --example server_loop -- [cpu|emu|hip] [STEPS] [SCHEME]
//! ```
//!
//! SCHEME (default `kivi2,iq=0`) must score keys exactly (`iq=0` where `iq` is the default,
//! as for `q4_tok`, `q2_tok`, `kivi4` and `kivi2`): the reference below is the naive attention
//! of the stored rows.
//!
//! 64 sequence slots, 2 layers. Requests arrive and finish at random; prompts of random length
//! are prefilled in chunks beside other sequences' decodes, within a token budget per step;
//! some requests fork from a running one (sharing its full blocks, copy-on-write of its partial
//! block with `copy_blocks`, its slot state with `fork`); some are preempted (their blocks
//! freed) and later prefilled again from the start. Every attention output of every step is
//! compared with a naive attention over that sequence's own stored tokens, and at the end every
//! block is back in the free list. `tests/server_loop.rs` runs this on the CPU and the emulated
//! device; on a machine with a usable GPU it runs on `Backend::Hip` too.

use std::collections::VecDeque;

use hipkv::hip::StreamHandle;
use hipkv::paged::{
    BatchLimits, DType, DeviceMemory, KvBatch, Layout, LayoutSpec, PagedCache, QueryBatch,
    Workspace,
};
use hipkv::synth::Rng;
use hipkv::{Backend, Scheme};

/// What a run is made of.
#[derive(Clone, Debug)]
pub struct Setup {
    pub backend: Backend,
    pub steps: usize,
    pub scheme: Scheme,
    pub seed: u64,
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub requests: usize,
    pub finished: usize,
    pub forks: usize,
    pub preemptions: usize,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// Largest difference of an output row from the reference, relative to the row's largest
    /// element.
    pub worst_error: f32,
}

const SLOTS: usize = 64;
const LAYERS: usize = 2;
const KV_HEADS: usize = 2;
const Q_HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const MAX_POSITIONS: usize = 256;
/// Query tokens per step, at most (the workspace's size).
const TOKEN_BUDGET: usize = 192;
const CHUNK: usize = 64;
const DTYPE: DType = DType::F16;

/// A request and where it stands.
#[derive(Clone, Debug)]
struct Request {
    /// Tokens before position `.1` are those of request `.0`'s (a fork's prefix).
    parent: Option<(usize, usize)>,
    /// Tokens the request ends with (prompt and output).
    total: usize,
    /// Tokens in its sequence (all written; a preempted request starts again from 0).
    len: usize,
    /// Prompt tokens: prefilled in chunks; after them, one decode token per step.
    prompt: usize,
    slot: usize,
    blocks: Vec<i32>,
}

/// The server's side: free blocks with reference counts, free sequence slots.
struct Allocator {
    free: Vec<i32>,
    refs: Vec<u32>,
    slots: Vec<usize>,
}

impl Allocator {
    fn take(&mut self) -> Option<i32> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        Some(b)
    }

    fn release(&mut self, blocks: &mut Vec<i32>) {
        for b in blocks.drain(..) {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push(b);
            }
        }
    }
}

/// The K, V (one layer) and query of a token, the same every time it is asked for: a re-prefill
/// after preemption writes what the first prefill wrote, and a fork's prefix is its parent's.
fn token(requests: &[Request], id: usize, pos: usize, layer: usize) -> [Vec<f32>; 3] {
    let mut id = id;
    while let Some((parent, _)) = requests[id].parent.filter(|&(_, upto)| pos < upto) {
        id = parent;
    }
    let mut rng = Rng::new((id as u64) << 32 | (pos as u64) << 8 | layer as u64);
    let kv = KV_HEADS * HEAD_DIM;
    [
        rng.normals(kv),
        rng.normals(kv),
        rng.normals(Q_HEADS * HEAD_DIM),
    ]
}

/// `x` as f16 bytes, and `x` as the calls read it back.
fn f16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect()
}
fn via_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect()
}

/// Device memory for one step's inputs, allocated once and reused: a server's staging buffers.
struct Staging {
    buffers: Vec<DeviceMemory>,
}

impl Staging {
    fn new(paged: &PagedCache) -> hipkv::Result<Staging> {
        let sizes = [
            TOKEN_BUDGET * KV_HEADS * HEAD_DIM * 2, // k
            TOKEN_BUDGET * KV_HEADS * HEAD_DIM * 2, // v
            TOKEN_BUDGET * 8,                       // slot mapping
            TOKEN_BUDGET * 4,                       // sequence slots
            TOKEN_BUDGET * 4,                       // positions
            TOKEN_BUDGET * Q_HEADS * HEAD_DIM * 2,  // q
            TOKEN_BUDGET * Q_HEADS * HEAD_DIM * 2,  // out
            (SLOTS + 1) * 4,                        // query_start_loc
            SLOTS * 4,                              // seq_lens
            SLOTS * MAX_POSITIONS.div_ceil(32) * 4, // block tables
            SLOTS * 4,                              // sequence slots
        ];
        let buffers = sizes
            .iter()
            .map(|&b| paged.alloc(b))
            .collect::<hipkv::Result<_>>()?;
        Ok(Staging { buffers })
    }

    fn put(&self, paged: &PagedCache, i: usize, bytes: &[u8]) -> hipkv::Result<u64> {
        paged.upload(&self.buffers[i], 0, bytes, StreamHandle::DEFAULT)?;
        Ok(self.buffers[i].addr())
    }
}

fn le<T: Copy, const N: usize>(xs: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    xs.iter().flat_map(|&x| f(x)).collect()
}

/// Runs the loop; an error (or an output off the reference) ends it.
pub fn run(setup: &Setup) -> Result<Summary, String> {
    if setup.scheme.int_query {
        // The reference below scores the stored keys exactly; tests/attention.rs and the paged
        // rig hold `iq` to its own reference.
        return Err(format!(
            "{}: keys scored from the int8 query (iq); this loop's reference needs exact \
             scores (add iq=0)",
            setup.scheme
        ));
    }
    let layout = Layout::new(LayoutSpec {
        scheme: setup.scheme,
        kv_heads: KV_HEADS,
        q_heads: Q_HEADS,
        head_dim: HEAD_DIM,
        num_blocks: 640,
        max_seqs: SLOTS,
        max_positions: MAX_POSITIONS,
        rope: None,
    })
    .map_err(|e| e.to_string())?;
    let e = |e: hipkv::Error| e.to_string();
    let paged = PagedCache::new(layout, LAYERS, setup.backend).map_err(e)?;
    let caches: Vec<DeviceMemory> = (0..LAYERS)
        .map(|_| paged.alloc(layout.cache_bytes()))
        .collect::<hipkv::Result<_>>()
        .map_err(e)?;
    let limits = BatchLimits {
        max_tokens: TOKEN_BUDGET,
    };
    let workspace = paged.alloc(layout.workspace_bytes(limits)).map_err(e)?;
    let staging = Staging::new(&paged).map_err(e)?;
    let pairs = paged.alloc(8).map_err(e)?;
    let stream = StreamHandle::DEFAULT;
    let bt = layout.block_tokens();

    let mut rng = Rng::new(setup.seed);
    let mut alloc = Allocator {
        free: (0..layout.spec().num_blocks as i32).rev().collect(),
        refs: vec![0; layout.spec().num_blocks],
        slots: (0..SLOTS).rev().collect(),
    };
    let mut requests: Vec<Request> = Vec::new();
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<usize> = Vec::new();
    let mut summary = Summary::default();

    for step in 0..setup.steps {
        // Arrivals: new prompts, and now and then a fork of a running request.
        for _ in 0..rng.below(3) {
            let total = 8 + rng.below(MAX_POSITIONS - 8);
            let id = requests.len();
            requests.push(Request {
                parent: None,
                total,
                len: 0,
                prompt: (1 + rng.below(total)).min(total),
                slot: usize::MAX,
                blocks: Vec::new(),
            });
            waiting.push_back(id);
        }
        if !running.is_empty() && rng.below(4) == 0 {
            let parent = running[rng.below(running.len())];
            let p = requests[parent].clone();
            // A request past its prompt, with tokens still to come.
            if p.len > 0 && p.len >= p.prompt && p.len < p.total && !alloc.slots.is_empty() {
                // The child shares the parent's full blocks and gets a copy of its partial one.
                let slot = alloc.slots.pop().unwrap();
                let full = p.len / bt;
                let mut blocks = p.blocks[..full].to_vec();
                for &b in &blocks {
                    alloc.refs[b as usize] += 1;
                }
                if !p.len.is_multiple_of(bt) {
                    let Some(copy) = alloc.take() else {
                        alloc.slots.push(slot);
                        alloc.release(&mut blocks);
                        continue;
                    };
                    let pair = le(&[p.blocks[full], copy], i32::to_le_bytes);
                    paged.upload(&pairs, 0, &pair, stream).map_err(e)?;
                    for cache in &caches {
                        // SAFETY: a layer cache and one uploaded pair, alive over the call.
                        unsafe { paged.copy_blocks(cache.addr(), pairs.addr(), 1, stream) }
                            .map_err(e)?;
                    }
                    blocks.push(copy);
                }
                paged.fork(p.slot, slot, stream).map_err(e)?;
                let id = requests.len();
                requests.push(Request {
                    parent: Some((parent, p.len)),
                    total: p.total,
                    len: p.len,
                    prompt: p.len,
                    slot,
                    blocks,
                });
                running.push(id);
                summary.forks += 1;
            }
        }
        // Preemption: a running request gives its blocks back and waits to start over.
        if running.len() > 1 && rng.below(10) == 0 {
            let id = running.swap_remove(rng.below(running.len()));
            let r = &mut requests[id];
            alloc.release(&mut r.blocks);
            alloc.slots.push(r.slot);
            r.prompt = r.len.max(r.prompt);
            r.len = 0;
            waiting.push_back(id);
            summary.preemptions += 1;
        }
        // Admission, while slots and blocks last.
        while let Some(&id) = waiting.front() {
            if alloc.slots.is_empty() || alloc.free.len() < MAX_POSITIONS / bt {
                break;
            }
            waiting.pop_front();
            requests[id].slot = alloc.slots.pop().unwrap();
            running.push(id);
        }

        // This step's batch: decodes first, then prefill chunks within the token budget.
        let mut chunks: Vec<(usize, usize)> = Vec::new();
        let mut budget = TOKEN_BUDGET;
        let mut order = running.clone();
        order.sort_by_key(|&id| requests[id].len < requests[id].prompt);
        for id in order {
            let r = &requests[id];
            let n = if r.len < r.prompt {
                (r.prompt - r.len).min(CHUNK).min(budget)
            } else {
                1.min(budget)
            };
            if n == 0 {
                continue;
            }
            budget -= n;
            chunks.push((id, n));
        }
        if chunks.is_empty() {
            continue;
        }

        // Blocks for the new positions, then the write of every layer.
        let (mut slots, mut seq_slots, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        for &(id, n) in &chunks {
            let r = &mut requests[id];
            for pos in r.len..r.len + n {
                if pos % bt == 0 {
                    r.blocks.push(alloc.take().ok_or("out of blocks")?);
                }
                slots.push(i64::from(r.blocks[pos / bt]) * bt as i64 + (pos % bt) as i64);
                seq_slots.push(r.slot as i32);
                positions.push(pos as i32);
            }
            if r.len < r.prompt {
                summary.prefill_tokens += n;
            } else {
                summary.decode_tokens += n;
            }
        }
        let tokens = slots.len();
        let starts: Vec<i32> = std::iter::once(0)
            .chain(chunks.iter().scan(0, |at, &(_, n)| {
                *at += n as i32;
                Some(*at)
            }))
            .collect();
        let width = MAX_POSITIONS.div_ceil(bt);
        for (layer, cache) in caches.iter().enumerate() {
            let (mut k, mut v, mut q) = (Vec::new(), Vec::new(), Vec::new());
            for &(id, n) in &chunks {
                let len = requests[id].len;
                for pos in len..len + n {
                    let [tk, tv, tq] = token(&requests, id, pos, layer);
                    k.extend(tk);
                    v.extend(tv);
                    q.extend(tq);
                }
            }
            let batch = KvBatch {
                tokens,
                dtype: DTYPE,
                k: staging.put(&paged, 0, &f16_bytes(&k)).map_err(e)?,
                v: staging.put(&paged, 1, &f16_bytes(&v)).map_err(e)?,
                slot_mapping: staging
                    .put(&paged, 2, &le(&slots, i64::to_le_bytes))
                    .map_err(e)?,
                seq_slots: staging
                    .put(&paged, 3, &le(&seq_slots, i32::to_le_bytes))
                    .map_err(e)?,
                positions: staging
                    .put(&paged, 4, &le(&positions, i32::to_le_bytes))
                    .map_err(e)?,
            };
            // SAFETY: the layer's cache and the staging buffers, alive over the call.
            unsafe { paged.write_kv(layer, cache.addr(), &batch, stream) }.map_err(e)?;

            let lens: Vec<i32> = chunks
                .iter()
                .map(|&(id, n)| (requests[id].len + n) as i32)
                .collect();
            let mut tables = vec![0i32; chunks.len() * width];
            for (row, &(id, _)) in tables.chunks_exact_mut(width).zip(&chunks) {
                row[..requests[id].blocks.len()].copy_from_slice(&requests[id].blocks);
            }
            let slots_of: Vec<i32> = chunks
                .iter()
                .map(|&(id, _)| requests[id].slot as i32)
                .collect();
            let query = QueryBatch {
                num_seqs: chunks.len(),
                tokens,
                max_q_len: chunks.iter().map(|c| c.1).max().unwrap(),
                max_seq_len: *lens.iter().max().unwrap() as usize,
                max_blocks_per_seq: width,
                dtype: DTYPE,
                softmax_scale: 0.125,
                window: None,
                q: staging.put(&paged, 5, &f16_bytes(&q)).map_err(e)?,
                out: staging.buffers[6].addr(),
                query_start_loc: staging
                    .put(&paged, 7, &le(&starts, i32::to_le_bytes))
                    .map_err(e)?,
                seq_lens: staging
                    .put(&paged, 8, &le(&lens, i32::to_le_bytes))
                    .map_err(e)?,
                block_tables: staging
                    .put(&paged, 9, &le(&tables, i32::to_le_bytes))
                    .map_err(e)?,
                seq_slots: staging
                    .put(&paged, 10, &le(&slots_of, i32::to_le_bytes))
                    .map_err(e)?,
            };
            let ws = Workspace {
                addr: workspace.addr(),
                limits,
            };
            // SAFETY: as above, and a workspace sized for `limits`.
            unsafe { paged.attend(layer, cache.addr(), &query, &ws, stream) }.map_err(e)?;
            paged.check(stream).map_err(e)?;

            // Every output against the reference over that sequence's own stored tokens.
            let row = Q_HEADS * HEAD_DIM;
            let mut out = vec![0u8; tokens * row * 2];
            paged
                .download(&staging.buffers[6], 0, &mut out, stream)
                .map_err(e)?;
            let out: Vec<f32> = out
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect();
            let views: Vec<(&[i32], usize, usize)> = chunks
                .iter()
                .map(|&(id, n)| {
                    let r = &requests[id];
                    (&r.blocks[..], r.slot, r.len + n)
                })
                .collect();
            let stored = paged
                .read_back_seqs(layer, &caches[layer], &views)
                .map_err(e)?;
            let q = via_f16(&q);
            for (i, ((k, v), &(id, n))) in stored.iter().zip(&chunks).enumerate() {
                let at = starts[i] as usize * row;
                let len = requests[id].len + n;
                let want = naive(k, v, &q[at..at + n * row], len);
                for (r, (g, w)) in out[at..at + n * row]
                    .chunks_exact(HEAD_DIM)
                    .zip(want.chunks_exact(HEAD_DIM))
                    .enumerate()
                {
                    let scale = w.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
                    let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                    summary.worst_error = summary.worst_error.max(err);
                    if err > 2e-3 {
                        return Err(format!(
                            "step {step} layer {layer}: request {id} (len {len}, {n} new) row {r}: error {err}"
                        ));
                    }
                }
            }
        }
        for &(id, n) in &chunks {
            requests[id].len += n;
        }
        // Finished requests give their blocks and slots back.
        running.retain(|&id| {
            let r = &mut requests[id];
            if r.len >= r.total {
                alloc.release(&mut r.blocks);
                alloc.slots.push(r.slot);
                summary.finished += 1;
                return false;
            }
            true
        });
    }
    // The end of service: everything is given back.
    for id in running.drain(..) {
        alloc.release(&mut requests[id].blocks);
        alloc.slots.push(requests[id].slot);
    }
    summary.requests = requests.len();
    let blocks = layout.spec().num_blocks;
    if alloc.free.len() != blocks
        || alloc.refs.iter().any(|&r| r != 0)
        || alloc.slots.len() != SLOTS
    {
        return Err(format!(
            "{} of {blocks} blocks and {} of {SLOTS} slots back at the end",
            alloc.free.len(),
            alloc.slots.len()
        ));
    }
    Ok(summary)
}

/// Causal attention in f64 of `q` (the last `q.len() / row` of `len` positions).
fn naive(k: &[f32], v: &[f32], q: &[f32], len: usize) -> Vec<f32> {
    let row = Q_HEADS * HEAD_DIM;
    let q_len = q.len() / row;
    let mut out = vec![0f32; q.len()];
    for t in 0..q_len {
        let pos = len - q_len + t;
        for qh in 0..Q_HEADS {
            let kh = qh / (Q_HEADS / KV_HEADS);
            let qv = &q[t * row + qh * HEAD_DIM..][..HEAD_DIM];
            let logits: Vec<f64> = (0..=pos)
                .map(|p| {
                    let kv = &k[(p * KV_HEADS + kh) * HEAD_DIM..][..HEAD_DIM];
                    0.125
                        * qv.iter()
                            .zip(kv)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                })
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for c in 0..HEAD_DIM {
                let acc: f64 = (0..=pos)
                    .map(|p| w[p] * f64::from(v[(p * KV_HEADS + kh) * HEAD_DIM + c]))
                    .sum();
                out[t * row + qh * HEAD_DIM + c] = (acc / sum) as f32;
            }
        }
    }
    out
}

#[allow(dead_code)]
fn main() {
    let arg = |i: usize| std::env::args().nth(i);
    let backend = match arg(1).as_deref() {
        None | Some("cpu") => Backend::Cpu,
        Some("emu") => Backend::Emu,
        Some("hip") => Backend::Hip,
        Some(other) => {
            eprintln!("server_loop: unknown backend {other} (cpu, emu or hip)");
            std::process::exit(2);
        }
    };
    let steps = arg(2).map_or(300, |s| s.parse().expect("STEPS is a count"));
    let scheme = arg(3)
        .unwrap_or_else(|| "kivi2,iq=0".into())
        .parse()
        .unwrap_or_else(|e| panic!("SCHEME: {e}"));
    let setup = Setup {
        backend,
        steps,
        scheme,
        seed: 1,
    };
    match run(&setup) {
        Ok(s) => println!(
            "server_loop on {backend:?}, {steps} steps of {}: {} requests ({} finished, {} forks, \
             {} preemptions), {} prefill and {} decode tokens, worst output error {:.1e}: ok",
            setup.scheme,
            s.requests,
            s.finished,
            s.forks,
            s.preemptions,
            s.prefill_tokens,
            s.decode_tokens,
            s.worst_error
        ),
        Err(why) => {
            eprintln!("server_loop on {backend:?}: {why}");
            std::process::exit(1);
        }
    }
}
