//! The `hipkv` binary: `info` output, clean failures on bad flags, and `bench` on the emulated
//! device path (a tiny run whose figures are not checked: no timing here, only its shape).

use std::process::{Command, Output};
use std::sync::OnceLock;

fn hipkv(args: &[&str]) -> Output {
    hipkv_with(args, &[])
}

fn hipkv_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hipkv"))
        .args(args)
        .env_remove("HIPKV_BACKEND")
        .envs(env.iter().copied())
        .output()
        .expect("run hipkv")
}

/// `hipkv info --kernels`, run once for the tests that read it: it emulates 192 decode steps for
/// its cost model, which takes most of a minute on two cores.
fn info_kernels() -> &'static Output {
    static OUT: OnceLock<Output> = OnceLock::new();
    OUT.get_or_init(|| hipkv(&["info", "--kernels"]))
}

#[test]
fn info_lists_backends_and_every_preset() {
    let out = hipkv(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("cpu  available"));
    assert!(text.contains("hip  unavailable  "));
    assert!(text.contains("emu  available    "));
    for scheme in hipkv::scheme::PRESETS
        .iter()
        .chain(&["kivi2,outliers", "kivi2,pre_rope"])
        .chain(&hipkv::scheme::FRONTIER_PRESETS)
    {
        let row = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(scheme))
            .unwrap_or_else(|| panic!("no row for {scheme}"));
        let s: hipkv::Scheme = scheme.parse().unwrap();
        assert!(
            row.contains(&format!("{:.1}", s.bytes_per_token(128))),
            "{row}"
        );
    }
}

