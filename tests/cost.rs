//! The memory half of the GPU cost model (`hipkv::cost`): the attention kernels' global loads,
//! traced by the SIMT emulator, against the KV bytes a step must read.

use hipkv::cost::{StepShape, kernel_reports, memory_report};
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
