//! The memory half of the GPU cost model (`hipkv::cost`): the attention kernels' global loads,
//! traced by the SIMT emulator, against the KV bytes a step must read.

use hipkv::cost::{StepShape, kernel_reports, memory_report, rope_reports};
use hipkv::scheme::{KERNEL_FORMATS, Scheme};

/// Every key × value pair, with sinks, a value window or neither, over a partial last page: the
/// kernels load every KV byte the step needs and no other (`KvCache::bytes_read`), and fetch
/// it in at most 10% more 128-byte lines' bytes.
#[test]
fn kernels_read_exactly_the_kv_bytes_a_step_needs() {
    let shape = StepShape {
        head_dim: 64,
        kv_heads: 2,
        gqa: 4,
        context: 200,
    };
    for (i, k) in KERNEL_FORMATS.iter().enumerate() {
        for (j, v) in KERNEL_FORMATS.iter().enumerate() {
            // (f16 values have no value window: they are f16 already.)
            let options = match (i + j) % 3 {
                0 => "",
                2 if *v != "f16" => ",rv=32",
                _ => ",sinks=4",
            };
            let scheme: Scheme = format!("k={k},v={v}{options}").parse().unwrap();
            let r = memory_report(&scheme, shape).unwrap();
            assert_eq!(r.kv.unique_bytes, r.kv_bytes, "{scheme}: {r:?}");
            assert!(r.fetch() <= 1.1, "{scheme}: fetch {:.3}x", r.fetch());
            assert!(r.line_traffic() >= r.fetch(), "{scheme}: {r:?}");
        }
    }
}

/// The table `hipkv info --kernels` prints: every kernel at head_dim 64, 128 and 256 reads its
/// KV bytes exactly and fetches at most 1.1× them; a wave-level load of KV data touches at
/// least one line and at most 64 (32 lanes, each load within two lines).
#[test]
fn every_kernel_fetches_at_most_a_tenth_more_than_it_needs() {
    let reports = kernel_reports().unwrap();
    assert_eq!(
        reports.len(),
        3 * KERNEL_FORMATS.len() * KERNEL_FORMATS.len()
    );
    for r in &reports {
        assert_eq!(r.kv.unique_bytes, r.kv_bytes, "{}", r.kernel);
        assert!(r.fetch() <= 1.1, "{}: fetch {:.3}x", r.kernel, r.fetch());
        let lines = r.lines_per_load();
        assert!((1.0..=64.0).contains(&lines), "{}: {lines}", r.kernel);
    }
    let table = hipkv::cost::memory_table(&reports);
    assert_eq!(table.lines().count(), reports.len() + 1);
    assert!(table.contains("hipkv_attn_q4_chan_q4_tok_d128"), "{table}");
}

/// A step whose keys are stored before RoPE reads from the table the rows of the offsets in a
/// block (the first `g` rows: each key turns by its row in its block) and the row of each
/// block's first position (the query turns back by it once per block), each once at least, and
/// nothing else; a step of the same formats with keys stored rotated reads none of it. The KV
/// bytes are read as exactly as without `pre_rope`.
#[test]
fn pre_rope_steps_read_the_rope_table_by_block_offset() {
    let shape = StepShape {
        head_dim: 64,
        kv_heads: 2,
        gqa: 4,
        context: 200,
    };
    let row_bytes = (shape.head_dim * 4) as u64;
    for (scheme, pre_rope) in [("kv4", true), ("kivi4,pre_rope", true), ("kivi4", false)] {
        let scheme: Scheme = scheme.parse().unwrap();
        let r = memory_report(&scheme, shape).unwrap();
        assert_eq!(r.kv.unique_bytes, r.kv_bytes, "{scheme}: {r:?}");
        if pre_rope {
            let g = scheme.group_tokens;
            let blocks = shape.context.div_ceil(g);
            // Rows 0..g, and the first rows of blocks 1.. (block 0's is row 0).
            let rows = (g + blocks - 1) as u64;
            assert_eq!(r.rope.unique_bytes, rows * row_bytes, "{scheme}: {r:?}");
            assert!(
                r.rope_fetch() > 0.0 && r.rope_reads() >= r.rope_fetch(),
                "{scheme}"
            );
        } else {
            assert_eq!(r.rope, Default::default(), "{scheme}: {r:?}");
        }
    }
    let reports = rope_reports().unwrap();
    assert_eq!(reports.len(), 9);
    let table = hipkv::cost::rope_table(&reports);
    assert_eq!(table.lines().count(), reports.len() + 1);
    assert!(table.lines().nth(1).unwrap().starts_with("kv4 "), "{table}");
}
