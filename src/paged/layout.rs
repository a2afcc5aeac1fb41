//! What a server needs to know before it allocates: the bytes of a block, of a sequence slot's
//! state and of the workspace a batch needs, and the one place where the geometry every paged
//! kernel takes ([`hipkv_paged_geometry`]) is computed.

use crate::abi::{HIPKV_MAX_GQA, HIPKV_MAX_WAVES, hipkv_paged_geometry, hipkv_rows};
use crate::error::{Error, Result};
use crate::quant::QUERY_BLOCK;
use crate::rope::Rope;
use crate::scheme::{Format, HeadLayout, Scheme, Stream};

/// The alignment of every region a layout places: what a 128-bit load needs.
const ALIGN: usize = 256;

/// A layout as a server describes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayoutSpec {
    /// Storage formats and options; its `group_tokens` (`g=32|64`) is the block size.
    pub scheme: Scheme,
    pub kv_heads: usize,
    /// Query heads, a multiple of `kv_heads` (GQA up to 16).
    pub q_heads: usize,
    pub head_dim: usize,
    /// Blocks of one layer's cache.
    pub num_blocks: usize,
    /// Sequence slots: sequences that may hold state at once.
    pub max_seqs: usize,
    /// Tokens one sequence may hold.
    pub max_positions: usize,
    /// RoPE of the model: `pre_rope` schemes store keys unrotated and attention rotates them.
    /// Queries and (other schemes') keys arrive rotated; hipkv never rotates them.
    pub rope: Option<Rope>,
}

/// A validated [`LayoutSpec`] with its byte sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Layout {
    spec: LayoutSpec,
    head: HeadLayout,
    /// Byte offsets of the sink rows, residual windows and value window in one slot's state of
    /// one layer.
    sinks: [usize; 2],
    residual: [usize; 2],
    window_v: usize,
    state_bytes: usize,
}

/// Prepared queries and partial outputs of one attention call: what sizes its workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Query tokens of one `attend` call, at most.
    pub max_tokens: usize,
}

/// Query tokens whose partials every workspace holds however few `max_tokens` says, so that a
/// decode batch can split its sequences over the GPU (a batch of one decode token gets up to
/// this many splits).
pub(crate) const MIN_PARTIAL_TOKENS: usize = 1024;

impl Layout {
    pub fn new(spec: LayoutSpec) -> Result<Layout> {
        let positive = [
            ("kv_heads", spec.kv_heads),
            ("q_heads", spec.q_heads),
            ("num_blocks", spec.num_blocks),
            ("max_seqs", spec.max_seqs),
            ("max_positions", spec.max_positions),
        ];
        if let Some((what, _)) = positive.iter().find(|(_, n)| *n == 0) {
            return Err(Error::Unsupported(format!("{what} must be positive")));
        }
        if !spec.q_heads.is_multiple_of(spec.kv_heads) {
            return Err(Error::Unsupported(format!(
                "{} query heads are not a multiple of {} KV heads",
                spec.q_heads, spec.kv_heads
            )));
        }
        let gqa = spec.q_heads / spec.kv_heads;
        if gqa > HIPKV_MAX_GQA as usize {
            return Err(Error::Unsupported(format!(
                "GQA {gqa} (at most {HIPKV_MAX_GQA})"
            )));
        }
        spec.scheme.validate(spec.head_dim, spec.rope.is_some())?;
        // Indices the kernels hold in 32 bits (slots in 64).
        let fits = |n: usize| n <= i32::MAX as usize;
        if !fits(spec.num_blocks) || !fits(spec.max_seqs) || !fits(spec.max_positions) {
            return Err(Error::Unsupported(
                "num_blocks, max_seqs and max_positions must be below 2^31".into(),
            ));
        }
        let d = spec.head_dim;
        let head = spec.scheme.head_layout(d);
        // f16 rows of every KV head: multiples of 128 bytes (head_dim ≥ 64), so every region
        // and every slot stays aligned for 128-bit loads without padding.
        let f16_rows = |rows: usize| spec.kv_heads * rows * d * 2;
        let sinks_bytes = f16_rows(spec.scheme.sinks);
        let residual_bytes = |f: Format| {
            if f.is_grouped_by_tokens() {
                f16_rows(spec.scheme.group_tokens)
            } else {
                0
            }
        };
        let sinks = [0, sinks_bytes];
        let residual_k = 2 * sinks_bytes;
        let residual_v = residual_k + residual_bytes(spec.scheme.k);
        let window_v = residual_v + residual_bytes(spec.scheme.v);
        let state_bytes = window_v + f16_rows(spec.scheme.window_rows());
        let layout = Layout {
            spec,
            head,
            sinks,
            residual: [residual_k, residual_v],
            window_v,
            state_bytes,
        };
        let total = (layout.block_bytes() as u128).saturating_mul(spec.num_blocks as u128);
        if total > isize::MAX as u128 {
            return Err(Error::OutOfMemory {
                bytes: total,
                backend: "any",
            });
        }
        Ok(layout)
    }

