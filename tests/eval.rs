//! `hipkv eval` on the real models (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched by
//! `scripts/fetch-model.sh`; Gemma-3 270M, Q4_K_M GGUF, by `scripts/fetch-model.sh gemma3`): the
//! forward passes, the tokenizers, and the accuracy ordering of the schemes on a short text.
//! Without a model file its tests are skipped, unless `HIPKV_REQUIRE_MODEL=1` (set by
//! `.ci/run`), which makes that a failure. `HIPKV_MODEL` and `HIPKV_GEMMA3_MODEL` name other
//! copies of the files.

use std::path::PathBuf;
use std::sync::OnceLock;

use hipkv::eval::{
    self, Architecture, Attention, CacheAttention, DenseAttention, EvalError, Model, Tokenizer,
};

/// `$env`, or else `default` under the repository root.
fn model_path(env: &str, default: &str) -> PathBuf {
    std::env::var_os(env).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(default),
        PathBuf::from,
    )
}

/// A model, loaded once for every test of this file; `None` (skip) when it is missing and not
/// required.
fn load(
    slot: &'static OnceLock<Option<(Model, Tokenizer)>>,
    path: PathBuf,
) -> Option<&'static (Model, Tokenizer)> {
    slot.get_or_init(|| match Model::load(&path) {
        Ok(m) => Some(m),
        Err(e @ EvalError::ModelMissing { .. })
            if std::env::var("HIPKV_REQUIRE_MODEL").as_deref() != Ok("1") =>
        {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => {
            panic!(
                "cannot load {} (HIPKV_REQUIRE_MODEL=1 makes it required): {e}",
                path.display()
            )
        }
    })
    .as_ref()
}

/// SmolLM2 (`HIPKV_MODEL` names another copy).
fn model() -> Option<&'static (Model, Tokenizer)> {
    static MODEL: OnceLock<Option<(Model, Tokenizer)>> = OnceLock::new();
    load(&MODEL, model_path("HIPKV_MODEL", eval::DEFAULT_MODEL))
}

/// Gemma-3 270M (`scripts/fetch-model.sh gemma3`; `HIPKV_GEMMA3_MODEL` names another copy).
fn gemma3() -> Option<&'static (Model, Tokenizer)> {
    static MODEL: OnceLock<Option<(Model, Tokenizer)>> = OnceLock::new();
    load(&MODEL, model_path("HIPKV_GEMMA3_MODEL", eval::GEMMA3_MODEL))
}

/// Softmax probability and id of the most likely token after the last position.
fn top(logits: &[f32], vocab: usize) -> (u32, f64) {
    let last = &logits[logits.len() - vocab..];
    let max = last.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = last.iter().map(|&x| f64::from(x - max).exp()).sum();
    let arg = last.iter().position(|&x| x == max).unwrap();
    (arg as u32, 1.0 / sum)
}

#[test]
fn the_capital_of_france_is_paris() {
    let Some((model, tok)) = model() else { return };
    let cfg = *model.config();
    assert_eq!(
        (
            cfg.layers,
            cfg.q_heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.rope_base
        ),
        (30, 9, 3, 64, 100_000.0)
    );
    let ids = tok.encode("The capital of France is").unwrap();
    let paris = tok.encode(" Paris").unwrap();
    assert_eq!(paris.len(), 1, "\" Paris\" is one token: {paris:?}");

    let (id, p) = next_token_cache_and_dense(model, tok, &ids, 2);
    assert_eq!(id, paris[0], "top token {:?}", tok.decode(&[id]).unwrap());
    assert!(
        (0.72..0.82).contains(&p),
        "p(\" Paris\") = {p}, expected about 0.77"
    );
}

/// The most likely token after `ids` and its probability through an f16 cache, checked against
/// plain f32 attention (no hipkv cache) run in two chunks split at `split`.
fn next_token_cache_and_dense(
    model: &Model,
    tok: &Tokenizer,
    ids: &[u32],
    split: usize,
) -> (u32, f64) {
    let cfg = *model.config();
    let mut cache = CacheAttention::new(&cfg, "f16".parse().unwrap(), 64).unwrap();
    let (id, p) = top(&model.forward(ids, &mut cache).unwrap(), cfg.vocab);
    eprintln!("f16 cache: {:?} p = {p:.4}", tok.decode(&[id]).unwrap());
    let mut dense = DenseAttention::new(&cfg, 64);
    model.forward(&ids[..split], &mut dense).unwrap();
    let (id2, p2) = top(
        &model.forward(&ids[split..], &mut dense).unwrap(),
        cfg.vocab,
    );
    eprintln!("dense f32 attention: p = {p2:.4}");
    assert_eq!(id2, id);
    assert!((p - p2).abs() < 0.01, "f16 cache {p} vs dense {p2}");
    (id, p)
}

