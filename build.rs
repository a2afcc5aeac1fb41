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
//! - Every object is kept in a cache (`ObjectCache`) keyed by its compiler and preprocessed
//!   source; a build with other features copies an object whose key it finds there.

use std::env;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::SystemTime;

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
    "HIPKV_OBJECT_CACHE",
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

    let cache = ObjectCache::new(&out);
    build_emulator(&out, &cache);

    let require = env::var("HIPKV_REQUIRE_HIP").as_deref() == Ok("1");
    let archs = archs();
    let built = match find_compiler() {
        Err(why) => Err(why),
        Ok(compiler) => archs
            .iter()
            .map(|arch| compile_for(&compiler, arch, &out, &cache).map(|path| (arch.clone(), path)))
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
fn compile_for(
    compiler: &Compiler,
    arch: &str,
    out: &Path,
    cache: &ObjectCache,
) -> Result<ArchObjects, String> {
    let version = compiler_version(&compiler.program)?;
    let jobs: Vec<(&str, u32, bool)> = KERNEL_SOURCES
        .iter()
        .map(|src| (*src, false))
        .chain([(PROBE_SOURCE, true)])
        .flat_map(|(src, probe)| HEAD_DIMS.iter().map(move |&d| (src, d, probe)))
        .collect();
    let version = &version;
    let built: Vec<PathBuf> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(src, d, probe)| {
                scope.spawn(move || {
                    let job = GpuJob {
                        compiler,
                        arch,
                        src,
                        head_dim: d,
                        probe,
                    };
                    job.compile(version, out, cache)
                })
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

/// One device-only compile: a kernel source (or its probes) for one head_dim and arch.
struct GpuJob<'a> {
    compiler: &'a Compiler,
    arch: &'a str,
    src: &'a str,
    head_dim: u32,
    probe: bool,
}

impl GpuJob<'_> {
    /// The compiler's command line, less its output: `-c` compiles, `-E` preprocesses.
    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.compiler.program);
        cmd.args(["-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output"])
            .arg(format!("--offload-arch={}", self.arch))
            .arg(format!("-DHIPKV_HEAD_DIM={}", self.head_dim))
            .args(self.probe.then_some("-DHIPKV_PROBE"))
            .args(["-O3", "-std=c++17", "-Ihip/include", self.src])
            .args(&self.compiler.args);
        cmd
    }

    fn compile(&self, version: &str, out: &Path, cache: &ObjectCache) -> Result<PathBuf, String> {
        let stem = Path::new(self.src).file_stem().unwrap().to_string_lossy();
        let kind = if self.probe { "_probe" } else { "" };
        let obj = out.join(format!(
            "{stem}{kind}.d{}.{}.hsaco",
            self.head_dim, self.arch
        ));
        let what = format!("{} (head_dim {}, {})", self.src, self.head_dim, self.arch);
        let mut preprocess = self.command();
        preprocess.args(["-E", "-o", "-"]);
        let mut key = CacheKey::new(&preprocess, version);
        key.add(&run(&mut preprocess, &what)?);
        // The device libraries are linked into the code object.
        if let Ok(dir) = env::var("HIPKV_DEVLIB_DIR") {
            key.add_tree(Path::new(&dir));
        }
        cache.get_or_compile(key.finish(), &obj, || {
            let mut compile = self.command();
            compile.arg("-c").arg("-o").arg(&obj);
            run(&mut compile, &what).map(drop)
        })?;
        Ok(obj)
    }
}

/// Runs `cmd`, returning its standard output, or its standard error as the error.
fn run(cmd: &mut Command, what: &str) -> Result<Vec<u8>, String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let output = cmd
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{program} failed for {what}:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(output.stdout)
}

/// What `program --version` prints: with the preprocessed source and the command line, all a
/// compiler's output depends on.
fn compiler_version(program: &Path) -> Result<String, String> {
    let stdout = run(Command::new(program).arg("--version"), "--version")?;
    Ok(String::from_utf8_lossy(&stdout).into_owned())
}