    pub fn spec(&self) -> &LayoutSpec {
        &self.spec
    }

    pub fn scheme(&self) -> &Scheme {
        &self.spec.scheme
    }

    pub fn head_layout(&self) -> &HeadLayout {
        &self.head
    }

    pub fn head_dim(&self) -> usize {
        self.spec.head_dim
    }

    pub fn gqa(&self) -> usize {
        self.spec.q_heads / self.spec.kv_heads
    }

    /// Tokens per block (the scheme's page, `g`).
    pub fn block_tokens(&self) -> usize {
        self.spec.scheme.group_tokens
    }

    /// Bytes of one block of one layer: the packed K and V of every KV head, with their
    /// parameters and outlier stores.
    pub fn block_bytes(&self) -> usize {
        self.spec.kv_heads * self.head.bytes
    }

    /// Bytes of one layer's cache: `num_blocks × block_bytes`.
    pub fn cache_bytes(&self) -> usize {
        self.spec.num_blocks * self.block_bytes()
    }

    /// Bytes of one sequence slot's state for one layer: the f16 rows of its sink positions, for
    /// per-channel streams the residual window of its open block, and the value window.
    pub fn state_bytes(&self) -> usize {
        self.state_bytes
    }

    /// Byte offset, in one slot's state of one layer, of a stream's sink rows.
    pub(crate) fn sinks_offset(&self, stream: Stream) -> usize {
        self.sinks[stream as usize]
    }

    /// Byte offset, in one slot's state of one layer, of a stream's residual window (used by
    /// per-channel streams only).
    pub(crate) fn residual_offset(&self, stream: Stream) -> usize {
        self.residual[stream as usize]
    }

    /// Byte offset, in one slot's state of one layer, of the value-window row of `position` for
    /// KV head `head`: row `head · W + position % W`, `W = scheme.window_rows()` (the rule
    /// `hip/write.hip` and `hip/attention.hip` follow; the emulator tests compare them). A
    /// block's rows are consecutive window rows, W being a multiple of the block.
    pub(crate) fn window_row_offset(&self, head: usize, position: usize) -> usize {
        let rows = self.spec.scheme.window_rows();
        self.window_v + (head * rows + position % rows) * self.spec.head_dim * 2
    }

    /// The partial-output rows (query token × query head) a workspace for `limits` holds per
    /// split.
    pub(crate) fn partial_tokens(&self, limits: BatchLimits) -> usize {
        limits.max_tokens.max(MIN_PARTIAL_TOKENS)
    }

    /// Bytes of the workspace an `attend` call of up to `limits.max_tokens` query tokens needs:
    /// the prepared queries (with `iq`, also their int8 codes and block scales), their
    /// per-group sums and the splits' partial outputs.
    pub fn workspace_bytes(&self, limits: BatchLimits) -> usize {
        self.workspace(limits).end
    }

