//! CPU attention over a paged cache, decode and chunked prefill: split-K over (query, KV head,
//! block range) work items on all cores, dequantization into vector registers inside the score
//! and value loops, online softmax in base 2 with f32 state, and a combine step: the same
//! algorithm the GPU kernels run. By concern:
//! - [`view`]: where a sequence's rows are (blocks, sinks, residual windows);
//! - this module: the work items (the split of each sequence's blocks) and the combine;
//! - [`decode`]: each format's rows decoded into vector registers, and the channel orders;
//! - [`loops`]: the score, softmax and value loops of one work item;
//! - [`paged`]: the paged calls (`write_kv`, `attend`, `copy_blocks`) on host memory.

mod decode;
mod intq;
mod loops;
pub(crate) mod paged;
mod view;

use std::f32::consts::LOG2_E;
use std::ops::Range;

use rayon::prelude::*;

use super::simd::dispatch;
use crate::quant::{QUERY_BLOCK, quantize_query};

pub(crate) use view::{CacheView, PagedSeq};

use intq::IntQuery;
use loops::RunItem;

/// One query chunk of [`attend`]: `q_len × q_heads × head_dim` rows, and room for the output.
pub(crate) struct ChunkQuery<'a> {
    pub(crate) q: &'a [f32],
    pub(crate) out: &'a mut [f32],
}

/// Softmax state and output accumulator of every query row of one work item.
struct Partial {
    /// Running maximum of the base-2 logits, per row.
    max: Vec<f32>,
    /// Running sum of `exp2(logit - max)`, per row.
    sum: Vec<f32>,
    /// `rows × head_dim`, in the value format's channel order until the item's end.
    acc: Vec<f32>,
    /// `rows × head_dim` in natural order: the f16 value rows' share of `acc` when the value
    /// format's order is another (empty until such a row is summed), added to `acc` at the end.
    natural_acc: Vec<f32>,
}

/// The query rows of one (query, KV head): every query head of the GQA group at every chunk
/// position, pre-rotated and pre-scaled by `softmax_scale · log2(e)`.
pub(crate) struct HeadQueries {
    pub(crate) rows: Vec<f32>,
    /// Position of each row's token: it attends to positions `≤` this.
    pub(crate) pos: Vec<usize>,
    /// Positions a row attends to at most: its own and the `window − 1` before it.
    pub(crate) window: usize,
    /// The rows rounded to int8 (`iq`), for keys scored in integers; `rows` then holds them
    /// dequantized.
    pub(crate) int: Option<IntQuery>,
}

impl HeadQueries {
    /// The first position row `r` attends to.
    pub(crate) fn first_visible(&self, r: usize) -> usize {
        (self.pos[r] + 1).saturating_sub(self.window)
    }
}

/// Multiply-adds per stream (query rows × visible positions × head_dim, summed over the work
/// items) below which a step is not worth the thread pool's hand-off. Measured on a 2-core
/// machine (docs/performance.md, "Short steps on the caller's thread"): at GQA 4 and head_dim 128
/// over 8 KV heads, two threads lose at 128 positions (2^19), break even or win at 256 (2^20)
/// and win at 512.
const POOL_MIN_WORK: usize = 3 << 18;

/// Work item: one (query, KV head, page range).
struct Item {
    query: usize,
    head: usize,
    pages: Range<usize>,
}

