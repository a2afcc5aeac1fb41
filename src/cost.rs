//! The memory half of the GPU cost model, measured from the kernels themselves: a decode step
//! run by the SIMT emulator with its load trace on (`hip/emu/emu.h`), which records every global
//! load of the attention kernel with each lane's address and width and groups the lanes' loads
//! into the wave-level instructions a GPU issues. From the counts, per kernel: how often each KV
//! byte is requested, how many 128-byte lines a wave-level load touches, and the bytes the step
//! fetches against the KV bytes it must read. `docs/performance.md` states the model's
//! assumptions and shows the table (`hipkv info --kernels`).

use crate::backend::{Backend, trace_loads};
use crate::cache::{CacheConfig, KvCache, Query};
use crate::error::{Error, Result};
use crate::kernels::attention_kernel_name;
use crate::rope::{Rope, RopeLayout};
use crate::scheme::Scheme;
use crate::synth::Rng;
use rayon::prelude::*;

pub use crate::backend::{KernelLoads, LoadCounts};

/// The line the model counts in: 128 bytes, the unit issue 15's targets are stated in. A cache
/// of 64-byte lines would see up to twice the lines per load, and the same fetch.
pub const LINE_BYTES: u64 = 128;

/// The decode step a memory report runs: one sequence of `context` tokens, one query token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub head_dim: usize,
    pub kv_heads: usize,
    pub gqa: usize,
    pub context: usize,
}

/// What one decode step's attention kernel loads, from the trace.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryReport {
    /// The scheme the step's cache was stored in.
    pub scheme: Scheme,
    pub kernel: String,
    pub shape: StepShape,
    /// The KV bytes the step must read ([`KvCache::bytes_read`]).
    pub kv_bytes: u64,
    /// Loads from the KV blocks and the slot states (sinks, f16 windows), summed.
    pub kv: LoadCounts,
    /// Loads from the RoPE table (`pre_rope` schemes: the keys are rotated in the loop).
    pub rope: LoadCounts,
    /// Loads from everywhere else: the prepared queries, the workspace, block tables and
    /// sequence metadata.
    pub other: LoadCounts,
}

impl MemoryReport {
    /// Bytes the lanes request from KV data per KV byte the step needs: a broadcast (every lane
    /// loading one token's scale) counts once per lane, and each wave of a GQA group reads every
    /// row.
    pub fn kv_reads(&self) -> f64 {
        self.kv.bytes as f64 / self.kv_bytes as f64
    }

    /// Distinct 128-byte lines one wave-level load of KV data touches, on average (1 to 2 when
    /// the lanes read consecutive bytes; 32 when each lane reads its own line).
    pub fn lines_per_load(&self) -> f64 {
        self.kv.line_reads as f64 / self.kv.wave_loads.max(1) as f64
    }

    /// Bytes the cache hierarchy moves to the lanes for the KV data, against the KV bytes: each
    /// wave-level load costs every line it touches, with no reuse between loads.
    pub fn line_traffic(&self) -> f64 {
        (self.kv.line_reads * LINE_BYTES) as f64 / self.kv_bytes as f64
    }

    /// The step's DRAM fetch against the KV bytes it must read if the caches keep every line
    /// from its first load to its last: each KV line touched, fetched once.
    pub fn fetch(&self) -> f64 {
        (self.kv.lines * LINE_BYTES) as f64 / self.kv_bytes as f64
    }

    /// KiB of KV lines one wave loads between two of its lane exchanges, at most: what its
    /// share of the caches nearest the lanes must hold for the line traffic to shrink toward the
    /// fetch (the wave's working set).
    pub fn wave_span_kib(&self) -> f64 {
        (self.kv.span_lines * LINE_BYTES) as f64 / 1024.0
    }

    /// The KV bytes the step must read per token and KV head.
    pub fn kv_bytes_per_token(&self) -> f64 {
        self.kv_bytes as f64 / (self.shape.context * self.shape.kv_heads) as f64
    }

    /// Bytes requested from the RoPE table per KV byte (0 without `pre_rope`).
    pub fn rope_reads(&self) -> f64 {
        self.rope.bytes as f64 / self.kv_bytes as f64
    }

    /// The RoPE table's share of the step's DRAM fetch, per KV byte, counted as [`fetch`]
    /// counts the KV lines: each table line touched, fetched once.
    ///
    /// [`fetch`]: MemoryReport::fetch
    pub fn rope_fetch(&self) -> f64 {
        (self.rope.lines * LINE_BYTES) as f64 / self.kv_bytes as f64
    }

    /// Bytes requested from everywhere else (queries, workspace, metadata) per KV byte.
    pub fn other_per_kv_byte(&self) -> f64 {
        self.other.bytes as f64 / self.kv_bytes as f64
    }
}

/// The counts of two regions' loads together; the span is the sum of the two (an upper bound:
/// their largest spans need not fall in the same epoch).
fn add(a: LoadCounts, b: LoadCounts) -> LoadCounts {
    LoadCounts {
        lane_loads: a.lane_loads + b.lane_loads,
        wave_loads: a.wave_loads + b.wave_loads,
        bytes: a.bytes + b.bytes,
        line_reads: a.line_reads + b.line_reads,
        lines: a.lines + b.lines,
        unique_bytes: a.unique_bytes + b.unique_bytes,
        span_lines: a.span_lines + b.span_lines,
    }
}