/// Objects compiled by earlier runs of this script. A build with other features
/// (`--no-default-features`, `peer-llamacpp`) or another watched variable runs the script again
/// in a new `OUT_DIR`, and compiling every kernel again takes minutes; an object whose compiler,
/// command line and preprocessed source are unchanged is copied from here instead.
/// `HIPKV_OBJECT_CACHE` names the directory, `off` turns it off; by default it is
/// `hipkv-object-cache` in the profile's target directory, so `cargo clean` empties it.
struct ObjectCache {
    dir: Option<PathBuf>,
}

/// Entries kept per object name: old ones are from sources since edited.
const CACHE_ENTRIES_PER_OBJECT: usize = 4;

impl ObjectCache {
    fn new(out: &Path) -> Self {
        let dir = match env::var_os("HIPKV_OBJECT_CACHE") {
            Some(v) if v == "off" => None,
            Some(v) => Some(PathBuf::from(v)),
            // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out.
            None => out.ancestors().nth(3).map(|p| p.join("hipkv-object-cache")),
        };
        ObjectCache { dir }
    }

    /// Fills `obj` from the cache entry for `key`, or with `compile` and then stores it. The cache
    /// only saves time: an entry it cannot read or write is compiled, with a warning.
    fn get_or_compile(
        &self,
        key: u64,
        obj: &Path,
        compile: impl FnOnce() -> Result<(), String>,
    ) -> Result<(), String> {
        let name = obj.file_name().unwrap().to_string_lossy();
        let Some(dir) = &self.dir else {
            return compile();
        };
        let entry = dir.join(format!("{key:016x}-{name}"));
        if fs::copy(&entry, obj).is_ok() {
            // Recently used entries are the ones pruning keeps.
            let _ = fs::File::options()
                .append(true)
                .open(&entry)
                .and_then(|f| f.set_modified(SystemTime::now()));
            println!("hipkv: {name} from the object cache ({})", entry.display());
            return Ok(());
        }
        compile()?;
        if let Err(e) = store(dir, &entry, obj) {
            println!("cargo:warning=hipkv: object cache {}: {e}", dir.display());
        }
        prune(dir, &name);
        Ok(())
    }
}

/// Copies `obj` to `entry` through a temporary file, so a reader never sees half an entry.
fn store(dir: &Path, entry: &Path, obj: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let partial = entry.with_extension(format!("partial{}", std::process::id()));
    fs::copy(obj, &partial)?;
    fs::rename(&partial, entry)
}

/// Removes all but the newest `CACHE_ENTRIES_PER_OBJECT` entries for the object `name`.
fn prune(dir: &Path, name: &str) {
    let Ok(read) = fs::read_dir(dir) else { return };
    let suffix = format!("-{name}");
    let mut entries: Vec<(SystemTime, PathBuf)> = read
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(&suffix))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, path) in entries.into_iter().skip(CACHE_ENTRIES_PER_OBJECT) {
        let _ = fs::remove_file(path);
    }
}

/// The environment variables that can change an object without changing the compiler's command
/// line or its preprocessed output (include paths show in the latter).
const COMPILER_ENV: &[&str] = &["COMPILER_PATH", "GCC_EXEC_PREFIX", "SOURCE_DATE_EPOCH"];

/// An `ObjectCache` key: the compiler's version, its command line and what else goes into the
/// object (the preprocessed source, the device libraries).
struct CacheKey(DefaultHasher);

impl CacheKey {
    /// Not the whole environment: cc hands the compiler a copy of the build script's, which
    /// holds `OUT_DIR`, the features and the jobserver's descriptors, so no two builds would
    /// share a key.
    fn new(cmd: &Command, version: &str) -> Self {
        let mut h = DefaultHasher::new();
        cmd.get_program().hash(&mut h);
        cmd.get_args().for_each(|a| a.hash(&mut h));
        for name in COMPILER_ENV {
            let value = match cmd.get_envs().find(|(k, _)| k == name) {
                Some((_, set)) => set.map(OsStr::to_os_string),
                None => env::var_os(name),
            };
            (name, value).hash(&mut h);
        }
        version.hash(&mut h);
        CacheKey(h)
    }