/// The largest logit difference between an f16 cache and dense f32 attention over the text's
/// first `n` tokens, prefilled in chunks of 40.
fn chunked_prefill_difference(model: &Model, tok: &Tokenizer, n: usize) -> f32 {
    let cfg = *model.config();
    let ids = &tok.encode(eval::CORPUS).unwrap()[..n];
    let mut cache = CacheAttention::new(&cfg, "f16".parse().unwrap(), n).unwrap();
    let mut dense = DenseAttention::new(&cfg, n);
    let run = |a: &mut dyn Attention| -> Vec<f32> {
        ids.chunks(40)
            .flat_map(|c| model.forward(c, a).unwrap())
            .collect()
    };
    let (x, y) = (run(&mut cache), run(&mut dense));
    let worst = x
        .iter()
        .zip(&y)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    eprintln!("largest logit difference over {n} tokens: {worst}");
    worst
}

#[test]
fn the_tokenizer_round_trips_the_corpus_and_it_is_long_enough() {
    let Some((_, tok)) = model() else { return };
    let ids = tok.encode(eval::CORPUS).unwrap();
    assert!(ids.len() >= 8192, "corpus has {} tokens", ids.len());
    assert_eq!(tok.decode(&ids).unwrap(), eval::CORPUS);
    // Digits are split one by one (SmolLM2's pre-tokenizer).
    assert_eq!(tok.encode("2024").unwrap().len(), 4);
}

#[test]
fn chunked_prefill_through_the_cache_matches_dense_attention() {
    let Some((model, tok)) = model() else { return };
    let worst = chunked_prefill_difference(model, tok, 96);
    // f16 storage of K and V against f32: logits agree to a few hundredths.
    assert!(worst < 0.1, "largest logit difference {worst}");
}

#[test]
fn schemes_rank_as_the_issue_requires() {
    let Some((model, tok)) = model() else { return };
    let ids = &tok.encode(eval::CORPUS).unwrap()[..384];
    let schemes = eval::parse_schemes("f16,q8,q4_tok,kivi4,q2_tok,kivi2").unwrap();
    let report = eval::evaluate(model, ids, &schemes, &[], 128, &mut |_| {}).unwrap();
    for s in &report.schemes {
        eprintln!(
            "{:<8} KL {:.3e} p99 {:.3e} top-1 {:.3} ΔNLL {:+.4}",
            s.scheme, s.mean_kl, s.p99_kl, s.top1, s.delta_nll
        );
    }
    let get = |name: &str| report.schemes.iter().find(|s| s.scheme == name).unwrap();
    let f16 = get("f16");
    assert_eq!(
        (f16.mean_kl, f16.p99_kl, f16.top1, f16.delta_nll),
        (0.0, 0.0, 1.0, 0.0)
    );
    let q8 = get("q8");
    assert!(q8.mean_kl < 5e-3 && q8.top1 >= 0.97, "q8: {q8:?}");
    let (q4, kivi4) = (get("q4_tok"), get("kivi4"));
    assert!(
        5.0 * kivi4.mean_kl <= q4.mean_kl,
        "kivi4 {} vs q4_tok {}",
        kivi4.mean_kl,
        q4.mean_kl
    );
    let (q2, kivi2) = (get("q2_tok"), get("kivi2"));
    assert!(
        2.0 * kivi2.mean_kl <= q2.mean_kl,
        "kivi2 {} vs q2_tok {}",
        kivi2.mean_kl,
        q2.mean_kl
    );
    assert_eq!(report.scored, 383);
    assert_eq!(f16.depth[0].tokens, 383);

    // The noise estimate: 5 full blocks of 64 of the 383 scored positions; the baseline against
    // itself has no spread, and kivi2 is worse than q8 by many standard errors.
    assert_eq!((f16.kl_blocks.len(), f16.kl_stderr), (5, Some(0.0)));
    let index = |name: &str| {
        report
            .schemes
            .iter()
            .position(|s| s.scheme == name)
            .unwrap()
    };
    assert_eq!(
        report.kl_difference(index("q8"), index("q8")),
        Some((0.0, 0.0))
    );
    let (d, se) = report.kl_difference(index("kivi2"), index("q8")).unwrap();
    assert!(d > 4.0 * se && se > 0.0, "kivi2 − q8 = {d} ± {se}");
    let se = kivi2.kl_stderr.unwrap();
    assert!(
        se > 0.0 && se < kivi2.mean_kl,
        "kivi2 KL {} ± {se}",
        kivi2.mean_kl
    );
}

