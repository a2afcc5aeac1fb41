//! How decode attention divides each sequence's pages among workgroups (split-K): enough
//! workgroups that a batch of one fills the GPU, and no split so short that writing and merging
//! its partial results costs more than the parallelism gains.

/// Compute units of the RX 9070 XT (gfx1201), the card hipkv is built for; the emulator plans
/// its launches as for this device, so it runs the launch shapes the GPU would.
pub const GFX1201_COMPUTE_UNITS: usize = 64;
/// Waves per compute unit a launch aims for: two SIMD32s per CU, each with the 8 waves the
/// decode kernels keep resident (`tests/resources.rs`), hiding DRAM latency.
const WAVES_PER_CU: usize = 16;
/// Pages (of 32 or 64 tokens) a split covers at least.
const MIN_PAGES_PER_SPLIT: usize = 2;

/// The split of one decode-attention launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Splits per (query, KV head, row group): the grid's x dimension.
    pub splits: usize,
    /// Pages each split covers (the last may cover fewer, or none for shorter sequences).
    pub pages_per_split: usize,
}

impl SplitPlan {
    /// The plan for sequences of at most `max_pages` pages, with `workgroups_per_split`
    /// workgroups per split (queries × KV heads × row groups), on `compute_units` CUs.
    pub fn new(max_pages: usize, workgroups_per_split: usize, compute_units: usize) -> SplitPlan {
        let target_waves = compute_units.max(1) * WAVES_PER_CU;
        let wanted = target_waves.div_ceil(workgroups_per_split.max(1));
        let pages_per_split = max_pages.div_ceil(wanted).max(MIN_PAGES_PER_SPLIT);
        SplitPlan {
            splits: max_pages.div_ceil(pages_per_split).max(1),
            pages_per_split,
        }
    }

    /// Workgroups of the launch.
    pub fn workgroups(&self, workgroups_per_split: usize) -> usize {
        self.splits * workgroups_per_split
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUS: usize = GFX1201_COMPUTE_UNITS;

    #[test]
    fn a_long_sequence_alone_fills_the_device() {
        // Batch 1, 8 KV heads, GQA 4 (one row group): 8 workgroups per split; 32k tokens.
        let plan = SplitPlan::new(1024, 8, CUS);
        assert_eq!(
            plan,
            SplitPlan {
                splits: 128,
                pages_per_split: 8
            }
        );
        assert!(plan.workgroups(8) >= CUS * WAVES_PER_CU);
    }

    #[test]
    fn short_sequences_keep_whole_pages_per_split() {
        assert_eq!(
            SplitPlan::new(5, 8, CUS),
            SplitPlan {
                splits: 3,
                pages_per_split: 2
            }
        );
        assert_eq!(
            SplitPlan::new(1, 1, CUS),
            SplitPlan {
                splits: 1,
                pages_per_split: 2
            }
        );
        assert_eq!(SplitPlan::new(0, 8, CUS).splits, 1);
    }

    #[test]
    fn large_batches_need_fewer_splits() {
        // 64 sequences × 8 KV heads already give 512 workgroups per split.
        let plan = SplitPlan::new(1024, 512, CUS);
        assert_eq!(
            plan,
            SplitPlan {
                splits: 2,
                pages_per_split: 512
            }
        );
        // More than enough workgroups: one split.
        assert_eq!(SplitPlan::new(1024, 4096, CUS).splits, 1);
    }

    #[test]
    fn every_page_is_covered_once() {
        for pages in 0..300 {
            for wg in [1, 3, 8, 100, 2000] {
                let p = SplitPlan::new(pages, wg, CUS);
                assert!(p.splits * p.pages_per_split >= pages, "{pages} {wg}: {p:?}");
                assert!(
                    (p.splits - 1) * p.pages_per_split < pages.max(1),
                    "{pages} {wg}: {p:?}"
                );
            }
        }
    }
}
