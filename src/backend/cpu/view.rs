//! Where a sequence's rows are: its blocks (from its block table, past the sinks), its sink
//! rows, its open block's residual window and its value window (in its slot state).

use std::ops::Range;

use crate::paged::Layout;
use crate::quant::{self, Codebook, get_f16};
use crate::rope::RopeTable;
use crate::scheme::{Format, OUTLIER_COUNT_BYTES, OUTLIER_SLOT_BYTES, Stream};

/// Read-only view of one layer of a paged cache.
pub(crate) struct CacheView<'a> {
    pub(crate) layout: &'a Layout,
    /// The layer's blocks: `num_blocks × block_bytes`.
    pub(crate) cache: &'a [u8],
    /// The RoPE table `pre_rope` keys are rotated with.
    pub(crate) rope: Option<&'a RopeTable>,
    /// The layer's codebooks of keys and values (`nuq` streams).
    pub(crate) books: [Option<&'a Codebook>; 2],
}

/// One sequence as attention reads it: its length, block table and this layer's slot state.
pub(crate) struct PagedSeq<'a> {
    pub(crate) len: usize,
    pub(crate) blocks: &'a [i32],
    pub(crate) state: &'a [u8],
}

/// One stream (K or V) of a run of consecutive tokens of one head, in one storage format.
#[derive(Clone, Copy)]
pub(crate) struct StreamBlock<'a> {
    pub(super) format: Format,
    pub(super) head_dim: usize,
    /// Packed rows, starting at the block's first token.
    pub(super) rows: &'a [u8],
    pub(super) row_bytes: usize,
    /// Quantization parameters of the block's tokens (per-token formats: starting at the first
    /// token; per-channel: the page's pairs).
    pub(super) params: &'a [u8],
    /// Outlier counts and slots, when the stream has an outlier store.
    pub(super) outliers: Option<(&'a [u8], &'a [u8], usize)>,
    /// The levels the codes decode to (`nuq`); `None`: the codes themselves.
    pub(super) book: Option<&'a Codebook>,
}

impl<'a> StreamBlock<'a> {
    pub(super) fn f16_rows(rows: &'a [u8], head_dim: usize) -> Self {
        StreamBlock {
            format: Format::F16,
            head_dim,
            rows,
            row_bytes: head_dim * 2,
            params: &[],
            outliers: None,
            book: None,
        }
    }

    pub(super) fn row(&self, t: usize) -> &'a [u8] {
        &self.rows[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    pub(super) fn token_params(&self, t: usize) -> &'a [u8] {
        let n = self.format.params_bytes(1, self.head_dim);
        &self.params[t * n..(t + 1) * n]
    }

    /// The outliers of token `t`: `(channel, exact value)`.
    pub(super) fn outliers(&self, t: usize) -> impl Iterator<Item = (usize, f32)> + 'a {
        let (counts, slots, cap) = self.outliers.unwrap_or((&[], &[], 0));
        let n = if cap == 0 {
            0
        } else {
            let at = t * OUTLIER_COUNT_BYTES;
            u16::from_le_bytes([counts[at], counts[at + 1]]) as usize
        };
        (0..n).map(move |i| {
            let at = (t * cap + i) * OUTLIER_SLOT_BYTES;
            (
                u16::from_le_bytes([slots[at], slots[at + 1]]) as usize,
                get_f16(slots, at + 2),
            )
        })
    }

    /// Reference dequantization of token `t` (dense part, then the exact outliers).
    pub(crate) fn dequantize(&self, t: usize, out: &mut [f32]) {
        match self.format {
            Format::Chan { bits } => {
                quant::dequantize_chan_row(bits, self.row(t), self.params, out, self.book)
            }
            f => quant::dequantize_row(f, self.row(t), self.token_params(t), out, self.book),
        }
        for (c, x) in self.outliers(t) {
            out[c] = x;
        }
    }
}