/// `inspect` reads the KV shape of any architecture from the header alone: a gemma3-like file
/// (no weights; head_dim from `key_length`, one KV head, a sliding window) and a file whose
/// head_dim comes from the embedding over the heads. Runs without the model.
#[test]
fn inspect_reads_the_kv_shape_of_any_architecture() {
    use candle_core::quantized::gguf_file::{Value, write};
    let dir = std::env::temp_dir();
    let header = |name: &str, keys: &[(&str, Value)]| {
        let path = dir.join(format!("hipkv-inspect-{}-{name}.gguf", std::process::id()));
        let mut file = std::fs::File::create(&path).unwrap();
        let refs: Vec<(&str, &Value)> = keys.iter().map(|(k, v)| (*k, v)).collect();
        write(&mut file, &refs, &[]).unwrap();
        path
    };
    let gemma = header(
        "gemma3",
        &[
            ("general.architecture", Value::String("gemma3".into())),
            ("gemma3.block_count", Value::U32(18)),
            ("gemma3.embedding_length", Value::U32(640)),
            ("gemma3.attention.head_count", Value::U32(4)),
            ("gemma3.attention.head_count_kv", Value::U32(1)),
            ("gemma3.attention.key_length", Value::U32(256)),
            ("gemma3.attention.sliding_window", Value::U32(512)),
        ],
    );
    let s = eval::inspect(&gemma).unwrap();
    assert_eq!(s.architecture, "gemma3");
    assert_eq!(
        (s.shape.layers, s.shape.kv_heads, s.shape.head_dim),
        (18, 1, 256)
    );
    assert_eq!((s.sliding_window, s.weight_bytes), (Some(512), 0));
    let plain = header(
        "llama",
        &[
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", Value::U32(2)),
            ("llama.embedding_length", Value::U32(512)),
            ("llama.attention.head_count", Value::U32(4)),
        ],
    );
    let s = eval::inspect(&plain).unwrap();
    assert_eq!(
        (s.shape.layers, s.shape.kv_heads, s.shape.head_dim),
        (2, 4, 128)
    );
    assert_eq!(s.sliding_window, None);
    let missing = header(
        "missing",
        &[("general.architecture", Value::String("x".into()))],
    );
    assert!(matches!(
        eval::inspect(&missing),
        Err(EvalError::MissingMetadata { .. })
    ));
    for path in [gemma, plain, missing] {
        std::fs::remove_file(path).unwrap();
    }
}

#[test]
fn gemma3_reads_its_shape_and_layer_pattern() {
    let Some((model, tok)) = gemma3() else { return };
    let cfg = *model.config();
    assert_eq!(cfg.architecture, Architecture::Gemma3);
    assert_eq!(
        (
            cfg.layers,
            cfg.q_heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.vocab
        ),
        (18, 4, 1, 256, 262_144)
    );
    assert_eq!(
        (cfg.sliding_window, cfg.rope_base),
        (Some(512), 1_000_000.0)
    );
    let global: Vec<usize> = (0..cfg.layers)
        .filter(|&l| cfg.window(l).is_none())
        .collect();
    assert_eq!(global, [5, 11, 17]);
    let bases: Vec<f32> = [0, 5].map(|l| cfg.layer_rope(l).base).to_vec();
    assert_eq!(bases, [10_000.0, 1_000_000.0]);
    assert_eq!(tok.vocab_size(), 262_144);
}

/// The 270M base model is unsure of France alone (" the" 0.19, " Paris" 0.08), but with one
/// example it names Berlin.
#[test]
fn gemma3_the_capital_of_germany_is_berlin() {
    let Some((model, tok)) = gemma3() else { return };
    let ids = tok
        .encode("The capital of France is Paris. The capital of Germany is")
        .unwrap();
    assert_eq!(ids[0], 2, "Gemma's text starts with <bos>: {ids:?}");
    let berlin = tok.encode(" Berlin").unwrap();
    assert_eq!(berlin.len(), 2, "<bos> and \" Berlin\": {berlin:?}");

    let (id, p) = next_token_cache_and_dense(model, tok, &ids, 3);
    assert_eq!(id, berlin[1], "top token {:?}", tok.decode(&[id]).unwrap());
    assert!(
        (0.78..0.88).contains(&p),
        "p(\" Berlin\") = {p}, expected about 0.83"
    );
}