/// Attends each query's chunk over its sequence, within a sliding `window` of positions
/// (`usize::MAX`: none), and writes `Query::out`.
pub(crate) fn attend(
    view: &CacheView<'_>,
    seqs: &[PagedSeq<'_>],
    queries: &mut [ChunkQuery<'_>],
    scale: f32,
    window: usize,
) {
    let spec = view.layout.spec();
    let (d, r) = (spec.head_dim, view.layout.gqa());
    let kv_heads = spec.kv_heads;
    let width = spec.q_heads * d;
    let prepared = prepare_queries(view, seqs, queries, scale, window);

    let threads = rayon::current_num_threads();
    let items: Vec<Item> = seqs
        .iter()
        .zip(&prepared)
        .enumerate()
        .flat_map(|(qi, (seq, heads))| {
            // From the page of the first row's first visible position (rows are in order).
            let first = heads[0].first_visible(0) / view.layout.block_tokens();
            let pages = view.pages(seq.len) - first;
            let want = (4 * threads).div_ceil(seqs.len() * kv_heads);
            let splits = want.min(pages / 4).max(1);
            let per = pages.div_ceil(splits).max(1);
            (0..kv_heads).flat_map(move |head| {
                (0..splits).map(move |s| Item {
                    query: qi,
                    head,
                    pages: first + s * per..first + ((s + 1) * per).min(pages.max(1)),
                })
            })
        })
        .collect();

    let run = |item: &Item| {
        let hq = &prepared[item.query][item.head];
        let blocks = view.blocks(&seqs[item.query], item.head, item.pages.clone());
        dispatch(RunItem {
            view,
            blocks: &blocks,
            hq,
        })
    };
    // Small steps and one-thread pools run the items on the caller's thread: handing them to
    // the pool and waiting for its workers costs two futex calls and a context switch per step,
    // tens of µs on a small machine, which is more than a short sequence's whole step.
    let work: usize = items
        .iter()
        .map(|it| {
            let rows = prepared[it.query][it.head].pos.len();
            it.pages.len() * view.layout.block_tokens() * rows * d
        })
        .sum();
    let partials: Vec<Partial> = if threads == 1 || work < POOL_MIN_WORK {
        items.iter().map(run).collect()
    } else {
        items.par_iter().map(run).collect()
    };

    // Combine the splits of each (query, head) and scatter rows back to the query layout.
    let mut next = 0;
    for (qi, (query, heads)) in queries.iter_mut().zip(&prepared).enumerate() {
        for (h, hq) in heads.iter().enumerate() {
            let group: Vec<&Partial> = items[next..]
                .iter()
                .zip(&partials[next..])
                .take_while(|(it, _)| it.query == qi && it.head == h)
                .map(|(_, p)| p)
                .collect();
            next += group.len();
            for row in 0..hq.pos.len() {
                let (t, j) = (row / r, row % r);
                let out = &mut query.out[t * width + (h * r + j) * d..][..d];
                combine(&group, row, d, out);
            }
        }
    }
}

/// Every query's rows per KV head (already rotated), scaled by `softmax_scale · log2(e)`: what
/// the score loop takes, with the position each row attends up to.
fn prepare_queries(
    view: &CacheView<'_>,
    seqs: &[PagedSeq<'_>],
    queries: &[ChunkQuery<'_>],
    scale: f32,
    window: usize,
) -> Vec<Vec<HeadQueries>> {
    let spec = view.layout.spec();
    let (d, r) = (spec.head_dim, view.layout.gqa());
    let width = spec.q_heads * d;
    // Per-channel keys round each page's folded query instead (`loops::run_item`).
    let int_query = view.layout.scheme().rounds_query_per_step();
    queries
        .iter()
        .zip(seqs)
        .map(|(query, seq)| {
            let q_len = query.q.len() / width;
            (0..spec.kv_heads)
                .map(|h| {
                    let mut rows = Vec::with_capacity(q_len * r * d);
                    let mut pos = Vec::with_capacity(q_len * r);
                    let mut int = int_query.then(|| IntQuery {
                        codes: vec![0; q_len * r * d],
                        scales: vec![0.0; q_len * r * d / QUERY_BLOCK],
                    });
                    for t in 0..q_len {
                        let p = seq.len - q_len + t;
                        for j in 0..r {
                            let at = t * width + (h * r + j) * d;
                            let row = &query.q[at..at + d];
                            match &mut int {
                                None => rows.extend(row.iter().map(|x| x * scale * LOG2_E)),
                                Some(int) => {
                                    // The f32 rows are the rounded query too: every score of
                                    // the step is one of `q̂`.
                                    let i = pos.len();
                                    let codes = &mut int.codes[i * d..][..d];
                                    let scales =
                                        &mut int.scales[i * d / QUERY_BLOCK..][..d / QUERY_BLOCK];
                                    quantize_query(row, codes, scales);
                                    for (c, s) in codes.chunks_exact(QUERY_BLOCK).zip(scales) {
                                        *s *= scale * LOG2_E;
                                        rows.extend(c.iter().map(|&x| *s * f32::from(x)));
                                    }
                                }
                            }
                            pos.push(p);
                        }
                    }
                    HeadQueries {
                        rows,
                        pos,
                        window,
                        int,
                    }
                })
                .collect()
        })
        .collect()
}

/// Merges the split partials of one row: `Σ 2^(m_s - M) acc_s / Σ 2^(m_s - M) l_s`.
fn combine(parts: &[&Partial], row: usize, d: usize, out: &mut [f32]) {
    let m = parts
        .iter()
        .map(|p| p.max[row])
        .fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut sum = 0.0;
    for p in parts {
        if p.sum[row] == 0.0 {
            continue;
        }
        let w = (p.max[row] - m).exp2();
        sum += w * p.sum[row];
        for (o, a) in out.iter_mut().zip(&p.acc[row * d..(row + 1) * d]) {
            *o += w * a;
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}
