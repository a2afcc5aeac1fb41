//! How one `attend` call is launched, from the host-side numbers a server passes (never from
//! device memory): waves per workgroup, query tiles per sequence, and the split of each
//! sequence's blocks.

use crate::abi::HIPKV_MAX_WAVES;
use crate::backend::SplitPlan;

use super::layout::{BatchLimits, Layout};

/// The launch of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttendPlan {
    /// Waves per workgroup: one for a decode-only batch, `HIPKV_MAX_WAVES` with prefill chunks.
    pub waves: usize,
    /// Workgroups per sequence and KV head along the query rows.
    pub tiles_per_seq: usize,
    pub splits: usize,
    pub blocks_per_split: usize,
}

impl AttendPlan {
    /// The plan for `num_seqs` sequences of at most `max_q_len` query tokens (`tokens` in all)
    /// and `max_seq_len` tokens, attending within a sliding `window` if any, on `compute_units`
    /// CUs, within a workspace sized for `limits`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layout: &Layout,
        limits: BatchLimits,
        num_seqs: usize,
        tokens: usize,
        max_q_len: usize,
        max_seq_len: usize,
        window: Option<usize>,
        compute_units: usize,
    ) -> AttendPlan {
        // A decode token's GQA rows take a wave per `rows_per_wave`; a prefill chunk's tile
        // every wave.
        let waves = if max_q_len > 1 {
            HIPKV_MAX_WAVES as usize
        } else {
            layout
                .gqa()
                .div_ceil(layout.rows_per_wave())
                .min(HIPKV_MAX_WAVES as usize)
        };
        let tile_rows = waves * layout.rows_per_wave();
        let tiles_per_seq = (max_q_len.max(1) * layout.gqa()).div_ceil(tile_rows);
        // The blocks one wave reads: the sequence's, or within a window those from the one
        // holding its lowest row's first position to the one holding its highest row's last,
        // whose positions differ by less than window + max_q_len (so the kernels' splits,
        // counted from that first block, cover them).
        let bt = layout.block_tokens();
        let max_blocks = window.map_or(max_seq_len.div_ceil(bt), |w| {
            max_seq_len
                .div_ceil(bt)
                .min((w + max_q_len.max(1) - 1).div_ceil(bt) + 1)
        });
        let waves_per_split = num_seqs * tiles_per_seq * layout.spec().kv_heads * waves;
        let mut split = SplitPlan::new(max_blocks, waves_per_split, compute_units);
        // Every split of every query row needs its partials in the workspace.
        let most = (layout.partial_tokens(limits) / tokens.max(1)).max(1);
        if split.splits > most {
            split.pages_per_split = max_blocks.div_ceil(most);
            split.splits = max_blocks.div_ceil(split.pages_per_split).max(1);
        }
        AttendPlan {
            waves,
            tiles_per_seq,
            splits: split.splits,
            blocks_per_split: split.pages_per_split,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::GFX1201_COMPUTE_UNITS;
    use crate::paged::LayoutSpec;

    fn layout(gqa: usize, head_dim: usize) -> Layout {
        Layout::new(LayoutSpec {
            scheme: "q8".parse().unwrap(),
            kv_heads: 8,
            q_heads: 8 * gqa,
            head_dim,
            num_blocks: 4096,
            max_seqs: 64,
            max_positions: 1 << 17,
            rope: None,
        })
        .unwrap()
    }

    #[test]
    fn decode_batches_take_a_wave_per_four_heads_and_split_long_sequences() {
        assert_eq!(layout(8, 64).rows_per_wave(), 4);
        let limits = BatchLimits { max_tokens: 1 };
        let gqa8 = AttendPlan::new(
            &layout(8, 64),
            limits,
            1,
            1,
            1,
            64,
            None,
            GFX1201_COMPUTE_UNITS,
        );
        assert_eq!((gqa8.waves, gqa8.tiles_per_seq), (2, 1));
        let l = layout(4, 128);
        let limits = BatchLimits { max_tokens: 64 };
        let plan = AttendPlan::new(&l, limits, 1, 1, 1, 32768, None, GFX1201_COMPUTE_UNITS);
        assert_eq!((plan.waves, plan.tiles_per_seq), (1, 1));
        assert_eq!(plan.splits * plan.blocks_per_split, 1024);
        assert!(plan.splits >= 64, "{plan:?}");
    }

    #[test]
    fn a_sliding_window_splits_only_the_blocks_it_reaches() {
        let l = layout(4, 128);
        let bt = l.block_tokens();
        let limits = BatchLimits { max_tokens: 64 };
        let whole = AttendPlan::new(&l, limits, 1, 1, 1, 32768, None, GFX1201_COMPUTE_UNITS);
        let window = Some(512);
        let local = AttendPlan::new(&l, limits, 1, 1, 1, 32768, window, GFX1201_COMPUTE_UNITS);
        // A decode token's 512 positions start anywhere in a block: one block more.
        let reach = 512 / bt + 1;
        assert!(local.splits * local.blocks_per_split >= reach, "{local:?}");
        assert!(
            local.splits * local.blocks_per_split < 2 * reach,
            "{local:?}"
        );
        assert!(local.splits < whole.splits, "{local:?} against {whole:?}");
        // A window longer than the sequences changes nothing.
        let long = AttendPlan::new(&l, limits, 1, 1, 1, 256, Some(4096), GFX1201_COMPUTE_UNITS);
        let none = AttendPlan::new(&l, limits, 1, 1, 1, 256, None, GFX1201_COMPUTE_UNITS);
        assert_eq!(long, none);
    }

    #[test]
    fn prefill_chunks_take_tiles_of_four_waves() {
        // GQA 4: 4 waves × 4 rows = 4 query tokens per tile.
        let l = layout(4, 128);
        assert_eq!(l.prefill_tile_tokens(), 4);
        let limits = BatchLimits { max_tokens: 2048 };
        let plan = AttendPlan::new(&l, limits, 3, 520, 512, 4096, None, GFX1201_COMPUTE_UNITS);
        assert_eq!((plan.waves, plan.tiles_per_seq), (4, 128));
        assert_eq!(plan.splits, 1, "{plan:?}");
    }

    #[test]
    fn splits_stay_within_the_workspace() {
        let l = layout(4, 128);
        let limits = BatchLimits { max_tokens: 600 };
        // 600 decode tokens, each a sequence of 128k: the workspace's 1024 partial tokens
        // allow one split.
        let plan = AttendPlan::new(
            &l,
            limits,
            600,
            600,
            1,
            1 << 17,
            None,
            GFX1201_COMPUTE_UNITS,
        );
        assert_eq!(plan.splits, 1);
        assert_eq!(plan.blocks_per_split, 4096);
    }
}