#[test]
fn gemma3_tokenizer_round_trips_the_corpus() {
    let Some((_, tok)) = gemma3() else { return };
    let ids = tok.encode(eval::CORPUS).unwrap();
    assert!(ids.len() >= 4096, "corpus has {} tokens", ids.len());
    assert_eq!(tok.decode(&ids).unwrap(), eval::CORPUS);
    // A character outside the vocabulary is spelled in bytes and decodes back.
    let odd = "\u{10FFFD}";
    let ids = tok.encode(odd).unwrap();
    assert_eq!(ids.len(), 1 + odd.len(), "{ids:?}");
    assert_eq!(tok.decode(&ids).unwrap(), odd);
}

/// The cache (f16) and dense f32 attention agree over chunks, RoPE of both kinds of layer
/// included, past the 512-token sliding window of the local layers: 640 tokens in chunks of 40,
/// so windows start inside blocks and chunks straddle the window's edge.
#[test]
fn gemma3_chunked_prefill_matches_dense_attention_past_the_window() {
    let Some((model, tok)) = gemma3() else { return };
    let worst = chunked_prefill_difference(model, tok, 640);
    // As for SmolLM2: f16 storage against f32 moves logits by a few hundredths.
    assert!(worst < 0.1, "largest logit difference {worst}");
}

/// The eval ranks schemes at head_dim 256 as at 64: q8 near the baseline, per-channel keys
/// (kivi) well ahead of per-token keys at 4 and 2 bits; a calibration file made by `calibrate`
/// on this model (two caches, one per RoPE) round-trips through the eval.
#[test]
fn gemma3_schemes_rank_and_calibrations_apply() {
    let Some((model, tok)) = gemma3() else { return };
    let ids = &tok.encode(eval::CORPUS).unwrap()[..384];
    let schemes = eval::parse_schemes("q8;q4_tok;kivi4;q2_tok;kivi2;kivi2,nuq").unwrap();
    let calibration = eval::calibrate(model, &ids[..128], schemes[5]).unwrap();
    assert_eq!(calibration.layers.len(), 18);
    let text = calibration.to_text();
    let parsed = hipkv::Calibration::parse(&text).unwrap();
    let report = eval::evaluate(model, ids, &schemes, &[parsed], 128, &mut |_| {}).unwrap();
    for s in &report.schemes {
        eprintln!(
            "{:<12} KL {:.3e} p99 {:.3e} top-1 {:.3} ΔNLL {:+.4}",
            s.scheme, s.mean_kl, s.p99_kl, s.top1, s.delta_nll
        );
    }
    assert_eq!(report.head_dim, 256);
    let get = |name: &str| report.schemes.iter().find(|s| s.scheme == name).unwrap();
    let q8 = get("q8");
    assert!(q8.mean_kl < 0.02 && q8.top1 >= 0.9, "q8: {q8:?}");
    let (q4, kivi4, q2, kivi2) = (get("q4_tok"), get("kivi4"), get("q2_tok"), get("kivi2"));
    assert!(q8.mean_kl < kivi4.mean_kl, "q8 {q8:?} vs kivi4 {kivi4:?}");
    assert!(
        kivi4.mean_kl < q4.mean_kl,
        "kivi4 {kivi4:?} vs q4_tok {q4:?}"
    );
    assert!(
        kivi2.mean_kl < q2.mean_kl,
        "kivi2 {kivi2:?} vs q2_tok {q2:?}"
    );
}

#[test]
fn each_layer_alone_causes_a_share_of_the_schemes_kl() {
    let Some((model, tok)) = model() else { return };
    let ids = &tok.encode(eval::CORPUS).unwrap()[..128];
    let layers = model.config().layers;
    let q2 =
        eval::layer_sensitivity(model, ids, "q2_tok".parse().unwrap(), 64, &mut |_| {}).unwrap();
    assert_eq!(q2.layer_kl.len(), layers);
    // Alone, every layer moves the distribution, by less than all of them together; the same
    // scheme in every layer is what `evaluate` measures.
    assert!(
        q2.layer_kl.iter().all(|&kl| kl > 0.0 && kl < q2.mean_kl),
        "{q2:?}"
    );
    let whole = eval::evaluate(
        model,
        ids,
        &[q2.scheme.parse().unwrap()],
        &[],
        64,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(whole.schemes[0].mean_kl, q2.mean_kl);
    // An f16 layer among f16 layers changes nothing.
    let f16 = eval::layer_sensitivity(model, &ids[..32], "f16".parse().unwrap(), 32, &mut |_| {})
        .unwrap();
    assert!(f16.mean_kl == 0.0 && f16.layer_kl.iter().all(|&kl| kl == 0.0));
}
