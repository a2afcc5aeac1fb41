//! `hipkv`: which backends this build can run and what each scheme stores (`info`), what each
//! GPU kernel of this build uses (`info --kernels`), how fast decode attention reads each
//! scheme's cache (`bench`), compared with memcpy on the CPU and with peak bandwidth on a GPU,
//! and what each scheme costs in accuracy on a real model (`eval`).

use std::hint::black_box;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod batch;
mod census;
mod issue;
#[cfg(feature = "peer-llamacpp")]
mod peer;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde::Serialize;

use hipkv::backend::HipStatus;
use hipkv::scheme::{FRONTIER_PRESETS, PRESETS, preset_names};
use hipkv::synth::{Rng, TokenPool};
use hipkv::{Backend, CacheConfig, Format, KvCache, Query, Rope, RopeLayout, Scheme, Stream};

/// On the CPU each bench row rotates over sequences holding more than this many bytes, four
/// times the 32 MiB L3 of the development machines, so steps read DRAM rather than cache.
const CPU_WORKING_SET: usize = 128 << 20;
/// On a GPU, four times the 64 MiB Infinity Cache of an RX 9070 XT.
const GPU_WORKING_SET: usize = 256 << 20;
const CPU_CONTEXTS: [usize; 4] = [1024, 4096, 16384, 32768];
const GPU_CONTEXTS: [usize; 6] = [1024, 4096, 16384, 32768, 65536, 131072];
/// The emulator runs the device path for correctness, thousands of times slower than a GPU.
const EMU_CONTEXTS: [usize; 1] = [256];
/// Tokens per `append` call while filling, as a prefill chunk would arrive.
const CHUNK: usize = 512;
/// Tokens `hipkv eval` runs by default.
const DEFAULT_EVAL_TOKENS: usize = 4096;
/// Synthetic tokens generated once and appended cyclically.
const POOL_TOKENS: usize = 4 * CHUNK;
const MIN_STEPS: usize = 5;
/// Blocks each stepper is timed in, in turn with the others it is compared with: a context's
/// schemes with each other, or a row with its peer's step.
const TIMING_BLOCKS: usize = 5;
const MEMCPY_BYTES: usize = 256 << 20;
const MEMCPY_RUNS: usize = 5;
/// Small enough that every thread gets many chunks, large enough to amortise rayon's overhead.
const MEMCPY_CHUNK: usize = 1 << 20;

#[derive(Parser)]
#[command(
    name = "hipkv",
    version,
    about = "Quantized KV-cache attention for decode"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the backends this build can run and the memory each scheme takes.
    Info(InfoArgs),
    /// Time single-token decode attention per scheme and context on the best backend (or
    /// HIPKV_BACKEND's), against memcpy bandwidth on the CPU and peak bandwidth on a GPU.
    Bench(BenchArgs),
    /// Run a real model (GGUF, CPU) with its KV cache in each scheme: KL against the f16 cache,
    /// top-1 agreement, ΔNLL, bytes per token, KL by context depth.
    Eval(EvalArgs),
    /// Calibrate a scheme's outlier thresholds and codebooks on a model and a text, and write
    /// them to a calibration file (`KvCache::apply_calibration`, `hipkv eval --calibration`).
    Calibrate(CalibrateArgs),
}

#[derive(Args)]
struct CalibrateArgs {
    /// Llama-family or Gemma-3 GGUF model.
    #[arg(long, default_value = hipkv::eval::DEFAULT_MODEL)]
    model: PathBuf,
    /// Text file to calibrate on [default: the bundled corpus].
    #[arg(long)]
    text: Option<PathBuf>,
    /// Tokens of the text to calibrate on (from its start), run as one chunk.
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// The scheme (one; its `outliers` and `nuq` say what is calibrated).
    #[arg(long)]
    scheme: String,
    /// The calibration file to write.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct EvalArgs {
    /// Llama-family or Gemma-3 GGUF model (`scripts/fetch-model.sh` downloads the default,
    /// `scripts/fetch-model.sh gemma3` a Gemma-3 270M).
    #[arg(long, default_value = hipkv::eval::DEFAULT_MODEL)]
    model: PathBuf,
    /// Text file to evaluate on [default: the bundled corpus, data/corpus/python-tutorial.txt].
    #[arg(long)]
    text: Option<PathBuf>,
    /// Calibration files (`hipkv calibrate`) for the schemes they were made for, instead of
    /// calibrating each layer on the first chunk of the text (repeatable).
    #[arg(long)]
    calibration: Vec<PathBuf>,
    /// Tokens of the text to run (from its start) [default: 4096, or the model's context where
    /// that is shorter].
    #[arg(long)]
    tokens: Option<usize>,
    /// Schemes, separated by `,` where each starts with a preset or `k=` (`f16,q8,kivi2,pre_rope`
    /// is three), or by `;` [default: f16, q8, q8_0, q2_tok; q4_tok with and without outliers;
    /// kivi4 and kivi2 with and without pre_rope and outliers; kivi2 with codebooks (nuq)].
    #[arg(long)]
    schemes: Option<String>,
    /// Tokens per prefill chunk: appended to the cache, then attending to it.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON object to this file (what `hipkv info --eval` reads).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Then print, for each byte budget (136, 72, 56 and 40 bytes per token per KV head at
    /// head_dim 64, the same fractions of f16 at others), the scheme of least KL within it;
    /// without `--schemes`, over combinations of formats, groups, sinks, value windows and
    /// pre-RoPE keys chosen to fill those budgets.
    #[arg(long)]
    frontier: bool,
    /// Write the PNG plots (KL against bytes per token, KL against depth) into this folder.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Instead, run each scheme in one layer at a time (the others f16) and print how much KL
    /// each layer causes, beside the scheme's in every layer (needs --schemes; a run per layer).
    #[arg(long, requires = "schemes", conflicts_with_all = ["frontier", "iq", "plots", "save", "calibration"])]
    per_layer: bool,
    /// Run every scheme whose keys `iq` can score with integer-query dot products both ways,
    /// exact (`iq=0`) then `iq`, and print how much KL `iq` adds to the exact scheme's.
    #[arg(long)]
    iq: bool,
}

/// Rust ignores SIGPIPE, so `println!` into a closed pipe (`hipkv info | head`) panics; a command
/// line tool should end quietly there, as the default disposition does.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: first thing in `main`, before any other thread exists; SIG_DFL is a valid
    // disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// What `hipkv eval` measures when no schemes are given.
const EVAL_SCHEMES: &str = "f16;q8;q8_0;fp8;q4_tok;q4_tok,outliers;kivi4;kivi4,outliers;\
    kivi4,pre_rope;kivi4,pre_rope,outliers;q2_tok;kivi2;kivi2,outliers;kivi2,pre_rope;\
    kivi2,pre_rope,outliers;kivi2,nuq";

/// What `hipkv eval --frontier` searches when no schemes are given: per budget at head_dim 64
/// (full pages), the candidates that fill it: 8-bit (132–136 bytes), 4-bit keys and values at
/// 64-token pages and 64-channel value groups (72), one of them 2-bit (56), both 2-bit (40);
/// with and without the value window, pre-RoPE keys and Walsh–Hadamard rotation (per-channel
/// keys with rotated values, or both streams per token and rotated), and codebooks for the 2-bit
/// streams (on SmolLM2 they did not help 4-bit ones). The presets (80 and 48 bytes) anchor the
/// table.
const FRONTIER_SCHEMES: &str = "q8_0;q8;kivi4;kivi4,pre_rope;kivi2;kivi2,pre_rope;\
    k=q4_chan,v=q4_tok@64,g=64,sinks=4;\
    k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128;\
    k=q4_chan,v=q4_tok@64,g=64,sinks=4,pre_rope;\
    k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128,pre_rope;\
    k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v;\
    k=q4_tok@64,v=q4_tok@64,g=64,sinks=4,rot;\
    k=q4_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope;\
    k=q4_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v;\
    k=q4_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v,nuq=v;\
    k=q4_chan,v=q2_tok@64,g=64,sinks=4,pre_rope;\
    k=q4_tok@64,v=q2_tok@64,g=64,sinks=4,rot;\
    k=q2_chan,v=q4_tok@64,g=64,sinks=4,rv=128,pre_rope;\
    k=q2_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope;\
    k=q2_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v;\
    k=q2_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v,nuq;\
    k=q2_chan,v=q2_tok@64,g=64,sinks=4,pre_rope";

