//! Build script: compiles the HIP kernels in `hip/` for every AMD arch in `HIPKV_ARCHS` and embeds
//! the code objects, and compiles the same sources for the host as the SIMT emulator (`hip/emu`).
//!
//! - The GPU compiler is found as `../shared/design.md` orders it: `HIPCC`, `ROCM_PATH` /
//!   `HIP_PATH` (`bin/hipcc`), `hipconfig --path`, `/opt/rocm/bin/hipcc`, `hipcc` on `PATH`, or a
//!   clang++ with HIP support named by `HIPKV_CLANG` (with `HIPKV_DEVLIB_DIR` for its device
//!   libraries; `scripts/install-hip-toolchain.sh` sets both up on Debian 12).
//! - No GPU compiler: the crate builds with the CPU backend and the emulator, and says so;
//!   `HIPKV_REQUIRE_HIP=1` makes that an error, as does a compiler that fails.
//! - `DOCS_RS`: no device code at all.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// Kernel sources, compiled for the GPU and for the emulator.
const KERNEL_SOURCES: &[&str] = &["hip/attention.hip", "hip/write.hip"];
/// The attention source compiled once more per head_dim with `HIPKV_PROBE`: the issue model's
/// probes (`attention.hip`'s `probe_block`), which `hipkv info --kernels` disassembles and no
/// one launches.
const PROBE_SOURCE: &str = "hip/attention.hip";
/// Headers every kernel includes.
const HEADERS: &[&str] = &[
    "hip/include/hipkv_abi.h",
    "hip/include/hipkv_device.h",
    "hip/include/formats.h",
    "hip/emu/emu.h",
];
/// Host sources of the emulator itself.
const EMU_SOURCES: &[&str] = &[
    "hip/emu/emu.cpp",
    "hip/emu/formats_ffi.cpp",
    "hip/emu/selftest.cpp",
];

const ENV_VARS: &[&str] = &[
    "DOCS_RS",
    "HIPKV_REQUIRE_HIP",
    "HIPKV_ARCHS",
    "GPU_TARGETS",
    "AMDGPU_TARGETS",
    "HIPCC",
    "ROCM_PATH",
    "HIP_PATH",
    "HIPKV_CLANG",
    "HIPKV_DEVLIB_DIR",
    "PATH",
];

fn main() -> ExitCode {
    println!("cargo:rerun-if-changed=build.rs");
    for path in KERNEL_SOURCES.iter().chain(HEADERS).chain(EMU_SOURCES) {
        println!("cargo:rerun-if-changed={path}");
    }
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    watch_toolchain();
    println!("cargo::rustc-check-cfg=cfg(hipkv_emu)");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    if env::var_os("DOCS_RS").is_some() {
        write_code_objects(&out, &[], Some("docs.rs build: no device code"));
        return ExitCode::SUCCESS;
    }

    build_emulator(&out);

    let require = env::var("HIPKV_REQUIRE_HIP").as_deref() == Ok("1");
    let archs = archs();
    let built = match find_compiler() {
        Err(why) => Err(why),
        Ok(compiler) => archs
            .iter()
            .map(|arch| compile_for(&compiler, arch, &out).map(|path| (arch.clone(), path)))
            .collect::<Result<Vec<_>, _>>(),
    };
    match built {
        Ok(objects) => {
            write_code_objects(&out, &objects, None);
            ExitCode::SUCCESS
        }
        Err(why) if require => {
            eprintln!("error: HIPKV_REQUIRE_HIP=1 but the GPU kernels were not built: {why}");
            ExitCode::FAILURE
        }
        Err(why) => {
            println!(
                "cargo:warning=hipkv: GPU kernels not built ({why}); CPU and emulator backends only"
            );
            write_code_objects(&out, &[], Some(&why));
            ExitCode::SUCCESS
        }
    }
}

/// Reruns the build when a named compiler or device library, or the default ROCm, appears,
/// changes or goes: a toolchain installed after the first build would otherwise leave the cached
/// "GPU kernels not built" in place with nothing to rebuild it. A path that does not exist is
/// watched through its nearest existing ancestor (Cargo reruns on every build for a missing
/// path), whose modification time changes when an entry is added to it.
fn watch_toolchain() {
    let named = ["HIPKV_CLANG", "HIPCC", "HIPKV_DEVLIB_DIR"]
        .iter()
        .filter_map(|v| env::var_os(v).map(PathBuf::from));
    for path in named.chain([PathBuf::from("/opt/rocm/bin/hipcc")]) {
        if let Some(existing) = path.ancestors().find(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", existing.display());
        }
    }
}