    /// Where each part of the workspace lies.
    pub(crate) fn workspace(&self, limits: BatchLimits) -> WorkspaceLayout {
        let (q_heads, d) = (self.spec.q_heads, self.spec.head_dim);
        let groups = d / self.k_group();
        let tokens = limits.max_tokens.max(1);
        let rows = self.partial_tokens(limits) * q_heads;
        let mut at = 0;
        let mut take = |bytes: usize| {
            let start = at;
            at = (at + bytes).next_multiple_of(ALIGN);
            start
        };
        let q = take(tokens * q_heads * d * 4);
        let q_sums = take(tokens * q_heads * groups * 4);
        let acc = take(rows * d * 4);
        let max = take(rows * 4);
        let sum = take(rows * 4);
        // Per-channel keys round each block's folded query in the partial outputs instead.
        let int_query = self.spec.scheme.rounds_query_per_step().then(|| {
            let codes = take(tokens * q_heads * d);
            let scales = take(tokens * q_heads * d / QUERY_BLOCK * 4);
            (codes, scales)
        });
        WorkspaceLayout {
            q,
            q_sums,
            int_query,
            acc,
            max,
            sum,
            end: at,
        }
    }

    /// Channels per key parameter group of per-token formats (`head_dim` for the others).
    pub(crate) fn k_group(&self) -> usize {
        match self.spec.scheme.k {
            Format::Tok { group, .. } => group.size(self.spec.head_dim),
            _ => self.spec.head_dim,
        }
    }

    /// Query rows one attention wave computes.
    pub fn rows_per_wave(&self) -> usize {
        hipkv_rows(self.spec.head_dim as u32) as usize
    }

    /// Query tokens one attention workgroup takes from a prefill chunk: `HIPKV_MAX_WAVES` waves
    /// of [`rows_per_wave`](Self::rows_per_wave) rows, over the GQA heads (at least one).
    pub fn prefill_tile_tokens(&self) -> usize {
        (HIPKV_MAX_WAVES as usize * self.rows_per_wave() / self.gqa()).max(1)
    }

    /// The geometry every paged kernel takes.
    pub(crate) fn geometry(&self) -> hipkv_paged_geometry {
        let s = &self.spec;
        let u = |x: usize| u32::try_from(x).expect("validated to fit in 32 bits");
        hipkv_paged_geometry {
            block_bytes: self.block_bytes() as u64,
            head_block_bytes: u(self.head.bytes),
            kv_heads: u(s.kv_heads),
            gqa: u(self.gqa()),
            head_dim: u(s.head_dim),
            block_tokens: u(self.block_tokens()),
            sinks: u(s.scheme.sinks),
            num_blocks: u(s.num_blocks),
            max_seqs: u(s.max_seqs),
            max_positions: u(s.max_positions),
            pre_rope: u32::from(s.scheme.pre_rope),
            rope_pairs_interleaved: u32::from(
                s.rope
                    .is_none_or(|r| r.layout == crate::rope::RopeLayout::Interleaved),
            ),
            rotate: s.scheme.rotation.abi_bits(),
            state_bytes: self.state_bytes as u64,
            sinks_k: u(self.sinks[0]),
            sinks_v: u(self.sinks[1]),
            residual_k: u(self.residual[0]),
            residual_v: u(self.residual[1]),
            value_window: u(s.scheme.value_window),
            window_v: u(self.window_v),
            k: crate::backend::stream_abi(&self.head.k, s.head_dim),
            v: crate::backend::stream_abi(&self.head.v, s.head_dim),
        }
    }
}