#[derive(Args)]
struct InfoArgs {
    /// Head dimension for the memory table.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// A GGUF model: print what fits of its KV cache in `--vram` at `--context`, per scheme.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Memory of the card, for `--model` (16GiB, 12GB, ...).
    #[arg(long, default_value = "16GiB", requires = "model")]
    vram: String,
    /// Memory kept back for everything but weights and KV cache (activations, workspace,
    /// the runtime), for `--model`.
    #[arg(long, default_value = "1GiB", requires = "model")]
    reserve: String,
    /// Tokens per sequence, for `--model`.
    #[arg(long, default_value_t = 4096, requires = "model")]
    context: usize,
    /// Schemes separated by `;`, for `--model` [default: every preset].
    #[arg(long, requires = "model")]
    schemes: Option<String>,
    /// The JSON of a `hipkv eval --save` of the same model, whose mean KL is printed per scheme.
    #[arg(long, requires = "model")]
    eval: Option<PathBuf>,
    /// Instead, list the resources of every GPU kernel in this build (registers, spills,
    /// scratch, LDS, occupancy), read from the embedded code objects.
    #[arg(long)]
    kernels: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// Schemes separated by `;` (a scheme may contain commas) [default: every preset but the
    /// frontier ones, kv4, kv3 and kv2]
    #[arg(long)]
    schemes: Option<String>,
    /// Context lengths in tokens [default: 1024,4096,16384,32768 on the CPU, up to 131072 on
    /// a GPU, 256 on the emulator]
    #[arg(long, value_delimiter = ',')]
    contexts: Option<Vec<usize>>,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Query heads per KV head.
    #[arg(long, default_value_t = 4)]
    gqa: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Seconds to time each scheme and context (and at least 5 steps).
    #[arg(long, default_value_t = 0.5, value_parser = seconds)]
    min_time: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Time one decode step for a batch of N sequences of mixed lengths (context/8 to each
    /// context) through the paged API, reporting the kernels' time and the host's per call.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: Option<u32>,
    /// Time the same decode step in another library in the same run, alternating with each
    /// row (needs the `peer-llamacpp` feature; `scripts/peer-llamacpp.sh bench` builds it).
    #[arg(long, conflicts_with = "batch")]
    peer: Option<PeerName>,
}

/// Libraries `hipkv bench --peer` compares with.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum PeerName {
    /// llama.cpp's `ggml_flash_attn_ext` over f16, q8_0 and q4_0 caches.
    #[value(name = "llama.cpp")]
    LlamaCpp,
}

fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a non-negative number of seconds")),
    }
}