#[test]
fn bad_flags_fail_with_the_library_error_and_no_panic() {
    for (args, message) in [
        (&["info", "--head-dim", "100"][..], "head_dim 100"),
        (&["bench", "--schemes", "q8;q9"], "unknown item `q9`"),
        (&["bench", "--kv-heads", "0"], "kv_heads must be positive"),
        (&["bench", "--gqa", "0"], "q_heads must be positive"),
        (&["bench", "--contexts", "0"], "contexts must be positive"),
        (&["bench", "--schemes", ";"], "names no scheme"),
    ] {
        let out = hipkv(args);
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `bench --peer` says what it needs where it cannot run, before measuring anything: the
/// feature that builds llama.cpp, or a backend that is not the emulator.
#[test]
fn bench_peer_says_what_it_needs() {
    let out = hipkv_with(
        &["bench", "--peer", "llama.cpp", "--contexts", "64"],
        &[("HIPKV_BACKEND", "emu")],
    );
    let err = String::from_utf8(out.stderr).unwrap();
    let needs = if cfg!(feature = "peer-llamacpp") {
        "not on the emulator"
    } else {
        "built without the `peer-llamacpp` feature; scripts/peer-llamacpp.sh bench builds it"
    };
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(needs), "{err}");
    assert!(out.stdout.is_empty());
    let batch = hipkv(&["bench", "--peer", "llama.cpp", "--batch", "4"]);
    assert_eq!(batch.status.code(), Some(2));
}

#[test]
fn malformed_flags_are_usage_errors() {
    for args in [
        &["bench", "--min-time=-1"][..],
        &["bench", "--contexts", "1k"],
        &["frobnicate"],
    ] {
        let out = hipkv(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}

#[test]
fn info_kernels_lists_every_kernel_or_says_why_there_are_none() {
    let out = info_kernels();
    let text = std::str::from_utf8(&out.stdout).unwrap();
    let err = std::str::from_utf8(&out.stderr).unwrap();
    assert!(out.status.success(), "{text}{err}");
    if hipkv::kernels::code_objects().is_empty() {
        let why = hipkv::kernels::gpu_build_skipped().unwrap();
        assert!(
            text.contains(&format!("no GPU kernels in this build: {why}")),
            "{text}"
        );
        return;
    }
    let header = text
        .lines()
        .find(|l| l.starts_with("kernel "))
        .unwrap_or_else(|| panic!("no table header:\n{text}"));
    for column in [
        "arch",
        "VGPRs",
        "SGPRs",
        "VGPR spills",
        "SGPR spills",
        "scratch B",
        "LDS B",
        "wave",
        "waves/SIMD",
    ] {
        assert!(header.contains(column), "{header}");
    }
    let kernels = hipkv::codeobj::embedded_kernels().unwrap();
    assert!(!kernels.is_empty());
    for k in &kernels {
        let cells = text
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|c| c.first() == Some(&k.name.as_str()) && c.get(1) == Some(&k.arch.as_str()))
            .unwrap_or_else(|| panic!("no row for {} ({}):\n{text}", k.name, k.arch));
        assert_eq!(cells[2], k.vgpr_count.to_string(), "{cells:?}");
        assert_eq!(cells.len(), 10, "{cells:?}");
    }
}

/// `info --kernels` also counts each kernel's instructions by class in its disassembly; where no
/// llvm-objdump is found it says so, which CI (`HIPKV_REQUIRE_HIP=1`) does not accept.
#[test]
fn info_kernels_counts_each_kernels_instructions() {
    if hipkv::kernels::code_objects().is_empty() {
        return; // the test above checks what it says instead
    }
    let out = info_kernels();
    let text = std::str::from_utf8(&out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    if let Some(line) = text
        .lines()
        .find(|l| l.starts_with("no instruction census: "))
    {
        assert!(std::env::var_os("HIPKV_REQUIRE_HIP").is_none(), "{line}");
        eprintln!("SKIPPED the instruction census: {line}");
        return;
    }
    let census = text
        .split("instruction census: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no census:\n{text}"));
    let header = census.lines().find(|l| l.starts_with("kernel ")).unwrap();
    for column in [
        "instrs", "VALU", "FMA", "dot", "flat", "byte", "B/load", "ld+ds w",
    ] {
        assert!(header.contains(column), "{header}");
    }
    for k in hipkv::codeobj::embedded_kernels().unwrap() {
        let cells: Vec<&str> = census
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|c| c.first() == Some(&k.name.as_str()))
            .unwrap_or_else(|| panic!("no census row for {}:\n{census}", k.name));
        assert_eq!(cells.len(), 15, "{cells:?}");
        let n = |i: usize| cells[i].parse::<usize>().unwrap();
        let (instrs, valu, fma, dot, pk, salu, smem) = (n(1), n(2), n(3), n(4), n(5), n(6), n(7));
        let (loads, flat, byte, lds, waits, load_lds) = (n(8), n(9), n(10), n(12), n(13), n(14));
        assert!(
            valu + salu + smem + loads + lds + waits <= instrs,
            "{cells:?}"
        );
        assert!(
            fma + dot + pk <= valu && flat <= loads && byte <= loads,
            "{cells:?}"
        );
        assert!(load_lds <= waits, "{cells:?}");
        // Every kernel reads its inputs; the attention kernels (one per format pair and
        // head_dim) accumulate with f32 multiply-adds.
        assert!(loads > 0, "{cells:?}");
        if k.name.starts_with("hipkv_attn_") && k.name.rsplit('_').next().unwrap().starts_with('d')
        {
            assert!(fma > 0, "{cells:?}");
        }
    }
    issue_model_predicts_every_attention_kernel(text);
}

/// The issue model's table (after the census, in the same output): a row per attention kernel
/// with per-token counts that add up and predictions that agree with each other.
fn issue_model_predicts_every_attention_kernel(text: &str) {
    let issue = text
        .split("\nissue: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no issue model:\n{text}"));
    let header = issue.lines().find(|l| l.starts_with("kernel ")).unwrap();
    for column in [
        "instr/tok",
        "VALU/tok",
        "values VALU",
        "VMEM/tok",
        "KV B/tok",
        "GQA 4",
        "GQA 8",
        "GQA 8 1-issue",
        "iq VALU/tok",
        "iq GQA 8",
    ] {
        assert!(header.contains(column), "{header}");
    }
    let attention: Vec<String> = hipkv::codeobj::embedded_kernels()
        .unwrap()
        .into_iter()
        .map(|k| k.name)
        .filter(|n| n.starts_with("hipkv_attn_") && n.rsplit('_').next().unwrap().starts_with('d'))
        .collect();
    assert_eq!(attention.len(), 192);
    // A prediction cell: the bound and the fraction of peak it leaves.
    let verdict = |bound: &str, pct: &str| -> f64 {
        let pct: f64 = pct.strip_suffix('%').unwrap().parse().unwrap();
        match bound {
            // Memory-bound leaves 1 / fetch of peak, and tests/cost.rs bounds fetch by 1.1.
            "mem" => assert!((90.0..=100.0).contains(&pct), "{pct}"),
            "issue" => assert!(pct > 0.0 && pct < 100.5, "{pct}"),
            other => panic!("bound {other}"),
        }
        pct
    };
    for name in &attention {
        let cells: Vec<&str> = issue
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|c| c.first() == Some(&name.as_str()))
            .unwrap_or_else(|| panic!("no issue row for {name}:\n{issue}"));
        let x = |i: usize| cells[i].parse::<f64>().unwrap();
        // Integer-query scores (`iq`) exist for q8, q8_0, per-token and per-channel keys.
        let int_query = ["q8_", "q4_tok_", "q2_tok_", "q4_chan_", "q2_chan_"]
            .iter()
            .any(|k| name.starts_with(&format!("hipkv_attn_{k}")));
        assert_eq!(cells.len(), if int_query { 18 } else { 17 }, "{cells:?}");
        if int_query {
            assert!(x(15) > 0.0, "{cells:?}");
            verdict(cells[16], cells[17]);
        } else {
            assert_eq!(cells[15..], ["-", "-"], "{cells:?}");
        }
        let (instrs, valu, values, salu, vmem, lds, kv) =
            (x(1), x(2), x(3), x(4), x(5), x(6), x(7));
        assert!(valu + salu + vmem + lds <= instrs + 1e-9, "{cells:?}");
        // Each token's key and value bytes are loaded, its weight passes through LDS, and
        // its value is accumulated in the token loop.
        assert!(vmem > 0.0 && lds > 0.0 && kv > 0.0, "{cells:?}");
        assert!(values > 0.0 && values < valu, "{cells:?}");
        assert!((x(8) - valu / kv).abs() < 0.01, "{cells:?}");
        let (gqa4, gqa8, single) = (
            verdict(cells[9], cells[10]),
            verdict(cells[11], cells[12]),
            verdict(cells[13], cells[14]),
        );
        // Two waves read each block at GQA 8, and every instruction issuing costs more.
        assert!(gqa8 <= gqa4 && single <= gqa8, "{cells:?}");
    }
}

