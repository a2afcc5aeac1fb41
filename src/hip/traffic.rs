//! Counts of the runtime calls a server must not pay for on its per-step path: allocations,
//! host↔device copies and synchronizations, made by the calling thread. The HIP runtime tier
//! counts its own calls, and the emulated device (`Backend::Emu`, host memory standing in for
//! device memory) counts the calls that stand in for them, so a test on any machine can prove
//! that `write_kv` and `attend` make none.

use std::cell::Cell;

/// Runtime calls made by one thread so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Device allocations (`hipMalloc`, or the emulated device's).
    pub allocations: u64,
    /// Copies between host and device memory (`hipMemcpy`, `hipMemset`, or emulated ones).
    pub copies: u64,
    /// Waits for the device (`hipStreamSynchronize`, `hipEventSynchronize`).
    pub synchronizations: u64,
}

thread_local! {
    static COUNTS: Cell<Traffic> = const {
        Cell::new(Traffic { allocations: 0, copies: 0, synchronizations: 0 })
    };
}

/// What the calling thread has done so far.
pub fn traffic() -> Traffic {
    COUNTS.with(Cell::get)
}

fn count(f: impl FnOnce(&mut Traffic)) {
    COUNTS.with(|c| {
        let mut t = c.get();
        f(&mut t);
        c.set(t);
    });
}

pub(crate) fn count_allocation() {
    count(|t| t.allocations += 1);
}

pub(crate) fn count_copy() {
    count(|t| t.copies += 1);
}

pub(crate) fn count_synchronization() {
    count(|t| t.synchronizations += 1);
}
