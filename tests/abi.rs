//! `src/abi/generated.rs` is what bindgen makes of `hip/include/hipkv_abi.h` today: a stale copy
//! fails here. Regenerate with `scripts/regen-abi.sh` (needs libclang, which CI installs with
//! clang-19). Without libclang the check is skipped, unless `HIPKV_REQUIRE_HIP=1`.

#[path = "common/bindings.rs"]
mod bindings;
#[path = "common/toolchain.rs"]
mod toolchain;

use std::path::Path;

/// The bindings as `scripts/regen-abi.sh` writes them.
fn generate() -> Result<String, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = root.join("hip/include/hipkv_abi.h");
    bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_type("hipkv_.*")
        .allowlist_var("HIPKV_.*")
        // Enumerators under their C names (`HIPKV_Q8`, not `hipkv_format_HIPKV_Q8`).
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .derive_copy(true)
        .generate_comments(true)
        .generate()
        .map(|b| b.to_string())
        .map_err(|e| e.to_string())
}

#[test]
fn committed_bindings_match_the_header() {
    bindings::check_committed("src/abi/generated.rs", generate, "scripts/regen-abi.sh");
}
