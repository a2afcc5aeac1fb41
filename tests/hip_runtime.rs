//! The HIP runtime as this machine has it. CI installs Debian's `libamdhip64-5` on a machine
//! without an AMD GPU and sets `HIPKV_REQUIRE_HIP=1`: there the runtime must open, report no
//! device, and leave the CPU as the backend, saying so. Elsewhere the test checks whichever
//! outcome the machine gives for consistency.

use hipkv::backend::HipStatus;
use hipkv::{Backend, Error};

fn required() -> bool {
    std::env::var("HIPKV_REQUIRE_HIP").as_deref() == Ok("1")
}

#[test]
fn the_runtime_opens_finds_no_gpu_and_the_cpu_is_chosen() {
    let status = HipStatus::probe();
    let (backend, why) = Backend::best();
    assert_eq!(backend, Backend::Cpu, "no HIP backend exists yet");
    assert_eq!(why, status.obstacle());
    match &status.runtime {
        Err(Error::HipUnavailable(e)) if !required() => {
            eprintln!("skipped: no HIP runtime here ({e})");
            assert!(!e.tried.is_empty());
        }
        Err(e) => panic!("HIPKV_REQUIRE_HIP=1 but the HIP runtime did not answer: {e}"),
        Ok(found) => {
            assert!(found.library.contains("libamdhip64"), "{found:?}");
            assert!(found.runtime_version > 0, "{found:?}");
            if required() {
                // CI: Debian's HIP 5.2 on a machine with no AMD GPU.
                assert!(found.devices.is_empty(), "CI has no GPU: {found:?}");
                assert!(found.version_string().starts_with("5.2."), "{found:?}");
                assert!(!status.built_archs.is_empty(), "CI builds the kernels");
                assert!(
                    why.starts_with("the HIP runtime 5.2.") && why.ends_with("found no GPU"),
                    "{why}"
                );
            }
            for d in &found.devices {
                assert!(d.arch.starts_with("gfx") && !d.arch.contains(':'), "{d:?}");
                assert!(d.compute_units > 0 && d.memory_bytes > 0, "{d:?}");
            }
        }
    }
}
