//! The occupancy formula of `hipkv::codeobj` against the compiler's `; Occupancy: N` comments,
//! over the code objects `scripts/check-occupancy-formula.sh` compiles (it runs this test with
//! `HIPKV_OCCUPANCY_SWEEP` naming them). Ignored otherwise: it needs a clang for every arch.

use std::path::Path;

#[test]
#[ignore = "run by scripts/check-occupancy-formula.sh, which compiles the code objects"]
fn occupancy_formula_matches_the_compiler() {
    let Some(dir) = std::env::var_os("HIPKV_OCCUPANCY_SWEEP") else {
        eprintln!("SKIPPED: HIPKV_OCCUPANCY_SWEEP is not set (scripts/check-occupancy-formula.sh)");
        return;
    };
    let mut objects: Vec<_> = std::fs::read_dir(Path::new(&dir))
        .expect("read HIPKV_OCCUPANCY_SWEEP")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "hsaco"))
        .collect();
    objects.sort();
    assert!(!objects.is_empty(), "no code objects in {dir:?}");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for path in &objects {
        let kernels = hipkv::codeobj::parse(&std::fs::read(path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let expected = std::fs::read_to_string(path.with_extension("occupancy.txt")).unwrap();
        let mut count = 0;
        for line in expected.lines() {
            let (name, occupancy) = line.split_once(' ').unwrap();
            let k = kernels.iter().find(|k| k.name == name).unwrap();
            let want: u32 = occupancy.parse().unwrap();
            if k.occupancy_waves_per_simd != Some(want) {
                wrong.push(format!(
                    "{}: {name} (VGPRs {}, LDS {}, workgroup {}, wave{}, WGP mode {:?}): \
                     compiler {want}, formula {:?}",
                    path.display(),
                    k.vgpr_count,
                    k.group_segment_fixed_size,
                    k.max_flat_workgroup_size,
                    k.wavefront_size,
                    k.workgroup_processor_mode,
                    k.occupancy_waves_per_simd
                ));
            }
            count += 1;
        }
        assert_eq!(count, kernels.len(), "{}", path.display());
        checked += count;
    }
    println!(
        "{checked} kernels in {} code objects: {} mismatches",
        objects.len(),
        wrong.len()
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