/// Byte offsets of the parts of an attention workspace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkspaceLayout {
    pub(crate) q: usize,
    pub(crate) q_sums: usize,
    /// `iq` only: the query's int8 codes and block scales.
    pub(crate) int_query: Option<(usize, usize)>,
    pub(crate) acc: usize,
    pub(crate) max: usize,
    pub(crate) sum: usize,
    pub(crate) end: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scheme: &str) -> LayoutSpec {
        LayoutSpec {
            scheme: scheme.parse().unwrap(),
            kv_heads: 2,
            q_heads: 8,
            head_dim: 64,
            num_blocks: 16,
            max_seqs: 4,
            max_positions: 512,
            rope: None,
        }
    }

    #[test]
    fn sizes_follow_the_scheme() {
        let l = Layout::new(spec("q8")).unwrap();
        assert_eq!(l.block_bytes(), 2 * l.head_layout().bytes);
        assert_eq!(l.cache_bytes(), 16 * l.block_bytes());
        // q8 keeps nothing per sequence.
        assert_eq!(l.state_bytes(), 0);
        let k = Layout::new(spec("kivi2,sinks=4,rv=0")).unwrap();
        // Sinks for K and V, and a residual window for the per-channel keys only.
        assert_eq!(k.state_bytes(), 2 * (2 * 4 * 64 * 2) + 2 * 32 * 64 * 2);
        assert!(k.residual_offset(Stream::K) >= 2 * 2 * 4 * 64 * 2);
        // KIVI's value window adds 128 + 32 f16 value rows per KV head, after the rest.
        let w = Layout::new(spec("kivi2,sinks=4")).unwrap();
        assert_eq!(w.window_row_offset(0, 0), k.state_bytes());
        assert_eq!(
            w.window_row_offset(1, 160 + 3),
            k.state_bytes() + (160 + 3) * 64 * 2
        );
        assert_eq!(w.state_bytes(), k.state_bytes() + 2 * 160 * 64 * 2);
    }

    #[test]
    fn bad_specs_are_typed_errors() {
        for (tweak, needle) in [
            (
                (|s: &mut LayoutSpec| s.q_heads = 7) as fn(&mut LayoutSpec),
                "multiple",
            ),
            (|s| s.num_blocks = 0, "num_blocks"),
            (|s| s.q_heads = 2 * 17, "GQA 17"),
            (|s| s.head_dim = 96, "head_dim 96"),
            (|s| s.max_positions = usize::MAX, "2^31"),
        ] {
            let mut s = spec("q8");
            tweak(&mut s);
            let e = Layout::new(s).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn the_workspace_holds_every_part_aligned() {
        let l = Layout::new(spec("q4_tok,iq=0")).unwrap();
        let w = l.workspace(BatchLimits { max_tokens: 100 });
        assert!(w.q < w.q_sums && w.q_sums < w.acc && w.acc < w.max && w.max < w.sum);
        assert!(
            [w.q_sums, w.acc, w.max, w.sum]
                .iter()
                .all(|x| x % ALIGN == 0)
        );
        // Partials for every split of the tokens a workspace holds at least.
        assert_eq!(w.max - w.acc, MIN_PARTIAL_TOKENS * 8 * 64 * 4);
        assert_eq!(l.workspace_bytes(BatchLimits { max_tokens: 100 }), w.end);
        assert!(w.int_query.is_none());
    }

    #[test]
    fn an_integer_query_workspace_also_holds_the_codes_and_scales() {
        let limits = BatchLimits { max_tokens: 100 };
        let plain = Layout::new(spec("q4_tok,iq=0")).unwrap().workspace(limits);
        let w = Layout::new(spec("q4_tok")).unwrap().workspace(limits);
        let (codes, scales) = w.int_query.unwrap();
        assert!(plain.end <= codes && codes < scales && scales < w.end);
        assert!(codes % ALIGN == 0 && scales % ALIGN == 0);
        // One byte per channel of the 100 tokens × 8 query heads × 64 channels, one f32 per 32.
        assert_eq!(scales - codes, 100 * 8 * 64);
        assert_eq!(
            w.end - scales,
            (100 * 8 * 2 * 4usize).next_multiple_of(ALIGN)
        );
    }
}