#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Hipkv(#[from] hipkv::Error),
    #[error("{0}")]
    Usage(String),
    #[error("cannot write JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cannot read an embedded code object: {0}")]
    CodeObject(#[from] hipkv::codeobj::CodeObjectError),
    #[error("instruction census: {0}")]
    Census(#[from] census::CensusError),
    #[error("issue model: {0}")]
    Issue(#[from] issue::IssueError),
    #[error(transparent)]
    Eval(#[from] hipkv::eval::EvalError),
    #[error("{path}: not the JSON of `hipkv eval --save`: {source}")]
    EvalJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {source}")]
    Calibration { path: PathBuf, source: hipkv::Error },
    #[cfg(feature = "peer-llamacpp")]
    #[error("llama.cpp peer: {0}")]
    Peer(#[from] peer::PeerError),
    #[error("{path} measured a model with KV shape {found}, but the model's is {expected}")]
    EvalModel {
        path: PathBuf,
        found: String,
        expected: String,
    },
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info(args) => info(&args),
        Command::Bench(args) => bench(&args),
        Command::Eval(args) => eval(&args),
        Command::Calibrate(args) => calibrate(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn info(args: &InfoArgs) -> Result<(), CliError> {
    if args.kernels {
        return info_kernels();
    }
    if let Some(model) = &args.model {
        return info_fits(args, model);
    }
    let d = args.head_dim;
    let names: Vec<String> = PRESETS
        .iter()
        .map(|p| p.to_string())
        .chain(["kivi2,outliers".into(), "kivi2,pre_rope".into()])
        .chain(FRONTIER_PRESETS.iter().map(|p| p.to_string()))
        .collect();
    let schemes = names
        .iter()
        .map(|n| {
            let s: Scheme = n.parse()?;
            // RoPE is assumed configured: pre_rope's memory is what matters here.
            s.validate(d, true)?;
            Ok(s)
        })
        .collect::<Result<Vec<_>, CliError>>()?;

    let cpu = match hipkv::backend::cpu_kernels() {
        "portable" => "portable kernels (no AVX2/FMA/F16C, or HIPKV_CPU_SIMD=portable)".to_string(),
        k => format!("{k} kernels"),
    };
    println!("hipkv {}\n", env!("CARGO_PKG_VERSION"));
    println!("backends");
    println!(
        "  cpu  available    {cpu}, {} threads",
        rayon::current_num_threads()
    );
    let hip = HipStatus::probe();
    match (hip.obstacle(), hip.usable_device()) {
        (None, Some(dev)) => println!(
            "  hip  available    {} ({}), device-resident cache (Backend::Hip)",
            dev.name, dev.arch
        ),
        (why, _) => println!("  hip  unavailable  {}", why.unwrap_or_default()),
    }
    match &hip.runtime {
        Ok(found) => {
            println!(
                "       runtime      {} (HIP {}), {} GPU{}",
                found.library,
                found.version_string(),
                found.devices.len(),
                if found.devices.len() == 1 { "" } else { "s" }
            );
            for dev in &found.devices {
                println!(
                    "       gpu {}        {} ({}), {} CUs, {:.1} GiB, {:.0} GB/s peak",
                    dev.ordinal,
                    dev.name,
                    dev.arch,
                    dev.compute_units,
                    dev.memory_bytes as f64 / (1u64 << 30) as f64,
                    dev.peak_bandwidth_gbs()
                );
            }
        }
        Err(e) => println!("       runtime      {e}"),
    }
    if !hip.built_archs.is_empty() {
        println!(
            "       kernels      built for {}",
            hip.built_archs.join(", ")
        );
    }
    println!(
        "  emu  available    the HIP kernels compiled for this CPU, run by the SIMT emulator \
         over the device-resident cache in host memory (Backend::Emu; decode only, for tests)"
    );

    let f16_bytes = Scheme::uniform(Format::F16).bytes_per_token(d);
    let w = names.iter().map(String::len).max().unwrap_or(0).max(6);
    let fw = schemes
        .iter()
        .flat_map(|s| [s.k.to_string().len(), s.v.to_string().len()])
        .max()
        .unwrap_or(0)
        .max(8);
    println!("\nschemes at head_dim {d}: bytes per token per KV head, K and V together");
    println!(
        "{:<w$}  {:<fw$}  {:<fw$}  {:>6}  {:>6}  {:>11}  {:>9}  {:>7}  {:>7}",
        "scheme", "K", "V", "K bits", "V bits", "bytes/token", "bits/elem", "vs f16", "f16/seq"
    );
    for s in &schemes {
        let bytes = s.bytes_per_token(d);
        // What a sequence holds f16 beside its pages: sinks, residual page, value window.
        let m = s.memory(d, s.group_tokens);
        let f16_per_seq = m.sink_bytes + m.residual_bytes + m.window_bytes;
        println!(
            "{:<w$}  {:<fw$}  {:<fw$}  {:>6}  {:>6}  {:>11.1}  {:>9.2}  {:>6.2}×  {:>7}",
            s.to_string(),
            s.k.to_string(),
            s.v.to_string(),
            s.k.nominal_bits(),
            s.v.nominal_bits(),
            bytes,
            bytes * 8.0 / (2 * d) as f64,
            f16_bytes / bytes,
            f16_per_seq,
        );
    }
    let outlier_slots = schemes
        .iter()
        .find(|s| s.outliers.is_some())
        .map_or(0, |s| s.outlier_slots(Stream::K, d));
    println!(
        "\nbytes/token counts codes, scales, minimums and outlier stores of full pages (32 tokens; 64\n\
         with g=64 and in kv*).\n\
         outliers: ~1% of key elements kept exact in a sparse store ({outlier_slots} slots per token).\n\
         pre_rope: keys stored before RoPE and rotated inside attention (the cache needs RoPE).\n\
         rot (rot=k, rot=v): rows stored Walsh–Hadamard rotated; no bytes, one rotation of the\n\
         query and of the output per step.\n\
         nuq (nuq=k, nuq=v): 4- and 2-bit codes decode through per-layer codebooks calibrated on\n\
         the model (128 bytes per layer).\n\
         iq: q8, q8_0, q*_tok and q*_chan keys scored against the query rounded to int8 per 32\n\
         channels, in integer dot products (v_dot4 on gfx1201); no bytes. On in q4_tok, q2_tok,\n\
         kivi4 and kivi2 (iq=0: exact f32 scores).\n\
         f16/seq: bytes a sequence holds f16 per KV head beside its pages: its sinks (sinks=; 4\n\
         tokens in the sub-8-bit presets), the residual page of q*_chan keys (one page) and the\n\
         value window (rv=; kivi*, kv*: the last 128 tokens' values, in 128 rows + one page).\n\
         kv4, kv3, kv2: the least KL measured at 4.5, 3.5 and 2.5 bits per element on two models\n\
         (docs/accuracy.md): kivi's sinks and value window, 64-token pages and 64-channel value\n\
         groups, pre-RoPE keys, rotated values, and codebooks for 2-bit codes (calibrate first)."
    );
    Ok(())
}

/// `info --model`: per scheme, the KV bytes per token of the model, and the tokens and
/// sequences of `--context` that fit in `--vram` beside the weights and `--reserve`.
fn info_fits(args: &InfoArgs, path: &std::path::Path) -> Result<(), CliError> {
    use hipkv::eval::{KvShape, fit, inspect, parse_bytes};

    let model = inspect(path)?;
    let (shape, weights) = (model.shape, model.weight_bytes);
    let (vram, reserve) = (parse_bytes(&args.vram)?, parse_bytes(&args.reserve)?);
    let budget = vram.checked_sub(weights + reserve).ok_or_else(|| {
        CliError::Usage(format!(
            "--vram {} does not hold the weights ({}) and --reserve {}",
            args.vram,
            gib(weights),
            args.reserve
        ))
    })?;
    let schemes: Vec<Scheme> = match &args.schemes {
        Some(list) => list
            .split(';')
            .map(|s| s.trim().parse())
            .collect::<Result<_, _>>()?,
        None => preset_names().map(str::parse).collect::<Result<_, _>>()?,
    };
    let kl = match &args.eval {
        Some(file) => measured_kl(file, shape)?,
        None => Vec::new(),
    };
    let shape_text = |s: KvShape| {
        format!(
            "{} layers × {} KV heads × head_dim {}",
            s.layers, s.kv_heads, s.head_dim
        )
    };
    println!(
        "model {} ({}): {}, weights {} as stored",
        path.display(),
        model.architecture,
        shape_text(shape),
        gib(weights)
    );
    if let Some(window) = model.sliding_window {
        println!(
            "note: the model has sliding-window layers ({window} tokens); an engine that keeps only \
             the window for them needs less than this table, which counts every layer at the full \
             context (an upper bound)"
        );
    }
    println!(
        "budget: {} of memory − {} weights − {} reserve = {} for the KV cache; sequences of {} tokens",
        gib(vram),
        gib(weights),
        gib(reserve),
        gib(budget),
        args.context
    );
    let f16 = fit(&Scheme::uniform(Format::F16), shape, args.context, budget)?;
    let w = schemes
        .iter()
        .map(|s| s.to_string().len())
        .max()
        .unwrap_or(0)
        .max(6);
    println!(
        "
{:<w$}  {:>11}  {:>14}  {:>9}  {:>7}  {:>8}",
        "scheme", "bytes/token", "tokens", "sequences", "vs f16", "mean KL"
    );
    for s in &schemes {
        let f = fit(s, shape, args.context, budget)?;
        let measured = kl
            .iter()
            .find(|(m, _)| m == s)
            .map_or("-".to_string(), |(_, kl)| format!("{kl:.2e}"));
        println!(
            "{:<w$}  {:>11.1}  {:>14}  {:>9}  {:>6.2}×  {:>8}",
            s.to_string(),
            f.bytes_per_token,
            f.tokens,
            f.sequences,
            f16.bytes_per_token / f.bytes_per_token,
            measured
        );
    }
    println!(
        "\nbytes/token: the KV cache of one token of a {}-token sequence, every layer and KV \
         head, K and V,\nwith scales, minimums, outlier stores, sinks and the residual and value \
         windows (Scheme::memory;\na sequence's f16 windows are shared by its tokens). tokens: \
         what the budget holds in sequences\nof that length; sequences: whole ones. mean KL: {}.",
        args.context,
        match &args.eval {
            Some(f) => format!(
                "as measured by `hipkv eval` in {} (- : not measured)",
                f.display()
            ),
            None => "give `--eval FILE` (from `hipkv eval --save FILE`) to print it".into(),
        }
    );
    Ok(())
}

/// `n` bytes in GiB (MiB below one), for tables.
fn gib(n: u64) -> String {
    if n >= 1 << 30 {
        format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    }
}

/// The mean KL per scheme of a `hipkv eval --save` file, which must be of a model of `shape`.
fn measured_kl(
    path: &std::path::Path,
    shape: hipkv::eval::KvShape,
) -> Result<Vec<(Scheme, f64)>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|source| hipkv::eval::EvalError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| CliError::EvalJson {
            path: path.to_path_buf(),
            source,
        })?;
    let bad = |what: &str| CliError::EvalJson {
        path: path.to_path_buf(),
        source: serde::de::Error::custom(format!("no {what}")),
    };
    let number = |key: &str| {
        json[key]
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| bad(key))
    };
    let found = hipkv::eval::KvShape {
        layers: number("layers")?,
        kv_heads: number("kv_heads")?,
        head_dim: number("head_dim")?,
    };
    if found != shape {
        let text = |s: hipkv::eval::KvShape| format!("{}×{}×{}", s.layers, s.kv_heads, s.head_dim);
        return Err(CliError::EvalModel {
            path: path.to_path_buf(),
            found: text(found),
            expected: text(shape),
        });
    }
    let schemes = json["schemes"].as_array().ok_or_else(|| bad("schemes"))?;
    schemes
        .iter()
        .map(|s| {
            let name = s["scheme"].as_str().ok_or_else(|| bad("scheme name"))?;
            let kl = s["mean_kl"].as_f64().ok_or_else(|| bad("mean_kl"))?;
            Ok((name.parse()?, kl))
        })
        .collect()
}

/// `info --kernels`: the resource table of the embedded code objects, or why there are none.
fn info_kernels() -> Result<(), CliError> {
    println!("hipkv {}\n", env!("CARGO_PKG_VERSION"));
    let objects = hipkv::kernels::code_objects();
    if objects.is_empty() {
        let why = hipkv::kernels::gpu_build_skipped().unwrap_or("no code objects were embedded");
        println!("no GPU kernels in this build: {why}");
    } else {
        gpu_kernels(objects)?;
    }
    let reports = memory_model()?;
    if !objects.is_empty() {
        issue_model(&reports)?;
    }
    Ok(())
}

/// The memory half of the GPU cost model, from the emulator's load trace (any build).
fn memory_model() -> Result<Vec<hipkv::cost::MemoryReport>, CliError> {
    let shape = hipkv::cost::report_shape(0);
    println!(
        "\nmemory: the global loads of one decode step's attention kernel, traced in the SIMT \
         emulator ({} tokens, {} KV heads, GQA {})\n",
        shape.context, shape.kv_heads, shape.gqa
    );
    let reports = hipkv::cost::kernel_reports()?;
    print!("{}", hipkv::cost::memory_table(&reports));
    println!(
        "\nKV B/tok: the KV bytes the step must read per token and KV head (blocks and f16 \
         windows); requested: bytes the lanes load from them, per KV byte (a broadcast counts \
         each lane); lines/load: distinct 128-byte lines per wave-level load of KV data; line \
         traffic: those lines' bytes per KV byte (no reuse between loads); fetch: distinct KV \
         lines' bytes per KV byte (each line fetched once); span KiB: the most KV data one \
         wave loads between two lane exchanges (its working set); other/KV B: bytes the lanes load \
         from the queries, workspace and metadata per KV byte (element by element as the source \
         reads them). docs/performance.md states the model's assumptions."
    );
    println!(
        "\npre-RoPE steps: the presets that store keys before RoPE rotate each key inside the \
         loop, by its row in its block, and the query back by the block's first position once \
         per block, reading the RoPE table beside the KV bytes (same shape)\n"
    );
    print!("{}", hipkv::cost::rope_table(&hipkv::cost::rope_reports()?));
    println!(
        "\nKV fetch: as fetch above; table requested: bytes the lanes load from the table per \
         KV byte; table fetch: distinct table lines' bytes per KV byte (each row the step reads, \
         once; the table is shared by every KV head and sequence of a step, so a step of more \
         KV heads or sequences fetches less of it per KV byte); step fetch: the two together."
    );
    Ok(reports)
}

/// The issue half of the GPU cost model, from the disassembly of the probes (GPU builds).
fn issue_model(reports: &[hipkv::cost::MemoryReport]) -> Result<(), CliError> {
    let tool = match census::objdump() {
        Ok(tool) => tool,
        Err(why) => {
            println!("\nno issue model: {why}");
            return Ok(());
        }
    };
    let card = issue::RX_9070_XT;
    let Some(predictor) = issue::Predictor::new(&tool, issue::MODEL_ARCH, card)? else {
        println!(
            "\nno issue model: this build has no {} probes (HIPKV_ARCHS)",
            issue::MODEL_ARCH
        );
        return Ok(());
    };
    println!(
        "\nissue: what one wave executes per token in the steady state of a long decode \
         (32-token blocks), counted in the disassembly of each kernel's probe, and the bound it \
         predicts on the {card}\n"
    );
    print!("{}", issue::table(&predictor.rows(reports)?, &card));
    println!(
        "\ninstr/tok, VALU/tok, SALU/tok, VMEM/tok, LDS/tok: instructions one wave executes per \
         token, all and by class (a wave reads each token for {} query rows); values VALU: of \
         VALU/tok, those of the token loop that accumulates the values; KV B/tok: as in the \
         memory table; VALU/KV B: VALU/tok per KV byte; GQA 4, GQA 8: the bound, memory (mem) or VALU issue, and the fraction \
         of peak bandwidth it leaves, with one wave per {} query rows reading each block, each \
         SIMD issuing one VALU instruction per cycle and the other classes alongside; GQA 8 \
         1-issue: the same if every instruction took an issue cycle; iq VALU/tok, iq GQA 8: \
         VALU/tok and GQA 8 with keys scored from the int8 query (`iq`), for the key formats \
         that have it. docs/performance.md states the model's assumptions.",
        hipkv::abi::hipkv_rows(0),
        hipkv::abi::hipkv_rows(0)
    );
    Ok(())
}

/// The embedded code objects' resources and instruction census.
fn gpu_kernels(objects: &[hipkv::kernels::CodeObject]) -> Result<(), CliError> {
    let kernels = hipkv::codeobj::embedded_kernels()?;
    let sources: Vec<&str> = objects.iter().map(|o| o.source).collect();
    println!(
        "{} GPU kernels in {} code object{} ({})\n",
        kernels.len(),
        objects.len(),
        if objects.len() == 1 { "" } else { "s" },
        sources.join(", ")
    );
    print!("{}", hipkv::codeobj::resource_table(&kernels));
    println!(
        "\nVGPRs per work-item, SGPRs per wave; scratch: bytes per work-item, spills included; \
         LDS: static bytes per workgroup.\n\
         waves/SIMD: the occupancy the VGPRs, LDS and workgroup size allow when the kernel runs \
         alone (LLVM's model; `?` for an arch it is not known for)."
    );
    let tool = match census::objdump() {
        Ok(tool) => tool,
        Err(why) => {
            println!(
                "
no instruction census: {why}"
            );
            return Ok(());
        }
    };
    // Once per arch, as in the resource table: every head_dim's object holds the same
    // `hipkv_attn_prep`, `hipkv_attn_combine` and `hipkv_copy_blocks`.
    let mut counted = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for object in objects {
        for (name, counts) in census::of_code_object(&tool, object)? {
            if seen.insert((object.arch, name.clone())) {
                counted.push((name, counts));
            }
        }
    }
    println!(
        "
instruction census: static counts in each kernel's disassembly ({} -d), a loop \
         counting once
",
        tool.display()
    );
    print!("{}", census::table(&counted));
    println!(
        "
VALU: vector ALU instructions, of which FMA (v_fma*), dot (v_dot*) and pk (v_pk_*); \
         SMEM: scalar loads; loads: vector memory loads (global, flat and buffer), of which flat \
         (generic addresses, which also wait on LDS) and byte (one byte per lane); B/load: bytes \
         per lane per load; LDS: ds_*; waits: s_wait_*, of which ld+ds w waits for memory and \
         LDS at once (s_wait_loadcnt_dscnt)."
    );
    Ok(())
}

/// Model shape of a bench run.
#[derive(Clone, Copy, Serialize)]
struct Shape {
    kv_heads: usize,
    gqa: usize,
    q_heads: usize,
    head_dim: usize,
}

impl Shape {
    fn config(&self, scheme: Scheme, sequences: usize, capacity: usize) -> CacheConfig {
        CacheConfig {
            layers: 1,
            sequences,
            kv_heads: self.kv_heads,
            q_heads: self.q_heads,
            head_dim: self.head_dim,
            capacity,
            scheme,
            // A Llama-like model: RoPE on, so `pre_rope` schemes run as they would in one.
            rope: Some(Rope {
                base: 10000.0,
                layout: RopeLayout::Interleaved,
            }),
        }
    }
}

#[derive(Serialize)]
struct Memcpy {
    bytes: usize,
    threads: usize,
    runs: usize,
    /// Bytes read per second by the best run; as many bytes are written.
    read_gb_per_s: f64,
}

/// The GPU a bench ran on.
#[derive(Serialize)]
struct Gpu {
    name: String,
    arch: String,
    compute_units: usize,
    /// From the memory clock and bus width.
    peak_gb_per_s: f64,
}

#[derive(Serialize)]
struct Row {
    scheme: String,
    context: usize,
    sequences: usize,
    us_per_step: f64,
    gb_per_s: f64,
    /// CPU backend: of the memcpy bandwidth measured in the same run.
    pct_of_memcpy: Option<f64>,
    /// HIP backend: of the GPU's peak bandwidth.
    pct_of_peak: Option<f64>,
    /// Device backends (HIP, emu), GPU builds: the issue model's prediction of `pct_of_peak`
    /// for the kernel of the scheme's formats, in its steady state (`info --kernels`).
    model_pct_of_peak: Option<f64>,
    bytes_per_step: usize,
    speedup_vs_q8: Option<f64>,
    speedup_vs_f16: Option<f64>,
    /// The same step in the `--peer` library, timed alternating with this row.
    peer: Option<PeerRow>,
}

/// A peer library's step beside a hipkv row.
#[derive(Serialize)]
struct PeerRow {
    /// The peer's cache type this row is compared with.
    cache_type: &'static str,
    sequences: usize,
    us_per_step: f64,
    bytes_per_step: usize,
    gb_per_s: f64,
    /// time(peer) / time(hipkv): how many times faster hipkv's step is.
    speedup: f64,
}

/// Something a bench row times: one decode step of a sequence.
trait Stepper {
    fn sequences(&self) -> usize;
    /// KV bytes one step reads.
    fn bytes_per_step(&self) -> usize;
    /// Runs the step of sequence `seq` and returns its time in seconds.
    fn step(&mut self, seq: usize) -> Result<f64, CliError>;
    /// After each of its timed blocks, so that a peer's idle threads leave the cores to hipkv.
    fn rest(&mut self) {}
}

/// A library timed beside hipkv's rows (`hipkv bench --peer`).
trait Peer {
    /// The library and how it runs, for the report.
    fn describe(&self) -> String;
    /// The peer's cache type for `scheme` and its steps over caches of `context` tokens.
    fn steps(
        &mut self,
        scheme: Scheme,
        context: usize,
    ) -> Result<(&'static str, &mut dyn Stepper), CliError>;
}

#[derive(Serialize)]
struct Report {
    shape: Shape,
    backend: &'static str,
    /// Why the GPU was not used (`HIPKV_BACKEND` unset).
    hip_unavailable: Option<String>,
    /// What a step's time is: the wall clock of `KvCache::attend` (CPU), or the device's time
    /// from before the attention kernel to after the combine kernel.
    timing: &'static str,
    cpu_kernels: &'static str,
    gpu: Option<Gpu>,
    min_time_s: f64,
    /// Each row rotates over sequences holding more than this.
    working_set_bytes: usize,
    /// CPU backend only.
    memcpy: Option<Memcpy>,
    /// The `--peer` library, how it was built and how it ran.
    peer: Option<String>,
    /// The card the rows' `model_pct_of_peak` is predicted for.
    model_card: Option<String>,
    rows: Vec<Row>,
}

/// What one bench run measures against, and for how long.
struct Baseline<'a> {
    backend: Backend,
    memcpy: Option<&'a Memcpy>,
    peak_gb_per_s: Option<f64>,
    working_set: usize,
    min_time: f64,
}

fn bench(args: &BenchArgs) -> Result<(), CliError> {
    let schemes = match &args.schemes {
        None => Scheme::presets(),
        Some(list) => list
            .split(';')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::parse)
            .collect::<hipkv::Result<Vec<Scheme>>>()?,
    };
    if schemes.is_empty() {
        return Err(CliError::Usage("--schemes names no scheme".into()));
    }
    let (backend, hip_unavailable) = Backend::from_env()?;
    let contexts = args.contexts.clone().unwrap_or_else(|| match backend {
        Backend::Cpu => CPU_CONTEXTS.to_vec(),
        Backend::Hip => GPU_CONTEXTS.to_vec(),
        Backend::Emu => EMU_CONTEXTS.to_vec(),
    });
    if contexts.contains(&0) {
        return Err(CliError::Usage("contexts must be positive".into()));
    }
    let shape = Shape {
        kv_heads: args.kv_heads,
        gqa: args.gqa,
        q_heads: args.kv_heads * args.gqa,
        head_dim: args.head_dim,
    };
    // A one-token cache per scheme checks shape and scheme before any long measurement.
    for &s in &schemes {
        KvCache::new(shape.config(s, 1, 1))?;
    }

    let device = match backend {
        // A one-token cache opens the GPU the bench will use.
        Backend::Hip => KvCache::with_backend(shape.config(schemes[0], 1, 1), backend)?
            .device()
            .cloned(),
        _ => None,
    };
    let gpu = device.as_ref().map(|d| Gpu {
        name: d.name.clone(),
        arch: d.arch.clone(),
        compute_units: d.compute_units,
        peak_gb_per_s: d.peak_bandwidth_gbs(),
    });

    let working_set = match backend {
        Backend::Cpu => CPU_WORKING_SET,
        Backend::Hip => GPU_WORKING_SET,
        // Two sequences: the rotation, not the figures, is what the emulator checks.
        Backend::Emu => 0,
    };
    let pool = TokenPool::new(
        &mut Rng::new(1),
        POOL_TOKENS,
        shape.kv_heads,
        shape.head_dim,
    );
    let query = Rng::new(2).normals(shape.q_heads * shape.head_dim);
    let mut peer = open_peer(args.peer, backend, shape, &pool, &query, working_set)?;

    let progress = ProgressBar::new((schemes.len() * contexts.len()) as u64).with_style(
        ProgressStyle::with_template("{spinner} [{elapsed}] {bar:30} {pos}/{len} {msg}")
            .expect("constant template"),
    );
    progress.enable_steady_tick(Duration::from_millis(200));
    let memcpy = (backend == Backend::Cpu).then(|| {
        progress.set_message("memcpy baseline");
        measure_memcpy()
    });
    let baseline = Baseline {
        backend,
        memcpy: memcpy.as_ref(),
        peak_gb_per_s: gpu.as_ref().map(|g| g.peak_gb_per_s),
        working_set,
        min_time: args.min_time,
    };

    if let Some(n) = args.batch {
        let mut rows = Vec::new();
        for &context in &contexts {
            for &scheme in &schemes {
                progress.set_message(format!("{scheme} @ {context}, batch of {n}"));
                rows.push(batch::batch_row(
                    backend,
                    shape,
                    scheme,
                    n as usize,
                    context,
                    args.min_time,
                    &pool,
                )?);
                progress.inc(1);
            }
        }
        progress.finish_and_clear();
        if args.json {
            println!("{}", serde_json::to_string_pretty(&rows)?);
        } else {
            batch::print_batch(&rows, backend, &shape);
        }
        return Ok(());
    }
    let mut rows = Vec::new();
    for &context in &contexts {
        let first = rows.len();
        match peer.as_deref_mut() {
            // A peer has one cache at a time: each row alternates with its own.
            Some(peer) => {
                for &scheme in &schemes {
                    rows.push(peer_row(
                        shape,
                        scheme,
                        context,
                        (&pool, &query),
                        &baseline,
                        &progress,
                        peer,
                    )?);
                    progress.inc(1);
                }
            }
            None => rows.extend(context_rows(
                shape,
                &schemes,
                context,
                (&pool, &query),
                &baseline,
                &progress,
            )?),
        }
        set_speedups(&mut rows[first..]);
    }
    progress.set_message("the issue model's predictions");
    let predictor = predictor(backend, device.as_ref())?;
    if let Some(predictor) = &predictor {
        let predicted = schemes
            .iter()
            .map(|s| predictor.fraction_of_peak(s, shape.head_dim, shape.gqa))
            .collect::<Result<Vec<_>, _>>()?;
        // The rows are each context's schemes in order.
        for (row, p) in rows.iter_mut().zip(predicted.iter().cycle()) {
            row.model_pct_of_peak = Some(100.0 * p);
        }
    }
    progress.finish_and_clear();

    let report = Report {
        shape,
        backend: backend.name(),
        hip_unavailable,
        timing: match backend {
            Backend::Cpu => "wall clock of KvCache::attend",
            Backend::Hip => "HIP events around the attention and combine kernels",
            Backend::Emu => "wall clock of the emulated attention and combine kernels",
        },
        cpu_kernels: hipkv::backend::cpu_kernels(),
        gpu,
        min_time_s: args.min_time,
        working_set_bytes: baseline.working_set,
        memcpy,
        peer: peer.map(|p| p.describe()),
        model_card: predictor.map(|p| p.card().to_string()),
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// The issue model for a device bench: the GPU's own figures on the HIP backend (2 SIMD32 per
/// compute unit, as on RDNA), an RX 9070 XT's on the emulator; none on the CPU backend or
/// where the model cannot run (no probes, no `llvm-objdump`).
fn predictor(
    backend: Backend,
    gpu: Option<&hipkv::hip::Device>,
) -> Result<Option<issue::Predictor>, CliError> {
    let Ok(tool) = census::objdump() else {
        return Ok(None);
    };
    let model = match (backend, gpu) {
        (Backend::Hip, Some(d)) => {
            let card = issue::Card {
                name: "the GPU",
                compute_units: d.compute_units,
                simds_per_cu: issue::RX_9070_XT.simds_per_cu,
                clock_ghz: d.clock_khz as f64 / 1e6,
                bandwidth_gbs: d.peak_bandwidth_gbs(),
            };
            issue::Predictor::new(&tool, &d.arch, card)
        }
        (Backend::Emu, _) => issue::Predictor::new(&tool, issue::MODEL_ARCH, issue::RX_9070_XT),
        _ => return Ok(None),
    };
    Ok(model?)
}

/// Copies a buffer far larger than the caches with every core; the best of a few runs is the
/// bandwidth attention is compared with.
fn measure_memcpy() -> Memcpy {
    let src = vec![1u8; MEMCPY_BYTES];
    let mut dst = vec![0u8; MEMCPY_BYTES];
    let mut best = f64::INFINITY;
    // Run 0 only faults in `dst`'s pages.
    for run in 0..=MEMCPY_RUNS {
        let start = Instant::now();
        dst.par_chunks_mut(MEMCPY_CHUNK)
            .zip(src.par_chunks(MEMCPY_CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
        let t = start.elapsed().as_secs_f64();
        black_box(&dst);
        if run > 0 {
            best = best.min(t);
        }
    }
    Memcpy {
        bytes: MEMCPY_BYTES,
        threads: rayon::current_num_threads(),
        runs: MEMCPY_RUNS,
        read_gb_per_s: MEMCPY_BYTES as f64 / best / 1e9,
    }
}

/// A context's rows, its schemes timed in turn ([`median_step_times`]): a ratio such as
/// `vs q8` then compares steps the same load on the machine slowed alike, where rows timed one
/// after the other moved by tens of percent between runs on a shared host.
fn context_rows(
    shape: Shape,
    schemes: &[Scheme],
    context: usize,
    inputs: (&TokenPool, &[f32]),
    baseline: &Baseline<'_>,
    progress: &ProgressBar,
) -> Result<Vec<Row>, CliError> {
    let mut steps = schemes
        .iter()
        .map(|&scheme| hipkv_steps(shape, scheme, context, inputs, baseline, progress))
        .collect::<Result<Vec<_>, _>>()?;
    progress.set_message(format!("{context} tokens: timing the schemes in turn"));
    let mut steppers: Vec<&mut dyn Stepper> =
        steps.iter_mut().map(|s| s as &mut dyn Stepper).collect();
    let medians = median_step_times(&mut steppers, baseline.min_time)?;
    progress.inc(schemes.len() as u64);
    Ok(schemes
        .iter()
        .zip(&steps)
        .zip(medians)
        .map(|((&scheme, steps), median)| row(scheme, context, steps, median, baseline, None))
        .collect())
}

/// One scheme's row, timed alternating with the same step in `peer`.
fn peer_row(
    shape: Shape,
    scheme: Scheme,
    context: usize,
    inputs: (&TokenPool, &[f32]),
    baseline: &Baseline<'_>,
    progress: &ProgressBar,
    peer: &mut (dyn Peer + '_),
) -> Result<Row, CliError> {
    let mut hipkv = hipkv_steps(shape, scheme, context, inputs, baseline, progress)?;
    progress.set_message(format!("{scheme} @ {context}: building the peer's caches"));
    let (cache_type, steps) = peer.steps(scheme, context)?;
    let peer_bytes = steps.bytes_per_step();
    let peer_sequences = steps.sequences();
    progress.set_message(format!("{scheme} @ {context}: timing, alternating"));
    let medians = median_step_times(&mut [&mut hipkv, steps], baseline.min_time)?;
    let peer = PeerRow {
        cache_type,
        sequences: peer_sequences,
        us_per_step: medians[1] * 1e6,
        bytes_per_step: peer_bytes,
        gb_per_s: peer_bytes as f64 / medians[1] / 1e9,
        speedup: medians[1] / medians[0],
    };
    Ok(row(
        scheme,
        context,
        &hipkv,
        medians[0],
        baseline,
        Some(peer),
    ))
}

/// The caches of one row, filled: enough sequences of `context` tokens to hold the baseline's
/// working set.
fn hipkv_steps<'a>(
    shape: Shape,
    scheme: Scheme,
    context: usize,
    (pool, query): (&TokenPool, &'a [f32]),
    baseline: &Baseline<'_>,
    progress: &ProgressBar,
) -> Result<HipkvSteps<'a>, CliError> {
    let seq_bytes = shape.kv_heads * scheme.memory(shape.head_dim, context).total();
    let sequences = sequences_for(baseline.working_set, seq_bytes);
    let mut cache =
        KvCache::with_backend(shape.config(scheme, sequences, context), baseline.backend)?;
    let (k, v) = pool.first(context);
    cache.calibrate(0, k, v, 0)?;
    for seq in 0..sequences {
        progress.set_message(format!(
            "{scheme} @ {context}: filling sequence {}/{sequences}",
            seq + 1
        ));
        pool.fill(&mut cache, 0, seq, context, CHUNK, seq * CHUNK)?;
    }
    // Every sequence holds `context` tokens, so every step reads the same bytes.
    let bytes = cache.bytes_read(0, 0)?;
    Ok(HipkvSteps {
        out: vec![0f32; query.len()],
        query,
        scale: 1.0 / (shape.head_dim as f32).sqrt(),
        sequences,
        bytes,
        cache,
    })
}

/// The row of `steps`, whose median step took `median` seconds.
fn row(
    scheme: Scheme,
    context: usize,
    steps: &HipkvSteps<'_>,
    median: f64,
    baseline: &Baseline<'_>,
    peer: Option<PeerRow>,
) -> Row {
    let gb_per_s = steps.bytes as f64 / median / 1e9;
    Row {
        scheme: scheme.to_string(),
        context,
        sequences: steps.sequences,
        us_per_step: median * 1e6,
        gb_per_s,
        pct_of_memcpy: baseline.memcpy.map(|m| 100.0 * gb_per_s / m.read_gb_per_s),
        pct_of_peak: baseline.peak_gb_per_s.map(|p| 100.0 * gb_per_s / p),
        model_pct_of_peak: None,
        bytes_per_step: steps.bytes,
        speedup_vs_q8: None,
        speedup_vs_f16: None,
        peer,
    }
}

/// Sequences of `seq_bytes` each that together hold more than `working_set` (at least two), so
/// that consecutive steps read different memory.
fn sequences_for(working_set: usize, seq_bytes: usize) -> usize {
    (working_set / seq_bytes.max(1) + 1).max(2)
}

/// hipkv's decode step over the sequences of a one-layer cache.
struct HipkvSteps<'a> {
    cache: KvCache,
    sequences: usize,
    bytes: usize,
    query: &'a [f32],
    out: Vec<f32>,
    scale: f32,
}

impl Stepper for HipkvSteps<'_> {
    fn sequences(&self) -> usize {
        self.sequences
    }

    fn bytes_per_step(&self) -> usize {
        self.bytes
    }

    /// The CPU's wall clock, or the device's own time of its kernels.
    fn step(&mut self, seq: usize) -> Result<f64, CliError> {
        let t = Instant::now();
        let mut queries = [Query {
            seq,
            q: black_box(self.query),
            out: &mut self.out,
        }];
        let device_time = self.cache.attend_many_timed(0, &mut queries, self.scale)?;
        let wall = t.elapsed().as_secs_f64();
        black_box(&self.out);
        Ok(device_time.unwrap_or(wall))
    }
}

/// The median step time of each stepper, in seconds. Each first runs one untimed rotation over
/// its sequences (the first touch of each page, the thread pools' or the GPU clocks' wake-up).
/// Then each is timed in turn for `min_time / blocks` seconds, `blocks` times, so that steppers
/// compared with each other see the same machine; every one takes at least `MIN_STEPS` steps,
/// rotating over its sequences so that consecutive steps read different memory.
fn median_step_times(
    steppers: &mut [&mut dyn Stepper],
    min_time: f64,
) -> Result<Vec<f64>, CliError> {
    let blocks = if steppers.len() > 1 { TIMING_BLOCKS } else { 1 };
    for stepper in steppers.iter_mut() {
        for seq in 0..stepper.sequences() {
            stepper.step(seq)?;
        }
        stepper.rest();
    }
    let mut times = vec![Vec::new(); steppers.len()];
    for _ in 0..blocks {
        for (stepper, times) in steppers.iter_mut().zip(&mut times) {
            let start = Instant::now();
            let first = times.len();
            while times.len() - first < MIN_STEPS.div_ceil(blocks)
                || start.elapsed().as_secs_f64() < min_time / blocks as f64
            {
                let seq = times.len() % stepper.sequences();
                times.push(stepper.step(seq)?);
            }
            stepper.rest();
        }
    }
    Ok(times
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

/// The `--peer` library, ready to build its caches; an error where this build has none.
fn open_peer<'a>(
    name: Option<PeerName>,
    backend: Backend,
    shape: Shape,
    pool: &'a TokenPool,
    query: &'a [f32],
    working_set: usize,
) -> Result<Option<Box<dyn Peer + 'a>>, CliError> {
    let Some(PeerName::LlamaCpp) = name else {
        return Ok(None);
    };
    #[cfg(not(feature = "peer-llamacpp"))]
    {
        let _ = (backend, shape, pool, query, working_set);
        Err(CliError::Usage(
            "this hipkv was built without the `peer-llamacpp` feature; scripts/peer-llamacpp.sh \
             bench builds it and runs the comparison"
                .into(),
        ))
    }
    #[cfg(feature = "peer-llamacpp")]
    {
        let llama = match backend {
            Backend::Cpu => peer::LlamaCpp::cpu(rayon::current_num_threads())?,
            Backend::Hip => peer::LlamaCpp::gpu()?,
            Backend::Emu => {
                return Err(CliError::Usage(
                    "--peer compares speed on the CPU or a GPU, not on the emulator".into(),
                ));
            }
        };
        let shape = peer::PeerShape {
            kv_heads: shape.kv_heads,
            q_heads: shape.q_heads,
            head_dim: shape.head_dim,
        };
        Ok(Some(Box::new(peer::LlamaCppBench::new(
            llama,
            shape,
            pool,
            query,
            working_set,
        ))))
    }
}

/// Fills the speed-ups of one context's rows against its `q8` and `f16` rows, when measured.
fn set_speedups(rows: &mut [Row]) {
    let time_of = |rows: &[Row], name: &str| {
        rows.iter()
            .find(|r| r.scheme == name)
            .map(|r| r.us_per_step)
    };
    let q8 = time_of(rows, "q8");
    let f16 = time_of(rows, "f16");
    for r in rows {
        r.speedup_vs_q8 = q8.map(|t| t / r.us_per_step);
        r.speedup_vs_f16 = f16.map(|t| t / r.us_per_step);
    }
}

fn print_table(report: &Report) {
    let s = &report.shape;
    match (&report.memcpy, &report.gpu) {
        (Some(m), _) => println!(
            "decode attention, CPU backend ({} kernels, {} threads), 1 query token per step",
            report.cpu_kernels, m.threads
        ),
        (None, Some(g)) => println!(
            "decode attention, HIP backend on {} ({}, {} CUs, {:.0} GB/s peak), 1 query token \
             per step, timed by {}",
            g.name, g.arch, g.compute_units, g.peak_gb_per_s, report.timing
        ),
        (None, None) => println!(
            "decode attention, {} backend (the device path on the SIMT emulator: a correctness \
             run, its times are not a GPU's), 1 query token per step",
            report.backend
        ),
    }
    if let Some(why) = &report.hip_unavailable {
        println!("not on a GPU: {why}");
    }
    let rotation = match report.working_set_bytes {
        0 => "2 sequences".to_string(),
        bytes => format!("sequences holding > {} MiB", bytes >> 20),
    };
    println!(
        "shape: {} KV heads × GQA {} ({} query heads) × head_dim {}; each row rotates over \
         {rotation}",
        s.kv_heads, s.gqa, s.q_heads, s.head_dim,
    );
    if let Some(m) = &report.memcpy {
        println!(
            "memcpy: {:.1} GB/s read (as many bytes written), {} MiB, {} threads, best of {}",
            m.read_gb_per_s,
            m.bytes >> 20,
            m.threads,
            m.runs
        );
    }
    if let Some(peer) = &report.peer {
        println!(
            "peer: {peer}; each row and its peer timed alternating, {TIMING_BLOCKS} blocks each \
             (× peer = the peer's time / hipkv's)"
        );
    }
    if let Some(card) = &report.model_card {
        println!(
            "model: the %peak the issue model predicts for the kernel of each row's formats on \
             {card}, in the steady state of a long context (`hipkv info --kernels`)"
        );
    }
    println!();
    let w = report
        .rows
        .iter()
        .map(|r| r.scheme.len())
        .max()
        .unwrap_or(0)
        .max(6);
    let share = if report.memcpy.is_some() {
        "%memcpy"
    } else {
        "%peak"
    };
    let peer_header = match &report.peer {
        Some(_) => format!(
            "  {:>6}  {:>9}  {:>9}  {:>7}",
            "peer", "MiB/step", "µs/step", "× peer"
        ),
        None => String::new(),
    };
    let model_header = match &report.model_card {
        Some(_) => format!("  {:>6}", "model"),
        None => String::new(),
    };
    println!(
        "{:>7}  {:<w$}  {:>5}  {:>9}  {:>9}  {:>6}  {:>8}{model_header}  {:>6}  {:>6}{peer_header}",
        "context", "scheme", "seqs", "MiB/step", "µs/step", "GB/s", share, "vs q8", "vs f16"
    );
    let speedup = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}×"));
    for (i, r) in report.rows.iter().enumerate() {
        if i > 0 && report.rows[i - 1].context != r.context {
            println!();
        }
        let pct = r
            .pct_of_memcpy
            .or(r.pct_of_peak)
            .map_or("-".to_string(), |p| format!("{p:.1}%"));
        let peer = r.peer.as_ref().map_or(String::new(), |p| {
            format!(
                "  {:>6}  {:>9.2}  {:>9.1}  {:>7}",
                p.cache_type,
                p.bytes_per_step as f64 / (1 << 20) as f64,
                p.us_per_step,
                format!("{:.2}×", p.speedup)
            )
        });
        let model = r
            .model_pct_of_peak
            .map_or(String::new(), |p| format!("  {:>6}", format!("{p:.0}%")));
        println!(
            "{:>7}  {:<w$}  {:>5}  {:>9.2}  {:>9.1}  {:>6.1}  {:>8}{model}  {:>6}  {:>6}{peer}",
            r.context,
            r.scheme,
            r.sequences,
            r.bytes_per_step as f64 / (1 << 20) as f64,
            r.us_per_step,
            r.gb_per_s,
            pct,
            speedup(r.speedup_vs_q8),
            speedup(r.speedup_vs_f16),
        );
    }
}

/// The model, the first `tokens` tokens of `text` (the bundled corpus by default; `None`: 4096,
/// or as many as every layer sees in full) and how many the whole text has.
fn model_and_tokens(
    model: &std::path::Path,
    text: Option<&PathBuf>,
    tokens: Option<usize>,
) -> Result<(hipkv::eval::Model, Vec<u32>, usize), CliError> {
    use hipkv::eval::{self, EvalError, Model};

    let text = match text {
        Some(path) => std::fs::read_to_string(path).map_err(|source| EvalError::Io {
            path: path.clone(),
            source,
        })?,
        None => eval::CORPUS.to_string(),
    };
    let (model, tokenizer) = Model::load(model)?;
    let tokens = tokens.unwrap_or_else(|| DEFAULT_EVAL_TOKENS.min(model.config().context));
    let mut all = tokenizer.encode(&text)?;
    if all.len() < tokens {
        return Err(EvalError::TextTooShort {
            have: all.len(),
            want: tokens,
        }
        .into());
    }
    let text_tokens = all.len();
    all.truncate(tokens);
    Ok((model, all, text_tokens))
}

/// A calibration file, parsed.
fn read_calibration(path: &PathBuf) -> Result<hipkv::Calibration, CliError> {
    let text = std::fs::read_to_string(path).map_err(|source| hipkv::eval::EvalError::Io {
        path: path.clone(),
        source,
    })?;
    hipkv::Calibration::parse(&text).map_err(|source| CliError::Calibration {
        path: path.clone(),
        source,
    })
}

fn calibrate(args: &CalibrateArgs) -> Result<(), CliError> {
    let scheme: hipkv::Scheme = args.scheme.parse()?;
    let (model, tokens, _) = model_and_tokens(&args.model, args.text.as_ref(), Some(args.tokens))?;
    let calibration = hipkv::eval::calibrate(&model, &tokens, scheme)?;
    std::fs::write(&args.out, calibration.to_text()).map_err(|source| {
        hipkv::eval::EvalError::Write {
            path: args.out.clone(),
            source,
        }
    })?;
    println!(
        "{scheme}: {} layers calibrated on {} tokens, written to {}",
        calibration.layers.len(),
        tokens.len(),
        args.out.display()
    );
    Ok(())
}

fn eval(args: &EvalArgs) -> Result<(), CliError> {
    use hipkv::eval::{self, EvalError};

    let default = if args.frontier {
        FRONTIER_SCHEMES
    } else {
        EVAL_SCHEMES
    };
    let mut schemes = eval::parse_schemes(args.schemes.as_deref().unwrap_or(default))?;
    if args.iq {
        schemes = with_int_query_twins(&schemes);
    }
    if args.tokens.is_some_and(|n| n < 2) {
        return Err(CliError::Usage("--tokens must be at least 2".into()));
    }
    let started = Instant::now();
    let (model, tokens, text_tokens) =
        model_and_tokens(&args.model, args.text.as_ref(), args.tokens)?;
    let tokens = &tokens[..];
    let cfg = *model.config();
    let load_time = started.elapsed();
    if !args.json {
        println!(
            "model {} ({:?}, {} layers, {} query / {} KV heads, head_dim {}, RoPE base {}{}), loaded in {:.1} s",
            args.model.display(),
            cfg.architecture,
            cfg.layers,
            cfg.q_heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.rope_base,
            cfg.sliding_window
                .map_or(String::new(), |w| format!(", sliding window {w}")),
            load_time.as_secs_f64()
        );
        println!(
            "text {}: {} tokens of {}, chunks of {}; baseline f16 cache + {} schemes",
            args.text
                .as_ref()
                .map_or("data/corpus/python-tutorial.txt (bundled)".into(), |p| p
                    .display()
                    .to_string()),
            tokens.len(),
            text_tokens,
            args.chunk,
            schemes.len()
        );
    }
    let runs = if args.per_layer {
        schemes.len() * (cfg.layers + 2)
    } else {
        schemes.len() + 1
    };
    let total = tokens.len() * runs;
    let progress = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tokens, {tokens_per_sec}, ETA {eta}",
        )
        .expect("static template")
        .with_key(
            "tokens_per_sec",
            |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{:.0} tokens/s", state.per_sec());
            },
        ),
    );
    let run_started = Instant::now();
    if args.per_layer {
        let mut done = 0;
        let mut reports = Vec::new();
        for &scheme in &schemes {
            reports.push(eval::layer_sensitivity(
                &model,
                tokens,
                scheme,
                args.chunk,
                &mut |d| progress.set_position((done + d) as u64),
            )?);
            done += tokens.len() * (cfg.layers + 2);
        }
        progress.finish_and_clear();
        if args.json {
            println!("{}", serde_json::to_string_pretty(&reports)?);
        } else {
            reports.iter().for_each(print_layer_sensitivity);
            println!(
                "\n{} tokens × {} runs in {:.1} s, {} threads",
                tokens.len(),
                runs,
                run_started.elapsed().as_secs_f64(),
                rayon::current_num_threads()
            );
        }
        return Ok(());
    }
    let calibrations = args
        .calibration
        .iter()
        .map(read_calibration)
        .collect::<Result<Vec<_>, _>>()?;
    let report = eval::evaluate(
        &model,
        tokens,
        &schemes,
        &calibrations,
        args.chunk,
        &mut |done| progress.set_position(done as u64),
    )?;
    progress.finish_and_clear();
    let run_time = run_started.elapsed().as_secs_f64();
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(path) = &args.save {
        std::fs::write(path, &json).map_err(|source| EvalError::Write {
            path: path.clone(),
            source,
        })?;
    }
    if args.json {
        println!("{json}");
    } else {
        print_eval(&report);
        if args.frontier {
            print_frontier(&report);
        }
        if args.iq {
            print_int_query(&report, &schemes);
        }
        println!(
            "\n{} tokens × {} runs in {:.1} s ({:.0} tokens/s), {} threads",
            tokens.len(),
            schemes.len() + 1,
            run_time,
            total as f64 / run_time,
            rayon::current_num_threads()
        );
    }
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir).map_err(|source| EvalError::Write {
            path: dir.clone(),
            source,
        })?;
        let name = args
            .model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned());
        let what = format!("{name}, {} tokens", tokens.len());
        let pareto = eval::plot_pareto(
            &report,
            &format!("KV cache: KL vs memory ({what})"),
            &dir.join("eval-pareto.png"),
        )?;
        let depth = eval::plot_depth(
            &report,
            &format!("KV cache: KL by context depth ({what})"),
            &dir.join("eval-depth.png"),
        )?;
        eprintln!("plots: {} {}", pareto.display(), depth.display());
    }
    Ok(())
}

