//! Committed bindgen output: a test regenerates it and fails when the committed file is stale.

use std::path::Path;

/// Compares `fresh` (bindgen's output, or why it could not run) with the committed file at
/// `relative` (from the crate root); `HIPKV_BLESS=1` writes it instead. Without bindgen's
/// prerequisites the check is skipped, unless `HIPKV_REQUIRE_HIP=1`.
pub fn check_committed(relative: &str, fresh: Result<String, String>, regen: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    let fresh = match fresh {
        Ok(fresh) => fresh,
        Err(e) if std::env::var("HIPKV_REQUIRE_HIP").as_deref() != Ok("1") => {
            eprintln!("skipped: cannot generate {relative} here ({e})");
            return;
        }
        Err(e) => panic!("HIPKV_REQUIRE_HIP=1 but {relative} cannot be generated: {e}"),
    };
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
