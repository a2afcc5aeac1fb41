//! The C ABI: `include/hipkv.h` is what bindgen reads into `src/capi/header.rs` (a stale copy
//! fails here; without libclang the check is skipped, unless `HIPKV_REQUIRE_HIP=1`), the crate
//! holds its functions to those declarations at compile time, and a C program
//! (`tests/c/server_step.c`) compiled with the system C compiler and linked against the static
//! library drives a batch on the emulated device and on the CPU and checks the outputs.

#[path = "common/bindings.rs"]
mod bindings;
#[path = "common/toolchain.rs"]
mod toolchain;

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The bindings as `scripts/regen-capi.sh` writes them.
fn generate() -> Result<String, String> {
    bindgen::Builder::default()
        .header(root().join("include/hipkv.h").to_string_lossy())
        .allowlist_type("hipkv_.*")
        .allowlist_var("HIPKV_.*")
        .allowlist_function("hipkv_.*")
        // Enumerators under their C names (`HIPKV_OK`, not `hipkv_status_HIPKV_OK`).
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
fn committed_capi_bindings_match_the_header() {
    bindings::check_committed("src/capi/header.rs", generate, "scripts/regen-capi.sh");
}

/// The static library cargo built with this test (beside it, in `target/<profile>/deps/`: the
/// copy in `target/<profile>/` is refreshed by `cargo build` only).
fn static_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join("libhipkv.a")
}

#[test]
fn a_c_program_drives_a_step_through_the_static_library() {
    let lib = static_library();
    assert!(
        lib.is_file(),
        "{} missing: the crate builds a staticlib",
        lib.display()
    );
    let out = std::env::temp_dir().join(format!("hipkv-server-step-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiled = Command::new(&cc)
        // gnu11: the test converts its f16 data with `_Float16`; the header is plain C.
        .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(root().join("include"))
        .arg(root().join("tests/c/server_step.c"))
        .arg(&lib)
        .args(["-lstdc++", "-lpthread", "-ldl", "-lm", "-o"])
        .arg(&out)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc}: {e}"));
    assert!(
        compiled.status.success(),
        "{cc} failed:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let run = Command::new(&out).output().unwrap();
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("server_step: ok"),
        "the C program failed:\n{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    println!("{stdout}");
}

/// The device ABI's dtype numbers are the C ABI's.
#[test]
fn dtypes_agree_between_the_two_headers() {
    use hipkv::abi;
    use hipkv::capi;
    for (device, c) in [
        (abi::HIPKV_DTYPE_F16, capi::HIPKV_DTYPE_F16),
        (abi::HIPKV_DTYPE_BF16, capi::HIPKV_DTYPE_BF16),
        (abi::HIPKV_DTYPE_F32, capi::HIPKV_DTYPE_F32),
    ] {
        assert_eq!(device, c);
    }
}