/// Each scheme where integer-query scores apply as its pair, exact (`iq=0`) then `iq`; the
/// others as given.
fn with_int_query_twins(schemes: &[Scheme]) -> Vec<Scheme> {
    let mut out: Vec<Scheme> = Vec::with_capacity(2 * schemes.len());
    for s in schemes {
        let pair: &[bool] = if s.int_query_applies() {
            &[false, true]
        } else {
            &[s.int_query]
        };
        for &int_query in pair {
            let twin = Scheme { int_query, ..*s };
            if !out.contains(&twin) {
                out.push(twin);
            }
        }
    }
    out
}

/// What `iq` adds to each scheme's KL: the twin's mean KL against the scheme's over the same
/// blocks of text, and whether it stays under the 10% that makes it worth a default.
fn print_int_query(report: &hipkv::eval::Report, schemes: &[Scheme]) {
    println!(
        "\ninteger-query key scores (iq: the query rounded to int8 per 32 channels): the KL they add"
    );
    println!(
        "{:<24}  {:>9}  {:>9}  {:>19}  {:>8}  verdict",
        "scheme", "mean KL", "with iq", "added KL ± se", "added"
    );
    for (i, s) in schemes.iter().enumerate() {
        let twin = Scheme {
            int_query: true,
            ..*s
        };
        let Some(j) = schemes
            .iter()
            .position(|x| *x == twin)
            .filter(|_| !s.int_query)
        else {
            continue;
        };
        let (base, with) = (report.schemes[i].mean_kl, report.schemes[j].mean_kl);
        let added = report
            .kl_difference(j, i)
            .map_or("-".to_string(), |(d, se)| format!("{d:+.1e} ± {se:.1e}"));
        let relative = (with - base) / base;
        println!(
            "{:<24}  {:>9.2e}  {:>9.2e}  {:>19}  {:>7.1}%  {}",
            report.schemes[i].scheme,
            base,
            with,
            added,
            100.0 * relative,
            if relative < 0.1 {
                "under 10%"
            } else {
                "10% or more"
            }
        );
    }
}