#[test]
fn info_lists_every_place_it_looked_for_the_hip_runtime() {
    let out = hipkv_with(
        &["info"],
        &[("HIPKV_HIP_LIBRARY", "/nonexistent/libamdhip64.so")],
    );
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(
            "runtime      no HIP runtime could be loaded; tried /nonexistent/libamdhip64.so \
             (no such file)"
        ),
        "{text}"
    );
}

#[test]
fn a_forced_backend_that_cannot_run_is_an_error() {
    for (value, message) in [
        ("hip", "the hip backend was asked for but cannot run here: "),
        ("gpu", "HIPKV_BACKEND=gpu: expected cpu, emu or hip"),
    ] {
        let out = hipkv_with(
            &["bench", "--contexts", "1024"],
            &[("HIPKV_BACKEND", value)],
        );
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(1), "{value}: {err}");
        assert!(err.contains(message), "{value}: {err}");
    }
}

/// `bench` on the emu backend runs the GPU bench's path (device-resident caches, kernel-timed
/// steps) and reports it as such, with no CPU memcpy baseline and no GPU peak.
#[test]
fn bench_runs_the_device_path_on_the_emulator() {
    let out = hipkv_with(
        &[
            "bench",
            "--json",
            "--schemes",
            "q8;kivi2,outliers",
            "--contexts",
            "96",
            "--kv-heads",
            "2",
            "--min-time",
            "0",
        ],
        &[("HIPKV_BACKEND", "emu")],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["backend"], "emu");
    assert_eq!(
        report["timing"],
        "wall clock of the emulated attention and combine kernels"
    );
    assert!(
        report["memcpy"].is_null() && report["gpu"].is_null(),
        "{report}"
    );
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, scheme) in rows.iter().zip(["q8", "kivi2,outliers"]) {
        assert_eq!(row["scheme"], scheme);
        assert_eq!(row["context"], 96);
        assert_eq!(row["sequences"], 2);
        assert!(row["us_per_step"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["pct_of_memcpy"].is_null() && row["pct_of_peak"].is_null());
        let s: hipkv::Scheme = scheme.parse().unwrap();
        let head = s.head_layout(128);
        // 96 tokens: 3 full pages of 32, two KV heads. kivi2 reads its 4 sink tokens f16, of
        // its key pages the other 92 rows (codes, outlier counts and slots) and each page's
        // per-channel parameters, and, all 96 positions being in its value window, the other
        // 92 tokens' values f16 instead of the pages' value streams.
        let k = &head.k;
        let key_row = k.row_bytes + 2 + 4 * k.outlier_slots;
        let bytes = if scheme == "q8" {
            2 * 3 * head.bytes
        } else {
            2 * (92 * key_row + 3 * k.format.params_bytes(32, 128) + 2 * 4 * 256 + 92 * 256)
        };
        assert_eq!(row["bytes_per_step"], bytes, "{row}");
    }
    // The issue model's prediction beside each row, where the build has the probes and
    // llvm-objdump is found (CI's build has both).
    let model: Vec<Option<f64>> = rows
        .iter()
        .map(|r| r["model_pct_of_peak"].as_f64())
        .collect();
    if model.iter().all(Option::is_none) {
        let why = "no issue-model prediction in the emulator's bench";
        assert!(std::env::var_os("HIPKV_REQUIRE_HIP").is_none(), "{why}");
        assert!(report["model_card"].is_null(), "{report}");
        eprintln!("SKIPPED: {why}");
        return;
    }
    let card = report["model_card"].as_str().unwrap();
    assert!(card.starts_with("RX 9070 XT"), "{card}");
    let (q8, kivi2) = (model[0].unwrap(), model[1].unwrap());
    assert!(q8 > 0.0 && q8 <= 100.0 && kivi2 > 0.0, "{model:?}");
    // Fewer KV bytes for the same work per element: kivi2 reaches no more of peak than q8.
    assert!(kivi2 <= q8, "{model:?}");
}

