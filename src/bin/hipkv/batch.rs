//! `hipkv bench --batch N`: one decode step for a batch of `N` sequences of mixed lengths through
//! the paged API, as a server makes it, timing separately what the device works (the kernels)
//! and what one `attend` call costs the host.

use std::hint::black_box;
use std::time::Instant;

use serde::Serialize;

use hipkv::Backend;
use hipkv::hip::StreamHandle;
use hipkv::paged::{
    BatchLimits, DType, DeviceMemory, KvBatch, Layout, LayoutSpec, PagedCache, QueryBatch,
    Workspace,
};
use hipkv::synth::{Rng, TokenPool};
use hipkv::{CacheConfig, KvCache, Rope, RopeLayout, Scheme, StreamSet};

use super::{CliError, Shape};

/// Tokens per `write_kv` while filling, as a prefill chunk would arrive.
const FILL_CHUNK: usize = 512;

#[derive(Serialize)]
pub(crate) struct BatchRow {
    pub(crate) scheme: String,
    pub(crate) sequences: usize,
    pub(crate) min_len: usize,
    pub(crate) max_len: usize,
    /// Bytes the step reads, counted at the pages' bytes per token × each sequence's length
    /// (the per-sequence f16 sinks and windows not separated out).
    pub(crate) bytes_per_step: usize,
    /// The device's time from the first kernel of the call to the last (the call's own wall
    /// clock on the CPU and the emulator, whose calls do the work).
    pub(crate) kernel_us: f64,
    /// The host's time inside one `attend` call: what a server's thread spends per step.
    pub(crate) host_us: f64,
    pub(crate) gb_per_s: f64,
}

/// The lengths of a batch of `n` sequences: evenly from `context / 8` to `context`.
fn lengths(n: usize, context: usize) -> Vec<usize> {
    (0..n)
        .map(|i| {
            let f = if n == 1 {
                1.0
            } else {
                i as f64 / (n - 1) as f64
            };
            ((context as f64 * (1.0 + 7.0 * f) / 8.0).round() as usize).max(1)
        })
        .collect()
}

/// Copies host arrays into memory of the cache's backend (setup time).
fn upload(paged: &PagedCache, bytes: &[u8]) -> hipkv::Result<DeviceMemory> {
    let mem = paged.alloc(bytes.len().max(1))?;
    paged.upload(&mem, 0, bytes, StreamHandle::DEFAULT)?;
    Ok(mem)
}

fn le<T: Copy, const N: usize>(xs: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    xs.iter().flat_map(|&x| f(x)).collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    le(x, f32::to_le_bytes)
}