/// The archs to build: `HIPKV_ARCHS`, else `GPU_TARGETS`, else `AMDGPU_TARGETS`, else gfx1201;
/// separated by commas or semicolons.
fn archs() -> Vec<String> {
    let list = ["HIPKV_ARCHS", "GPU_TARGETS", "AMDGPU_TARGETS"]
        .iter()
        .find_map(|v| env::var(v).ok().filter(|s| !s.trim().is_empty()))
        .unwrap_or_else(|| "gfx1201".into());
    list.split([',', ';'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// A HIP-capable compiler: `hipcc`, or a plain clang++ driven with `-x hip`.
struct Compiler {
    program: PathBuf,
    /// Extra arguments (device library path for a plain clang).
    args: Vec<String>,
}

fn find_compiler() -> Result<Compiler, String> {
    let mut tried = Vec::new();
    let hipcc = |p: PathBuf| Compiler {
        program: p,
        args: Vec::new(),
    };
    if let Some(p) = env::var_os("HIPCC") {
        return Ok(hipcc(p.into()));
    }
    if let Ok(clang) = env::var("HIPKV_CLANG") {
        let mut args = Vec::new();
        if let Ok(dir) = env::var("HIPKV_DEVLIB_DIR") {
            args.push(format!("--rocm-device-lib-path={dir}"));
        }
        return Ok(Compiler {
            program: clang.into(),
            args,
        });
    }
    for var in ["ROCM_PATH", "HIP_PATH"] {
        if let Some(root) = env::var_os(var) {
            let p = Path::new(&root).join("bin/hipcc");
            if p.is_file() {
                return Ok(hipcc(p));
            }
            tried.push(format!("{var}: {} missing", p.display()));
        }
    }
    if let Ok(o) = Command::new("hipconfig").arg("--path").output()
        && o.status.success()
    {
        let p = Path::new(String::from_utf8_lossy(&o.stdout).trim()).join("bin/hipcc");
        if p.is_file() {
            return Ok(hipcc(p));
        }
        tried.push(format!("hipconfig: {} missing", p.display()));
    }
    let rocm = Path::new("/opt/rocm/bin/hipcc");
    if rocm.is_file() {
        return Ok(hipcc(rocm.into()));
    }
    tried.push("/opt/rocm/bin/hipcc missing".into());
    if Command::new("hipcc").arg("--version").output().is_ok() {
        return Ok(hipcc("hipcc".into()));
    }
    tried.push("no hipcc on PATH".into());
    tried.push("HIPKV_CLANG unset (scripts/install-hip-toolchain.sh prints it)".into());
    Err(format!("no HIP compiler found: {}", tried.join("; ")))
}

/// Head dims the attention kernels are instantiated for; each is its own code object, compiled
/// concurrently with the others (one kernel source takes minutes at -O3 otherwise).
const HEAD_DIMS: [u32; 3] = [64, 128, 256];

/// The code objects built for one arch: the kernels, and the issue model's probes.
struct ArchObjects {
    kernels: Vec<PathBuf>,
    probes: Vec<PathBuf>,
}

/// Compiles every kernel source device-only for `arch`, one code object per source and head_dim,
/// and the probes, one per head_dim.
fn compile_for(compiler: &Compiler, arch: &str, out: &Path) -> Result<ArchObjects, String> {
    let jobs: Vec<(&str, u32, bool)> = KERNEL_SOURCES
        .iter()
        .map(|src| (*src, false))
        .chain([(PROBE_SOURCE, true)])
        .flat_map(|(src, probe)| HEAD_DIMS.iter().map(move |&d| (src, d, probe)))
        .collect();
    let built: Vec<PathBuf> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(src, d, probe)| {
                scope.spawn(move || compile_one(compiler, arch, src, d, probe, out))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("compile thread"))
            .collect::<Result<_, _>>()
    })?;
    let mut objects = ArchObjects {
        kernels: Vec::new(),
        probes: Vec::new(),
    };
    for (&(.., probe), path) in jobs.iter().zip(built) {
        match probe {
            true => objects.probes.push(path),
            false => objects.kernels.push(path),
        }
    }
    Ok(objects)
}

fn compile_one(
    compiler: &Compiler,
    arch: &str,
    src: &str,
    head_dim: u32,
    probe: bool,
    out: &Path,
) -> Result<PathBuf, String> {
    let stem = Path::new(src).file_stem().unwrap().to_string_lossy();
    let kind = if probe { "_probe" } else { "" };
    let obj = out.join(format!("{stem}{kind}.d{head_dim}.{arch}.hsaco"));
    let output = Command::new(&compiler.program)
        .args(["-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output"])
        .arg(format!("--offload-arch={arch}"))
        .arg(format!("-DHIPKV_HEAD_DIM={head_dim}"))
        .args(probe.then_some("-DHIPKV_PROBE"))
        .args(["-O3", "-std=c++17", "-Ihip/include", "-c", src, "-o"])
        .arg(&obj)
        .args(&compiler.args)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", compiler.program.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} failed for {src} (head_dim {head_dim}, {arch}):\n{}",
            compiler.program.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(obj)
}

/// Writes `code_objects.rs`: the embedded code objects and probes and, when there are none, why.
fn write_code_objects(out: &Path, objects: &[(String, ArchObjects)], skipped: Option<&str>) {
    let mut s = String::new();
    let kernels = objects
        .iter()
        .flat_map(|(arch, o)| o.kernels.iter().map(move |p| (arch, p)));
    let probes = objects
        .iter()
        .flat_map(|(arch, o)| o.probes.iter().map(move |p| (arch, p)));
    write_list(&mut s, "CODE_OBJECTS", kernels);
    write_list(&mut s, "PROBE_OBJECTS", probes);
    writeln!(s, "pub(crate) static SKIPPED: Option<&str> = {skipped:?};").unwrap();
    fs::write(out.join("code_objects.rs"), s).expect("write code_objects.rs");
}

/// One `&[CodeObject]` static of `code_objects.rs`, embedding each (arch, path).
fn write_list<'a>(
    s: &mut String,
    name: &str,
    objects: impl Iterator<Item = (&'a String, &'a PathBuf)>,
) {
    writeln!(s, "pub(crate) static {name}: &[CodeObject] = &[").unwrap();
    for (arch, path) in objects {
        let source = path.file_name().unwrap().to_string_lossy();
        writeln!(
            s,
            "    CodeObject {{ arch: {arch:?}, source: {source:?}, bytes: include_bytes!({:?}) }},",
            path.display()
        )
        .unwrap();
    }
    s.push_str("];\n");
}