/// Consecutive tokens of one head stored alike: the sinks, or one page.
pub(crate) struct Block<'a> {
    pub(crate) first_pos: usize,
    pub(crate) tokens: usize,
    pub(crate) k: StreamBlock<'a>,
    pub(crate) v: StreamBlock<'a>,
}

impl<'a> CacheView<'a> {
    /// Blocks a sequence of `len` tokens has started.
    pub(crate) fn pages(&self, len: usize) -> usize {
        len.div_ceil(self.layout.block_tokens())
    }

    /// The runs of `head` in the given block range: rows of each block from the first position
    /// past the sinks (the values of a block that holds any of the last R positions from the
    /// value window's f16 rows); the sinks come with the range that starts at block 0.
    pub(crate) fn blocks(
        &self,
        seq: &PagedSeq<'a>,
        head: usize,
        pages: Range<usize>,
    ) -> Vec<Block<'a>> {
        let layout = self.layout;
        let s = layout.scheme();
        let d = layout.head_dim();
        let g = layout.block_tokens();
        let row = d * 2;
        let head_layout = layout.head_layout();
        let pages = pages.start..pages.end.min(self.pages(seq.len));
        // One block per page and one for the sinks: growing the vector by doubling copied
        // it several times per call (1-2% of a 1024-token step in `perf`).
        let mut out = Vec::with_capacity(pages.len() + 1);
        let sinks = seq.len.min(s.sinks);
        if pages.start == 0 && sinks > 0 {
            let rows = |stream| {
                let at = layout.sinks_offset(stream) + head * s.sinks * row;
                &seq.state[at..at + sinks * row]
            };
            out.push(Block {
                first_pos: 0,
                tokens: sinks,
                k: StreamBlock::f16_rows(rows(Stream::K), d),
                v: StreamBlock::f16_rows(rows(Stream::V), d),
            });
        }
        let window = s.value_window;
        for p in pages {
            let first_pos = p * g;
            let begin = s.sinks.saturating_sub(first_pos).min(g);
            let end = (seq.len - first_pos).min(g);
            if begin >= end {
                continue;
            }
            let id = seq.blocks[p] as usize;
            let block = &self.cache[id * layout.block_bytes() + head * head_layout.bytes..]
                [..head_layout.bytes];
            // Rows [begin, end) of a stream of the block (open when the sequence ends in it).
            let open = end < g;
            let stream = |kind: Stream, begin: usize, end: usize| {
                let sl = head_layout.stream(kind);
                if sl.format.is_grouped_by_tokens() && open {
                    // The open block: its rows wait in the residual window.
                    let at = layout.residual_offset(kind) + (head * g + begin) * row;
                    return StreamBlock::f16_rows(&seq.state[at..at + (end - begin) * row], d);
                }
                let per_token = if sl.format.is_grouped_by_tokens() {
                    0
                } else {
                    sl.format.params_bytes(1, d)
                };
                StreamBlock {
                    format: sl.format,
                    head_dim: d,
                    rows: &block[sl.rows + begin * sl.row_bytes..sl.rows + end * sl.row_bytes],
                    row_bytes: sl.row_bytes,
                    params: &block[sl.params + begin * per_token..sl.counts],
                    outliers: (sl.outlier_slots > 0).then(|| {
                        (
                            &block[sl.counts + begin * OUTLIER_COUNT_BYTES..sl.slots],
                            &block
                                [sl.slots + begin * sl.outlier_slots * OUTLIER_SLOT_BYTES..sl.end],
                            sl.outlier_slots,
                        )
                    }),
                    book: self.books[kind as usize],
                }
            };
            // The window's R + g rows hold every position of the blocks holding the last R,
            // a block's in consecutive rows.
            let v = if window > 0 && first_pos + g + window > seq.len {
                let at = layout.window_row_offset(head, first_pos + begin);
                StreamBlock::f16_rows(&seq.state[at..at + (end - begin) * row], d)
            } else {
                stream(Stream::V, begin, end)
            };
            out.push(Block {
                first_pos: first_pos + begin,
                tokens: end - begin,
                k: stream(Stream::K, begin, end),
                v,
            });
        }
        out
    }
}