/// Runs one decode step of `scheme` at `shape` on the emulator, its cache filled with random
/// keys and values (calibrated on them first, where the scheme calibrates anything), and
/// reports the attention kernel's loads.
pub fn memory_report(scheme: &Scheme, shape: StepShape) -> Result<MemoryReport> {
    let config = CacheConfig {
        layers: 1,
        sequences: 1,
        kv_heads: shape.kv_heads,
        q_heads: shape.kv_heads * shape.gqa,
        head_dim: shape.head_dim,
        capacity: shape.context,
        scheme: *scheme,
        // A `pre_rope` cache needs its model's RoPE; the table's loads count as `rope`.
        rope: scheme.pre_rope.then_some(Rope {
            base: 10000.0,
            layout: RopeLayout::Interleaved,
        }),
    };
    let mut cache = KvCache::with_backend(config, Backend::Emu)?;
    let mut rng = Rng::new(7);
    let width = shape.kv_heads * shape.head_dim;
    let k = rng.normals(shape.context * width);
    let v = rng.normals(shape.context * width);
    cache.calibrate(0, &k, &v, 0)?;
    cache.append(0, 0, &k, &v)?;
    let q = rng.normals(config.q_heads * shape.head_dim);
    let mut out = vec![0f32; q.len()];
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let mut queries = [Query {
        seq: 0,
        q: &q,
        out: &mut out,
    }];
    let (result, launches) = trace_loads(|| cache.attend_many(0, &mut queries, scale));
    result?;
    let name = attention_kernel_name(scheme.k, scheme.v, shape.head_dim);
    let attention = launches
        .into_iter()
        .find(|l| l.kernel == name)
        .ok_or_else(|| Error::Unsupported(format!("the step launched no {name}")))?;
    Ok(MemoryReport {
        scheme: *scheme,
        kernel: attention.kernel,
        shape,
        kv_bytes: cache.bytes_read(0, 0)? as u64,
        kv: add(attention.cache, attention.state),
        rope: attention.rope,
        other: attention.other,
    })
}

/// The shape of the reports `hipkv info --kernels` prints: a 1024-token decode step, two KV
/// heads, GQA 8 (the largest ratio the cost model's targets cover).
pub fn report_shape(head_dim: usize) -> StepShape {
    StepShape {
        head_dim,
        kv_heads: 2,
        gqa: 8,
        context: 1024,
    }
}

/// The memory reports of `steps`, each an emulated step of its own, on all cores, in order.
fn memory_reports(steps: &[(Scheme, StepShape)]) -> Result<Vec<MemoryReport>> {
    steps
        .par_iter()
        .map(|(scheme, shape)| memory_report(scheme, *shape))
        .collect()
}

/// The memory report of every attention kernel (key format × value format) at head_dim 64,
/// 128 and 256, at [`report_shape`], in that order. Each report is an emulated step of its own,
/// so they run on all cores: one after another they take a minute.
pub fn kernel_reports() -> Result<Vec<MemoryReport>> {
    let mut steps = Vec::new();
    for head_dim in [64, 128, 256] {
        for k in crate::scheme::KERNEL_FORMATS {
            for v in crate::scheme::KERNEL_FORMATS {
                let scheme: Scheme = format!("k={k},v={v}").parse()?;
                steps.push((scheme, report_shape(head_dim)));
            }
        }
    }
    memory_reports(&steps)
}

/// The memory report of a decode step in each of the presets that store keys before RoPE
/// ([`crate::scheme::FRONTIER_PRESETS`]) at head_dim 64, 128 and 256, at [`report_shape`]: what
/// rotating the keys inside the loop loads from the RoPE table beside the KV bytes.
pub fn rope_reports() -> Result<Vec<MemoryReport>> {
    let mut steps = Vec::new();
    for head_dim in [64, 128, 256] {
        for preset in crate::scheme::FRONTIER_PRESETS {
            steps.push((preset.parse::<Scheme>()?, report_shape(head_dim)));
        }
    }
    memory_reports(&steps)
}

/// [`rope_reports`] as a table, one step per line.
pub fn rope_table(reports: &[MemoryReport]) -> String {
    let mut out = format!(
        "{:8}  {:>8}  {:>9}  {:>8}  {:>15}  {:>11}  {:>10}\n",
        "scheme",
        "head_dim",
        "KV B/tok",
        "KV fetch",
        "table requested",
        "table fetch",
        "step fetch"
    );
    for r in reports {
        out += &format!(
            "{:8}  {:>8}  {:>9.1}  {:>7.3}x  {:>14.2}x  {:>10.3}x  {:>9.3}x\n",
            r.scheme.to_string(),
            r.shape.head_dim,
            r.kv_bytes_per_token(),
            r.fetch(),
            r.rope_reads(),
            r.rope_fetch(),
            r.fetch() + r.rope_fetch(),
        );
    }
    out
}

/// The reports as a table, one kernel per line.
pub fn memory_table(reports: &[MemoryReport]) -> String {
    let width = reports
        .iter()
        .map(|r| r.kernel.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut out = format!(
        "{:width$}  {:>9}  {:>9}  {:>10}  {:>12}  {:>8}  {:>8}  {:>11}\n",
        "kernel",
        "KV B/tok",
        "requested",
        "lines/load",
        "line traffic",
        "fetch",
        "span KiB",
        "other/KV B"
    );
    for r in reports {
        out += &format!(
            "{:width$}  {:>9.1}  {:>8.2}x  {:>10.2}  {:>11.2}x  {:>7.3}x  {:>8.1}  {:>11.2}\n",
            r.kernel,
            r.kv_bytes_per_token(),
            r.kv_reads(),
            r.lines_per_load(),
            r.line_traffic(),
            r.fetch(),
            r.wave_span_kib(),
            r.other_per_kv_byte(),
        );
    }
    out
}
