//! Committed bindgen output: a test regenerates it and fails when the committed file is stale.

use std::path::Path;

use crate::toolchain;

/// Compares what `generate` makes (bindgen's output, or why it could not run) with the
/// committed file at `relative` (from the crate root); `HIPKV_BLESS=1` writes it instead.
/// Without libclang, or without what `generate` reads, the check is skipped (see
/// [`toolchain::skip`]).
pub fn check_committed(
    relative: &str,
    generate: impl FnOnce() -> Result<String, String>,
    regen: &str,
) {
    let what = format!("the staleness check of {relative}");
    // bindgen panics when it cannot load libclang: look for it first, as bindgen would.
    if let Err(e) = clang_sys::load() {
        return toolchain::skip(&what, format!("no libclang ({e})"));
    }
    let fresh = match generate() {
        Ok(fresh) => fresh,
        Err(e) => return toolchain::skip(&what, e),
    };
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    if std::env::var("HIPKV_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &fresh).unwrap_or_else(|e| panic!("write {relative}: {e}"));
        return;
    }
    let committed =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {relative}: {e}"));
    assert!(
        committed == fresh,
        "{relative} is stale: run {regen} and commit the result"
    );
}