/// Each layer's KL alone, largest first, with its share of their sum.
fn print_layer_sensitivity(r: &hipkv::eval::LayerSensitivity) {
    let sum: f64 = r.layer_kl.iter().sum();
    println!(
        "\n{}: mean KL {:.3e} in every layer; {:.3e} summed over the layers alone ({:+.0}%)",
        r.scheme,
        r.mean_kl,
        sum,
        100.0 * (sum / r.mean_kl - 1.0)
    );
    println!("{:>5}  {:>10}  {:>6}", "layer", "mean KL", "share");
    let mut order: Vec<usize> = (0..r.layer_kl.len()).collect();
    order.sort_by(|&a, &b| r.layer_kl[b].total_cmp(&r.layer_kl[a]));
    for l in order {
        println!(
            "{l:>5}  {:>10.3e}  {:>5.1}%",
            r.layer_kl[l],
            100.0 * r.layer_kl[l] / sum
        );
    }
}

/// The frontier: per byte budget, the measured scheme of least mean KL that fits in it.
fn print_frontier(report: &hipkv::eval::Report) {
    println!(
        "\nfrontier at head_dim {}: the least mean KL within each budget (bytes per token per KV \
         head, full pages)",
        report.head_dim
    );
    println!(
        "{:>7}  {:>6}  {:>9}  {:>9}  {:>7}  {:>19}  scheme",
        "budget", "bytes", "with seq", "mean KL", "top-1", "next: ΔKL ± se"
    );
    for point in report.frontier() {
        match point.best {
            Some(i) => {
                let s = &report.schemes[i];
                let margin = point
                    .runner_up
                    .and_then(|j| report.kl_difference(j, i))
                    .map_or("-".to_string(), |(d, se)| format!("{d:+.1e} ± {se:.1e}"));
                println!(
                    "{:>7}  {:>6.1}  {:>9.1}  {:>9.2e}  {:>6.2}%  {:>19}  {}",
                    point.budget,
                    report.page_bytes_per_token(i),
                    report.head_bytes_per_token(i),
                    s.mean_kl,
                    100.0 * s.top1,
                    margin,
                    s.scheme
                );
            }
            None => println!("{:>7}  no measured scheme fits", point.budget),
        }
    }
    println!(
        "bytes: full pages (Scheme::bytes_per_token); with seq: everything included at {} tokens \
         (sinks, residual and value windows shared by the sequence's tokens). next: how much more \
         KL the budget's second-best scheme has, ± its standard error (paired means of {}-token \
         blocks): a margin within about two standard errors is not a win.",
        report.tokens,
        hipkv::eval::KL_BLOCK_TOKENS
    );
}