/// The emulator: the kernel sources compiled for the host with `HIPKV_EMU`, plus its runtime.
/// As for the GPU, each kernel source is compiled once per head_dim (`HIPKV_HEAD_DIM`), the
/// units concurrently: one compiler run over every instance of `attention.hip` takes most of
/// a minute.
fn build_emulator(out: &Path) {
    let mut base = cc::Build::new();
    base.cpp(true)
        .std("c++17")
        .include("hip/include")
        .define("HIPKV_EMU", None)
        .opt_level(2)
        .warnings(true)
        .extra_warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-fno-exceptions")
        .cargo_metadata(false);
    let mut units: Vec<(String, Vec<PathBuf>)> = vec![(
        "emu".into(),
        EMU_SOURCES.iter().map(PathBuf::from).collect(),
    )];
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    for src in KERNEL_SOURCES {
        let stem = Path::new(src).file_stem().unwrap().to_string_lossy();
        for d in HEAD_DIMS {
            // A file of the unit's own name: archives keep one member per object name, and the
            // static library would otherwise hold one head_dim of each source.
            let name = format!("{stem}_d{d}");
            let wrapper = out.join(format!("{name}.cpp"));
            let text = format!(
                "#define HIPKV_HEAD_DIM {d}\n#define HIPKV_EMU_UNIT {name}\n#include \"{}\"\n",
                root.join(src).display()
            );
            fs::write(&wrapper, text).expect("write an emulator unit");
            units.push((name, vec![wrapper]));
        }
    }
    // Every kernel unit's anchor (emu.h), for the Rust side to refer to.
    let anchors: Vec<String> = units[1..]
        .iter()
        .map(|(name, ..)| format!("hipkv_emu_unit_{name}"))
        .collect();
    let mut rs = String::from("unsafe extern \"C\" {\n");
    for a in &anchors {
        writeln!(rs, "    fn {a}();").unwrap();
    }
    rs.push_str("}\n/// Every emulated kernel unit's anchor.\npub(crate) static EMU_UNITS: &[unsafe extern \"C\" fn()] = &[\n");
    for a in &anchors {
        writeln!(rs, "    {a},").unwrap();
    }
    rs.push_str("];\n");
    fs::write(out.join("emu_units.rs"), rs).expect("write emu_units.rs");
    let objects: Vec<PathBuf> = std::thread::scope(|scope| {
        let handles: Vec<_> = units
            .iter()
            .map(|(name, sources)| {
                let mut build = base.clone();
                build.out_dir(out.join("emu").join(name)).files(sources);
                scope.spawn(move || build.compile_intermediates())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("emulator compile thread"))
            .collect()
    });
    // Kernels register themselves with the emulator from static initializers and nothing else
    // refers to them, so the whole archive is linked, not just the objects Rust calls into.
    base.objects(objects).compile("hipkv_emu");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static:+whole-archive=hipkv_emu");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo:rustc-cfg=hipkv_emu");
}