/// One scheme's row: fill `n` sequences, then time decode steps for `min_time` seconds.
pub(crate) fn batch_row(
    backend: Backend,
    shape: Shape,
    scheme: Scheme,
    n: usize,
    context: usize,
    min_time: f64,
    pool: &TokenPool,
) -> Result<BatchRow, CliError> {
    let lens = lengths(n, context);
    let bt = scheme.group_tokens;
    let blocks: Vec<usize> = lens.iter().map(|l| l.div_ceil(bt)).collect();
    let layout = Layout::new(LayoutSpec {
        scheme,
        kv_heads: shape.kv_heads,
        q_heads: shape.q_heads,
        head_dim: shape.head_dim,
        num_blocks: blocks.iter().sum(),
        max_seqs: n,
        max_positions: context,
        rope: Some(Rope {
            base: 10000.0,
            layout: RopeLayout::Interleaved,
        }),
    })?;
    let mut paged = PagedCache::new(layout, 1, backend)?;
    let (h, d) = (shape.kv_heads, shape.head_dim);
    if scheme.outliers.is_some() || scheme.nuq != StreamSet::None {
        // What the scheme calibrates (outlier thresholds, codebooks), on the pool's tokens as
        // `hipkv bench` calibrates its caches, carried over as a calibration file would be.
        let (k, v) = pool.first(pool.tokens());
        let mut calibrating = KvCache::new(CacheConfig {
            layers: 1,
            sequences: 1,
            kv_heads: h,
            q_heads: shape.q_heads,
            head_dim: d,
            capacity: pool.tokens(),
            scheme,
            rope: layout.spec().rope,
        })?;
        calibrating.calibrate(0, k, v, 0)?;
        paged.apply_calibration(&calibrating.calibration())?;
    }
    let cache = paged.alloc(layout.cache_bytes())?;
    let stream = StreamHandle::DEFAULT;

    // Blocks handed out in order, sequence by sequence; the tables as a server keeps them.
    let width = blocks.iter().copied().max().unwrap_or(1);
    let mut tables = vec![0i32; n * width];
    let mut next = 0i32;
    for (s, &b) in blocks.iter().enumerate() {
        for j in 0..b {
            tables[s * width + j] = next;
            next += 1;
        }
    }
    // Fill every sequence in prefill chunks.
    let (k, v) = pool.first(pool.tokens());
    let row = h * d;
    for (s, &len) in lens.iter().enumerate() {
        for start in (0..len).step_by(FILL_CHUNK) {
            let end = (start + FILL_CHUNK).min(len);
            let at = (s * FILL_CHUNK + start) % (pool.tokens() - FILL_CHUNK);
            let tokens = end - start;
            let slots: Vec<i64> = (start..end)
                .map(|p| i64::from(tables[s * width + p / bt]) * bt as i64 + (p % bt) as i64)
                .collect();
            let parts = [
                upload(&paged, &f32_bytes(&k[at * row..(at + tokens) * row]))?,
                upload(&paged, &f32_bytes(&v[at * row..(at + tokens) * row]))?,
                upload(&paged, &le(&slots, i64::to_le_bytes))?,
                upload(&paged, &le(&vec![s as i32; tokens], i32::to_le_bytes))?,
                upload(
                    &paged,
                    &le(
                        &(start as i32..end as i32).collect::<Vec<_>>(),
                        i32::to_le_bytes,
                    ),
                )?,
            ];
            let batch = KvBatch {
                tokens,
                dtype: DType::F32,
                k: parts[0].addr(),
                v: parts[1].addr(),
                slot_mapping: parts[2].addr(),
                seq_slots: parts[3].addr(),
                positions: parts[4].addr(),
            };
            // SAFETY: the cache and the uploaded arrays, alive until `check` has waited.
            unsafe { paged.write_kv(0, cache.addr(), &batch, stream)? };
            paged.check(stream)?;
        }
    }

    // One decode token per sequence: the step, staged once.
    let q = Rng::new(2).normals(n * shape.q_heads * d);
    let starts: Vec<i32> = (0..=n as i32).collect();
    let lens32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let slots: Vec<i32> = (0..n as i32).collect();
    let inputs = [
        upload(&paged, &f32_bytes(&q))?,
        paged.alloc(q.len() * 4)?,
        upload(&paged, &le(&starts, i32::to_le_bytes))?,
        upload(&paged, &le(&lens32, i32::to_le_bytes))?,
        upload(&paged, &le(&tables, i32::to_le_bytes))?,
        upload(&paged, &le(&slots, i32::to_le_bytes))?,
    ];
    let batch = QueryBatch {
        num_seqs: n,
        tokens: n,
        max_q_len: 1,
        max_seq_len: context,
        max_blocks_per_seq: width,
        dtype: DType::F32,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        window: None,
        q: inputs[0].addr(),
        out: inputs[1].addr(),
        query_start_loc: inputs[2].addr(),
        seq_lens: inputs[3].addr(),
        block_tables: inputs[4].addr(),
        seq_slots: inputs[5].addr(),
    };
    let limits = BatchLimits { max_tokens: n };
    let ws = paged.alloc(layout.workspace_bytes(limits))?;
    let workspace = Workspace {
        addr: ws.addr(),
        limits,
    };

    // SAFETY (every call below): the cache, workspace and staged arrays above, alive over
    // the calls, which `check` waits for.
    let mut kernel = Vec::new();
    let mut host = Vec::new();
    let start = Instant::now();
    while kernel.len() < 5 || start.elapsed().as_secs_f64() < min_time {
        // The device's time of one call...
        let t = unsafe { paged.attend_timed(0, cache.addr(), &batch, &workspace, stream)? };
        // ... and the host's: the call alone, its work waited for afterwards.
        let t0 = Instant::now();
        unsafe { paged.attend(0, cache.addr(), &batch, &workspace, stream)? };
        host.push(t0.elapsed().as_secs_f64());
        paged.check(stream)?;
        kernel.push(t);
        black_box(&inputs);
    }
    let median = |xs: &mut Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    let kernel_s = median(&mut kernel);
    let host_s = median(&mut host);
    let per_token = layout.block_bytes() as f64 / bt as f64;
    let bytes: usize = lens.iter().map(|&l| (l as f64 * per_token) as usize).sum();
    Ok(BatchRow {
        scheme: scheme.to_string(),
        sequences: n,
        min_len: *lens.iter().min().unwrap(),
        max_len: *lens.iter().max().unwrap(),
        bytes_per_step: bytes,
        kernel_us: kernel_s * 1e6,
        host_us: host_s * 1e6,
        gb_per_s: bytes as f64 / kernel_s / 1e9,
    })
}

pub(crate) fn print_batch(rows: &[BatchRow], backend: Backend, shape: &Shape) {
    println!(
        "decode batch through the paged API on the {} backend: one token per sequence per step \
         ({} KV heads × GQA {} × head_dim {}); kernel = the device's time of a call (the call's \
         own wall clock on the CPU and the emulator), host = the time inside one attend call",
        backend.name(),
        shape.kv_heads,
        shape.gqa,
        shape.head_dim
    );
    let w = rows
        .iter()
        .map(|r| r.scheme.len())
        .max()
        .unwrap_or(0)
        .max(6);
    println!(
        "{:<w$}  {:>5}  {:>13}  {:>9}  {:>11}  {:>10}  {:>6}",
        "scheme", "seqs", "lengths", "MiB/step", "kernel µs", "host µs", "GB/s"
    );
    for r in rows {
        println!(
            "{:<w$}  {:>5}  {:>13}  {:>9.2}  {:>11.1}  {:>10.1}  {:>6.1}",
            r.scheme,
            r.sequences,
            format!("{}–{}", r.min_len, r.max_len),
            r.bytes_per_step as f64 / (1 << 20) as f64,
            r.kernel_us,
            r.host_us,
            r.gb_per_s
        );
    }
}