fn print_eval(report: &hipkv::eval::Report) {
    let w = report
        .schemes
        .iter()
        .map(|s| s.scheme.len())
        .max()
        .unwrap_or(0)
        .max(6);
    let buckets: Vec<&hipkv::eval::DepthBucket> = report.schemes[0]
        .depth
        .iter()
        .filter(|b| b.tokens > 0)
        .collect();
    let name = |from: usize, to: usize| {
        let k = |n: usize| {
            if n >= 1024 {
                format!("{}k", n / 1024)
            } else {
                n.to_string()
            }
        };
        format!("KL {}-{}", k(from), k(to))
    };
    println!(
        "\nbaseline (f16 cache): NLL {:.4} nats, perplexity {:.3}, over {} scored tokens\n",
        report.baseline_nll, report.baseline_perplexity, report.scored
    );
    print!(
        "{:<w$}  {:>9}  {:>9}  {:>9}  {:>8}  {:>9}  {:>7}  {:>9}  {:>8}",
        "scheme", "bytes/tok", "bits/elem", "mean KL", "± se", "p99 KL", "top-1", "ΔNLL", "PPL"
    );
    for b in &buckets {
        print!("  {:>9}", name(b.from, b.to));
    }
    let outliers = report.schemes.iter().any(|s| s.outliers_dropped > 0);
    if outliers {
        print!("  {:>9}", "outl.drop");
    }
    println!();
    for s in &report.schemes {
        print!(
            "{:<w$}  {:>9.0}  {:>9.2}  {:>9.2e}  {:>8}  {:>9.2e}  {:>6.2}%  {:>+9.4}  {:>8.3}",
            s.scheme,
            s.bytes_per_token,
            s.bits_per_element,
            s.mean_kl,
            s.kl_stderr
                .map_or("-".to_string(), |se| format!("{se:.1e}")),
            s.p99_kl,
            100.0 * s.top1,
            s.delta_nll,
            s.perplexity
        );
        for b in s.depth.iter().filter(|b| b.tokens > 0) {
            print!("  {:>9.2e}", b.mean_kl.unwrap_or(0.0));
        }
        if outliers {
            print!("  {:>9}", s.outliers_dropped);
        }
        println!();
    }
    println!(
        "± se: standard error of the mean KL, from the means of {}-token blocks of the text.",
        hipkv::eval::KL_BLOCK_TOKENS
    );
}