#[test]
fn eval_without_the_model_names_the_fetch_script() {
    let out = hipkv(&[
        "eval",
        "--model",
        "/nonexistent/model.gguf",
        "--tokens",
        "16",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("/nonexistent/model.gguf not found"), "{err}");
    assert!(err.contains("scripts/fetch-model.sh"), "{err}");
}

#[test]
fn eval_rejects_bad_schemes_and_text_before_loading() {
    let out = hipkv(&["eval", "--schemes", "f16,bogus"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("bogus"), "{err}");
    let out = hipkv(&["eval", "--text", "/nonexistent/text.txt"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("cannot read /nonexistent/text.txt"), "{err}");
}

/// `bench --batch`: a decode step for a batch of mixed lengths through the paged API, with the
/// kernels' and the host's time per call; a scheme that calibrates (outliers, codebooks) too.
#[test]
fn bench_batch_times_a_mixed_batch_through_the_paged_api() {
    let out = hipkv(&[
        "bench",
        "--batch",
        "3",
        "--contexts",
        "96",
        "--schemes",
        "q8;kivi2,sinks=4;kivi2,nuq,outliers=kv",
        "--min-time",
        "0",
        "--json",
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3, "{text}");
    for r in rows {
        assert_eq!(r["sequences"], 3, "{r}");
        assert_eq!(
            (r["min_len"].as_u64(), r["max_len"].as_u64()),
            (Some(12), Some(96)),
            "{r}"
        );
        for key in ["kernel_us", "host_us", "gb_per_s"] {
            assert!(r[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {r}");
        }
    }
    let bad = hipkv(&["bench", "--batch", "0"]);
    assert_eq!(bad.status.code(), Some(2));
}

/// The eval model (`scripts/fetch-model.sh`); `None`, said on stderr, where it is missing,
/// unless `HIPKV_REQUIRE_MODEL=1` makes that a failure.
fn eval_model() -> Option<std::path::PathBuf> {
    model_file(hipkv::eval::DEFAULT_MODEL)
}

/// A model file under the repository root, as [`eval_model`].
fn model_file(path: &str) -> Option<std::path::PathBuf> {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    if !model.exists() {
        assert_ne!(
            std::env::var("HIPKV_REQUIRE_MODEL").as_deref(),
            Ok("1"),
            "{} is missing",
            model.display()
        );
        eprintln!("skipped: {} is missing", model.display());
        return None;
    }
    Some(model)
}

/// Gemma-3 (`scripts/fetch-model.sh gemma3`) is evaluated past its 512-token sliding window,
/// its local layers attending within it.
#[test]
fn eval_runs_gemma3_past_its_sliding_window() {
    let Some(model) = model_file(hipkv::eval::GEMMA3_MODEL) else {
        return;
    };
    let model = model.to_str().unwrap();
    let out = hipkv(&[
        "eval",
        "--model",
        model,
        "--tokens",
        "600",
        "--schemes",
        "q8",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["tokens"], 600);
    assert_eq!(report["head_dim"], 256);
    let kl = report["schemes"][0]["mean_kl"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 0.02, "q8 mean KL {kl}");
}

/// `hipkv eval --save` then `hipkv info --model --eval`: per scheme, the KV bytes of the model,
/// the sequences that fit (the library's count) and the KL the saved run measured; a file of
/// another model's shape is refused. Needs the eval model (`scripts/fetch-model.sh`): skipped
/// without it unless `HIPKV_REQUIRE_MODEL=1`.
#[test]
fn info_prints_what_fits_with_the_measured_kl() {
    use hipkv::eval::{KvShape, fit, inspect};
    let Some(model) = eval_model() else { return };
    let model_arg = model.to_str().unwrap();
    let saved = std::env::temp_dir().join(format!("hipkv-fit-{}.json", std::process::id()));
    let out = hipkv(&[
        "eval",
        "--model",
        model_arg,
        "--tokens",
        "48",
        "--chunk",
        "16",
        "--schemes",
        "q8;kivi2;kv3",
        "--frontier",
        "--save",
        saved.to_str().unwrap(),
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    assert!(text.contains("frontier at head_dim 64"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let kl = |name: &str| {
        json["schemes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["scheme"] == name)
            .unwrap()["mean_kl"]
            .as_f64()
            .unwrap()
    };

    let out = hipkv(&[
        "info",
        "--model",
        model_arg,
        "--vram",
        "16GiB",
        "--context",
        "6144",
        "--schemes",
        "q8;kivi2;kv3;q4_tok",
        "--eval",
        saved.to_str().unwrap(),
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    let summary = inspect(&model).unwrap();
    let (shape, weights) = (summary.shape, summary.weight_bytes);
    assert_eq!(
        (summary.architecture.as_str(), shape),
        (
            "llama",
            KvShape {
                layers: 30,
                kv_heads: 3,
                head_dim: 64
            }
        )
    );
    assert_eq!(summary.sliding_window, None);
    let budget = (16u64 << 30) - weights - (1 << 30);
    for (name, measured) in [
        ("q8", true),
        ("kivi2", true),
        ("kv3", true),
        ("q4_tok", false),
    ] {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} line in\n{text}"));
        let cols: Vec<&str> = line.split_whitespace().collect();
        let f = fit(&name.parse().unwrap(), shape, 6144, budget).unwrap();
        assert_eq!(cols[1], format!("{:.1}", f.bytes_per_token), "{line}");
        assert_eq!(cols[2], f.tokens.to_string(), "{line}");
        assert_eq!(cols[3], f.sequences.to_string(), "{line}");
        let want = if measured {
            format!("{:.2e}", kl(name))
        } else {
            "-".into()
        };
        assert_eq!(cols[5], want, "{line}");
    }

    // The same file claiming another model's shape is refused.
    let mut other = json.clone();
    other["head_dim"] = 128.into();
    std::fs::write(&saved, other.to_string()).unwrap();
    let out = hipkv(&[
        "info",
        "--model",
        model_arg,
        "--eval",
        saved.to_str().unwrap(),
    ]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!out.status.success());
    assert!(err.contains("KV shape 30×3×128"), "{err}");
    std::fs::remove_file(&saved).unwrap();
}

/// `hipkv info | head -1`: the reader goes away after a line; the tool ends without a panic
/// message (by SIGPIPE, as Unix tools do).
#[cfg(unix)]
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_hipkv"))
        .arg("info")
        .env_remove("HIPKV_BACKEND")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run hipkv");
    // Close the reading end before the tool writes.
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stderr.contains("Broken pipe"), "{stderr}");
    assert!(
        !status.success() || stderr.is_empty(),
        "{status:?}: {stderr}"
    );
}

/// `hipkv calibrate` writes a calibration file that `hipkv eval --calibration` uses for its
/// scheme; a damaged file is refused with its line. Needs the eval model, as above.
#[test]
fn calibrate_writes_a_file_that_eval_uses() {
    let Some(model) = eval_model() else { return };
    let model_arg = model.to_str().unwrap();
    let file = std::env::temp_dir().join(format!("hipkv-cal-{}.txt", std::process::id()));
    let file_arg = file.to_str().unwrap();
    let scheme = "kivi2,outliers,nuq=v";
    let out = hipkv(&[
        "calibrate",
        "--model",
        model_arg,
        "--tokens",
        "32",
        "--scheme",
        scheme,
        "--out",
        file_arg,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&file).unwrap();
    let calibration = hipkv::Calibration::parse(&text).unwrap();
    assert_eq!(calibration.scheme.to_string(), scheme);
    assert_eq!(calibration.layers.len(), 30);
    let eval = |schemes: &str| {
        hipkv(&[
            "eval",
            "--model",
            model_arg,
            "--tokens",
            "48",
            "--chunk",
            "16",
            "--schemes",
            schemes,
            "--calibration",
            file_arg,
            "--json",
        ])
    };
    // The file's scheme uses it; another scheme calibrates on its first chunk as before.
    let out = eval(&format!("{scheme};kivi2,nuq"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&file, text.replace("v_levels", "x_levels")).unwrap();
    let out = eval(scheme);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("line 4: an unknown item"), "{err}");
    std::fs::remove_file(&file).unwrap();
}

/// `hipkv eval --iq` runs each scheme whose keys integer-query scores apply to both ways, exact
/// then `iq`, and prints the KL that adds; the others (per-channel keys) get no twin. Needs the
/// eval model, as [`eval_model`].
#[test]
fn eval_iq_runs_each_applicable_scheme_beside_its_twin() {
    let Some(model) = eval_model() else { return };
    let eval = |schemes: &str, json: bool| {
        let mut args = vec!["eval", "--model", model.to_str().unwrap(), "--iq"];
        args.extend(["--tokens", "48", "--chunk", "16", "--schemes", schemes]);
        if json {
            args.push("--json");
        }
        let out = hipkv(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let report: serde_json::Value = serde_json::from_slice(&eval("q4_tok;kivi2", true)).unwrap();
    let names: Vec<&str> = report["schemes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["scheme"].as_str().unwrap())
        .collect();
    // `q4_tok` and `kivi2` score keys from the int8 query by default: their exact twins run
    // first.
    assert_eq!(names, ["q4_tok,iq=0", "q4_tok", "kivi2,iq=0", "kivi2"]);
    let kl = |i: usize| report["schemes"][i]["mean_kl"].as_f64().unwrap();
    for (exact, rounded) in [(0, 1), (2, 3)] {
        assert!(
            kl(rounded) > 0.0 && kl(rounded) != kl(exact),
            "iq twin KL {} vs {}",
            kl(rounded),
            kl(exact)
        );
    }
    let text = String::from_utf8(eval("q8", false)).unwrap();
    assert!(text.contains("integer-query key scores"), "{text}");
}

/// `hipkv eval --per-layer`: a table of every layer's KL alone, largest first, and the same
/// figures as JSON. Needs the eval model (`scripts/fetch-model.sh`).
#[test]
fn eval_per_layer_lists_every_layer_largest_first() {
    let Some(model) = eval_model() else { return };
    let model = model.to_str().unwrap();
    let args = |json: bool| {
        let mut a = vec![
            "eval",
            "--model",
            model,
            "--tokens",
            "32",
            "--chunk",
            "16",
            "--schemes",
            "q2_tok",
            "--per-layer",
        ];
        a.extend(json.then_some("--json"));
        hipkv(&a)
    };
    let out = args(false);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    assert!(text.contains("q2_tok: mean KL"), "{text}");
    let rows: Vec<(usize, f64)> = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("layer"))
        .skip(1)
        .map_while(|l| {
            let mut cols = l.split_whitespace();
            Some((cols.next()?.parse().ok()?, cols.next()?.parse().ok()?))
        })
        .collect();
    let mut layers: Vec<usize> = rows.iter().map(|r| r.0).collect();
    layers.sort_unstable();
    assert_eq!(layers, (0..30).collect::<Vec<_>>(), "{text}");
    assert!(rows.windows(2).all(|w| w[0].1 >= w[1].1), "{text}");

    let out = args(true);
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let layer_kl = json[0]["layer_kl"].as_array().unwrap();
    assert_eq!(layer_kl.len(), 30);
    let largest = layer_kl
        .iter()
        .map(|k| k.as_f64().unwrap())
        .fold(0.0, f64::max);
    // The table prints KLs to 4 significant digits.
    assert!(
        (largest - rows[0].1).abs() <= 1e-3 * largest,
        "{largest} vs {}",
        rows[0].1
    );
}