    fn add(&mut self, bytes: &[u8]) {
        bytes.hash(&mut self.0);
    }

    /// Every file under `dir` by path and contents (a few MB). Not by modification time: the
    /// toolchain script links the device libraries anew and writes its gfx1201 one again each
    /// time it runs, with the same bytes.
    fn add_tree(&mut self, dir: &Path) {
        let mut files = Vec::new();
        let mut pending = vec![dir.to_path_buf()];
        while let Some(d) = pending.pop() {
            for entry in fs::read_dir(&d).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    pending.push(path);
                } else {
                    files.push(path);
                }
            }
        }
        files.sort();
        for path in files {
            path.hash(&mut self.0);
            fs::read(&path).ok().hash(&mut self.0);
        }
    }

    fn finish(&self) -> u64 {
        self.0.finish()
    }
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
fn build_emulator(out: &Path, cache: &ObjectCache) {
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
    // One unit per object, each named for itself: an archive keeps one member per object name,
    // and every head_dim of a kernel source would otherwise be an `attention.o`.
    let mut units: Vec<(String, cc::Build)> = EMU_SOURCES
        .iter()
        .map(|src| {
            let stem = Path::new(src).file_stem().unwrap().to_string_lossy();
            let mut build = base.clone();
            build.file(src);
            (stem.into_owned(), build)
        })
        .collect();
    let runtime_units = units.len();
    for src in KERNEL_SOURCES {
        let stem = Path::new(src).file_stem().unwrap().to_string_lossy();
        for d in HEAD_DIMS {
            let name = format!("{stem}_d{d}");
            let mut build = base.clone();
            // `.hip` is no C++ extension the host compiler knows.
            build
                .flag("-x")
                .flag("c++")
                .define("HIPKV_HEAD_DIM", d.to_string().as_str())
                .define("HIPKV_EMU_UNIT", name.as_str())
                .file(src);
            units.push((name, build));
        }
    }
    // Every kernel unit's anchor (emu.h), for the Rust side to refer to.
    let anchors: Vec<String> = units[runtime_units..]
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
    let emu_dir = out.join("emu");
    fs::create_dir_all(&emu_dir).expect("create the emulator's object directory");
    let objects: Vec<PathBuf> = std::thread::scope(|scope| {
        let handles: Vec<_> = units
            .iter_mut()
            .map(|(name, build)| {
                let obj = emu_dir.join(format!("{name}.o"));
                build.out_dir(emu_dir.join(&*name));
                scope.spawn(move || compile_emu_unit(build, obj, cache))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("emulator compile thread"))
            .collect::<Result<_, _>>()
    })
    .unwrap_or_else(|why| panic!("the emulator did not build: {why}"));
    // Kernels register themselves with the emulator from static initializers and nothing else
    // refers to them, so the whole archive is linked, not just the objects Rust calls into.
    base.objects(objects).compile("hipkv_emu");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static:+whole-archive=hipkv_emu");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo:rustc-cfg=hipkv_emu");
}

/// Compiles one emulator unit (one source) to `obj`, through the cache.
fn compile_emu_unit(
    build: &cc::Build,
    obj: PathBuf,
    cache: &ObjectCache,
) -> Result<PathBuf, String> {
    let tool = build.try_get_compiler().map_err(|e| e.to_string())?;
    let version = compiler_version(tool.path())?;
    let mut key = CacheKey::new(&tool.to_command(), &version);
    key.add(&build.try_expand().map_err(|e| e.to_string())?);
    cache.get_or_compile(key.finish(), &obj, || {
        let compiled = build
            .try_compile_intermediates()
            .map_err(|e| e.to_string())?;
        let [single] = compiled.as_slice() else {
            return Err(format!("one object expected, got {compiled:?}"));
        };
        fs::copy(single, &obj)
            .map(drop)
            .map_err(|e| format!("copy {}: {e}", single.display()))
    })?;
    Ok(obj)
}
