//! Shared helpers of the integration tests: cache construction and the naive reference attention.
#![allow(dead_code)]

pub mod rig;

use hipkv::quant::Codebook;
use hipkv::synth::Rng;
use hipkv::{Backend, CacheConfig, KvCache, LowBits, Query, Rope, RopeLayout, RopeTable, Scheme};

/// The device backend that the kernels' differential tests (tests/kernels.rs, tests/sweep.rs)
/// run on: the SIMT emulator, or the HIP runtime's GPU when `HIPKV_TEST_BACKEND=hip` (as
/// `scripts/cuda/device-check.sh` runs them on an NVIDIA GPU through `hip_on_cuda`). Asking for
/// a GPU where none is usable fails rather than testing the emulator twice.
pub fn kernel_backend() -> Backend {
    match std::env::var("HIPKV_TEST_BACKEND").as_deref() {
        Err(_) | Ok("emu") => Backend::Emu,
        Ok("hip") => {
            let status = hipkv::backend::HipStatus::probe();
            if let Some(why) = status.obstacle() {
                panic!("HIPKV_TEST_BACKEND=hip, but no GPU is usable: {why}");
            }
            Backend::Hip
        }
        Ok(other) => panic!("HIPKV_TEST_BACKEND={other}: expected emu or hip"),
    }
}

pub fn config(
    scheme: &str,
    kv_heads: usize,
    gqa: usize,
    head_dim: usize,
    capacity: usize,
) -> CacheConfig {
    CacheConfig {
        layers: 1,
        sequences: 1,
        kv_heads,
        q_heads: kv_heads * gqa,
        head_dim,
        capacity,
        scheme: scheme.parse::<Scheme>().unwrap(),
        rope: None,
    }
}

/// A codebook of `2^bits` random strictly increasing levels in the codes' range.
pub fn random_codebook(bits: LowBits, rng: &mut Rng) -> Codebook {
    let n = 1usize << bits.bits();
    let top = (n - 1) as f32;
    loop {
        let mut levels: Vec<f32> = (0..n).map(|_| rng.uniform() * top).collect();
        levels.sort_by(f32::total_cmp);
        if let Ok(book) = Codebook::new(bits, &levels) {
            return book;
        }
    }
}

pub fn with_rope(mut c: CacheConfig, layout: RopeLayout) -> CacheConfig {
    c.rope = Some(Rope {
        base: 10000.0,
        layout,
    });
    c
}

/// Fills sequence `seq` of layer 0 with `len` random tokens appended in chunks of `chunk`,
/// calibrating outlier thresholds and codebooks from the data first when the scheme needs them.
pub fn fill(
    cache: &mut KvCache,
    seq: usize,
    len: usize,
    chunk: usize,
    rng: &mut Rng,
) -> (Vec<f32>, Vec<f32>) {
    let c = *cache.config();
    let width = c.kv_heads * c.head_dim;
    let k = hipkv::synth::keys_with_outlier_channels(rng, len, c.kv_heads, c.head_dim, 2, 6.0);
    let v = rng.normals(len * width);
    if len > 0 {
        cache.calibrate(0, &k, &v, 0).unwrap();
    }
    for start in (0..len).step_by(chunk.max(1)) {
        let end = (start + chunk).min(len);
        cache
            .append(
                0,
                seq,
                &k[start * width..end * width],
                &v[start * width..end * width],
            )
            .unwrap();
    }
    (k, v)
}

/// Naive attention over the dequantized cache: f64 softmax of `scale · q·k` over every key up to
/// the query's position. `q` is unrotated; it is rotated here exactly as the cache rotates it.
/// One decode query per sequence: sequence `i` attends with `qs[i]` into `outs[i]`.
pub fn queries<'a>(qs: &'a [Vec<f32>], outs: &'a mut [Vec<f32>]) -> Vec<Query<'a>> {
    outs.iter_mut()
        .zip(qs)
        .enumerate()
        .map(|(seq, (out, q))| Query { seq, q, out })
        .collect()
}

/// The attention the cache's scheme defines, in f64 over the cache's own rows: the query
/// rotated by RoPE if the cache applies it, then rounded as `iq` rounds it if the scheme scores
/// keys from the int8 query.
pub fn naive_attend(cache: &KvCache, seq: usize, q: &[f32], scale: f32) -> Vec<f32> {
    let int_query = cache.config().scheme.int_query;
    naive_attend_with(cache, seq, q, scale, int_query)
}

/// [`naive_attend`] with the query rounded (`int_query`) or exact, whatever the scheme says.
pub fn naive_attend_with(
    cache: &KvCache,
    seq: usize,
    q: &[f32],
    scale: f32,
    int_query: bool,
) -> Vec<f32> {
    let c = *cache.config();
    let d = c.head_dim;
    let (k, v) = cache.read_back(0, seq).unwrap();
    let len = cache.len(0, seq).unwrap();
    let width = c.q_heads * d;
    let q_len = q.len() / width;
    let mut q = q.to_vec();
    if let Some(table) = c.rope.map(|rope| RopeTable::new(rope, d, c.capacity)) {
        for (t, token) in q.chunks_exact_mut(width).enumerate() {
            for head in token.chunks_exact_mut(d) {
                table.rotate(head, len - q_len + t);
            }
        }
    }
    let mut offsets = None;
    if int_query && c.scheme.rounds_query_per_step() {
        q = rounded_query(&q, &c.scheme, d);
    } else if int_query {
        offsets = Some(chan_int_offsets(cache, seq, &q, scale));
    }
    let window = cache.sliding_window(0).unwrap();
    naive_chunk_offset(
        &k,
        &v,
        &q,
        len,
        c.kv_heads,
        c.q_heads,
        d,
        scale,
        window,
        offsets.as_deref(),
    )
}

/// What `iq` adds to each logit of per-channel keys (`q*_chan`), `q_len × q_heads × len`: on a
/// closed page (past the sinks), `iq` scores `Σ_b S_b (ĉ_b · codes_b) + q·m` in log2 units,
/// `ĉ_b` and `S_b` the int8 codes and scale (`quant::quantize_query`) of block `b` of the
/// folded query `q ∘ s` (f32, `q` the query times `scale · log2 e` as the backends scale it)
/// and `codes_b` the key's; the exact logit is `scale · q · (m + s·codes)`. Read from the
/// stored pages of layer 0, so it is independent of how the backends compute it. `q` is
/// rotated.
fn chan_int_offsets(cache: &KvCache, seq: usize, q: &[f32], scale: f32) -> Vec<f64> {
    let c = cache.config();
    let len = cache.len(0, seq).unwrap();
    let stored = cache.stored_bytes(0, seq).unwrap();
    let bytes = cache.layout().block_bytes();
    let page = |p: usize| &stored[p * bytes..(p + 1) * bytes];
    paged_chan_int_offsets(cache.layout(), page, len, c.q_heads, q, scale)
}

/// [`chan_int_offsets`] of a paged sequence of `len` tokens whose page `p` is `page(p)`.
pub fn paged_chan_int_offsets<'a>(
    layout: &hipkv::paged::Layout,
    page: impl Fn(usize) -> &'a [u8],
    len: usize,
    q_heads: usize,
    q: &[f32],
    scale: f32,
) -> Vec<f64> {
    let scheme = layout.scheme();
    let d = layout.head_dim();
    let hipkv::Format::Chan { bits } = scheme.k else {
        panic!("per-channel keys, not {}", scheme.k)
    };
    let (g, sl) = (layout.block_tokens(), layout.head_layout().k);
    let head_bytes = layout.head_layout().bytes;
    let width = q_heads * d;
    let q_len = q.len() / width;
    let gqa = layout.gqa();
    // As the backends scale the query: `(q · scale) · log2 e` in f32.
    let scaled = |x: f32| x * scale * std::f32::consts::LOG2_E;
    let block = hipkv::quant::QUERY_BLOCK;
    let mut out = vec![0f64; q_len * q_heads * len];
    for p in 0..len / g {
        for qh in 0..q_heads {
            let head = &page(p)[qh / gqa * head_bytes..][..head_bytes];
            let param =
                |ch: usize, i: usize| hipkv::quant::get_f16(head, sl.params + 4 * ch + 2 * i);
            for t in 0..q_len {
                let row = &q[t * width + qh * d..][..d];
                let folded: Vec<f32> = (0..d).map(|ch| scaled(row[ch]) * param(ch, 0)).collect();
                let (mut codes, mut scales) = (vec![0i8; d], vec![0f32; d / block]);
                hipkv::quant::quantize_query(&folded, &mut codes, &mut scales);
                for pos in (p * g).max(scheme.sinks)..(p + 1) * g {
                    let key = &head[sl.rows + (pos - p * g) * sl.row_bytes..][..sl.row_bytes];
                    let (mut int, mut exact) = (0f64, 0f64);
                    for ch in 0..d {
                        let code = f64::from(hipkv::quant::code_at(key, bits, ch));
                        let (s, m) = (f64::from(param(ch, 0)), f64::from(param(ch, 1)));
                        int += f64::from(scales[ch / block]) * f64::from(codes[ch]) * code;
                        int += f64::from(scaled(row[ch])) * m;
                        exact += f64::from(row[ch]) * (m + s * code);
                    }
                    let at = (t * q_heads + qh) * len + pos;
                    out[at] = int * std::f64::consts::LN_2 - f64::from(scale) * exact;
                }
            }
        }
    }
    out
}

/// Causal attention, in f64, of a query chunk `q` (`q_len × q_heads × head_dim`, rotated: the
/// last `q_len` of `len` positions) over keys and values (`len × kv_heads × head_dim`, keys
/// rotated), within a sliding `window` if any: each query attends to its own position and the
/// `window − 1` before it.
#[allow(clippy::too_many_arguments)]
pub fn naive_chunk(
    k: &[f32],
    v: &[f32],
    q: &[f32],
    len: usize,
    kv_heads: usize,
    q_heads: usize,
    d: usize,
    scale: f32,
    window: Option<usize>,
) -> Vec<f32> {
    naive_chunk_offset(k, v, q, len, kv_heads, q_heads, d, scale, window, None)
}

/// [`naive_chunk`] with `offsets[(t · q_heads + head) · len + position]` added to each logit.
#[allow(clippy::too_many_arguments)]
pub fn naive_chunk_offset(
    k: &[f32],
    v: &[f32],
    q: &[f32],
    len: usize,
    kv_heads: usize,
    q_heads: usize,
    d: usize,
    scale: f32,
    window: Option<usize>,
    offsets: Option<&[f64]>,
) -> Vec<f32> {
    let (h, r) = (kv_heads, q_heads / kv_heads);
    let width = q_heads * d;
    let q_len = q.len() / width;
    let mut out = vec![0f32; q.len()];
    for t in 0..q_len {
        let pos = len - q_len + t;
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for qh in 0..q_heads {
            let kh = qh / r;
            let qv = &q[t * width + qh * d..][..d];
            let logits: Vec<f64> = (first..=pos)
                .map(|p| {
                    let kv = &k[(p * h + kh) * d..][..d];
                    let offset = offsets.map_or(0.0, |o| o[(t * q_heads + qh) * len + p]);
                    f64::from(scale)
                        * qv.iter()
                            .zip(kv)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                        + offset
                })
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for ch in 0..d {
                let acc: f64 = (first..=pos)
                    .zip(&w)
                    .map(|(p, w)| w * f64::from(v[(p * h + kh) * d + ch]))
                    .sum();
                out[t * width + qh * d + ch] = (acc / sum) as f32;
            }
        }
    }
    out
}

/// Attends the query chunk `q` of layer 0, sequence 0, and asserts that the output is the naive
/// reference's over the cache's own rows within the kernels' 1e-5 per row
/// ([`assert_outputs_close`]); returns it.
pub fn attend_as_reference(cache: &KvCache, q: &[f32], scale: f32, what: &str) -> Vec<f32> {
    let mut out = vec![0f32; q.len()];
    cache.attend(0, 0, q, scale, &mut out).unwrap();
    let want = naive_attend(cache, 0, q, scale);
    let c = cache.config();
    assert_outputs_close(&c.scheme, &out, &want, c.head_dim, 1e-5, what);
    out
}

/// Largest element-wise difference, relative to the largest magnitude of `want`.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

/// Asserts every `head_dim`-row of `got` is within `tolerance` of the same row of `want`,
/// relative to that row's largest element; `what` names the case in the failure message.
pub fn assert_rows_close(got: &[f32], want: &[f32], head_dim: usize, tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: output lengths");
    for (row, (g, w)) in got
        .chunks_exact(head_dim)
        .zip(want.chunks_exact(head_dim))
        .enumerate()
    {
        let e = rel_err(g, w);
        assert!(e <= tolerance, "{what} row {row}: rel err {e}");
    }
}

/// [`assert_rows_close`] of attention outputs of a scheme. With rotated values (`rot`, `rot=v`)
/// the kernels accumulate `Σ p·Hv` and rotate the sum back once, exactly up to one f32 rounding;
/// the rows are compared in that basis (both rotated, in f64), where the accumulation's error
/// has the same bound as every other scheme's. An orthonormal change of basis keeps the
/// error's 2-norm, but can move it between channels, which the per-row maximum would count.
pub fn assert_outputs_close(
    scheme: &Scheme,
    got: &[f32],
    want: &[f32],
    head_dim: usize,
    tolerance: f32,
    what: &str,
) {
    if !scheme.rotation.applies(hipkv::Stream::V) {
        return assert_rows_close(got, want, head_dim, tolerance, what);
    }
    let rotate = |x: &[f32]| {
        let mut x = x.to_vec();
        x.chunks_exact_mut(head_dim)
            .for_each(hipkv::quant::hadamard_exact);
        x
    };
    assert_rows_close(&rotate(got), &rotate(want), head_dim, tolerance, what);
}

/// Outliers that matter: values with a heavy tail (1% of elements ×30) and keys with outlier
/// channels, so that dropping or misplacing one correction moves the output beyond tolerance.
/// Thresholds come from 4000 tokens (with only the 150 attended, a 0.5% tail per channel would
/// be the channel's maximum and nothing would be stored).
pub fn check_heavy_tailed_outliers(backend: Backend) {
    for scheme in [
        "q4_tok,outliers=kv",
        "k=q2_chan,v=q2_tok,outliers=kv,outlier_slots=2",
        "kivi2,outliers=kv,pre_rope",
    ] {
        let cfg = with_rope(config(scheme, 2, 4, 64, 4000), RopeLayout::Halves);
        let mut rng = Rng::new(21);
        let mut cache = KvCache::new(cfg).unwrap();
        let (len, sample) = (150, 4000);
        let width = cfg.kv_heads * cfg.head_dim;
        let k = hipkv::synth::keys_with_outlier_channels(&mut rng, sample, 2, 64, 2, 6.0);
        let mut v = rng.normals(sample * width);
        for x in v.iter_mut() {
            if rng.uniform() < 0.01 {
                *x *= 30.0;
            }
        }
        cache.calibrate_outliers(0, &k, &v, 0).unwrap();
        cache
            .append(0, 0, &k[..len * width], &v[..len * width])
            .unwrap();
        cache.set_backend(backend).unwrap();
        let q = rng.normals(cfg.q_heads * cfg.head_dim);
        let mut out = vec![0f32; q.len()];
        cache.attend(0, 0, &q, 0.125, &mut out).unwrap();
        let want = naive_attend(&cache, 0, &q, 0.125);
        assert_rows_close(&out, &want, 64, 1e-5, &format!("{backend:?} {scheme}"));
    }
}

/// The query of `iq` as the backends round it: each head's row (rotated first for rotated keys,
/// the rotation undone after) to int8 per 32-channel block, dequantized.
pub fn rounded_query(q: &[f32], scheme: &Scheme, d: usize) -> Vec<f32> {
    let rotated = scheme.rotation.applies(hipkv::Stream::K);
    let mut out = q.to_vec();
    for row in out.chunks_exact_mut(d) {
        if rotated {
            hipkv::quant::hadamard_exact(row);
        }
        let block = hipkv::quant::QUERY_BLOCK;
        let (mut codes, mut scales) = (vec![0i8; d], vec![0f32; d / block]);
        hipkv::quant::quantize_query(row, &mut codes, &mut scales);
        for (i, x) in row.iter_mut().enumerate() {
            *x = scales[i / block] * f32::from(codes[i]);
        }
        if rotated {
            hipkv::quant::hadamard_exact(row);
        }
    }
    out
}

/// `iq` on `backend` computes the attention of the rounded query exactly: the naive reference
/// over the cache's rows and the dequantized int8 query within the kernels' 1e-5 (decode and a
/// 3-token chunk), sinks, open pages, outlier corrections, zero and constant query blocks
/// included; and the rounding is visible against the exact query. The cache is written on
/// `backend` too.
pub fn check_integer_query(backend: Backend) {
    const TOLERANCE: f32 = 1e-5;
    for (i, scheme) in [
        "q8,iq",
        "q8_0,iq",
        "q4_tok,iq",
        "q2_tok,iq",
        "k=q4_tok@64,v=q2_chan,iq",
        "k=q2_tok@head,v=f16,iq,sinks=3",
        "q4_tok,iq,outliers=kv",
        "k=q8,v=q4_tok,iq,rot",
        "kivi4,iq",
        "kivi2,iq,outliers",
        "k=q4_chan,v=q8,g=64,iq,sinks=0",
    ]
    .iter()
    .enumerate()
    {
        for (d, gqa, len, q_len) in [(64, 4, 150, 1), (128, 2, 77, 3), (256, 1, 200, 1)] {
            let cfg = config(scheme, 2, gqa, d, 256);
            let mut rng = Rng::new(100 + i as u64);
            let mut cache = KvCache::with_backend(cfg, backend).unwrap();
            fill(&mut cache, 0, len, 11, &mut rng);
            let mut q = rng.normals(q_len * cfg.q_heads * d);
            // A zero block (scale 0) and a constant one (every code ±127) in the first row.
            q[..32].fill(0.0);
            q[32..64].fill(-0.75);
            let scale = 1.0 / (d as f32).sqrt();
            let mut out = vec![0f32; q.len()];
            cache.attend(0, 0, &q, scale, &mut out).unwrap();
            let what = format!("{backend:?} {scheme} d={d} gqa={gqa} len={len} q_len={q_len}");
            let want = naive_attend_with(&cache, 0, &q, scale, true);
            assert_outputs_close(&cfg.scheme, &out, &want, d, TOLERANCE, &what);
            let exact = naive_attend_with(&cache, 0, &q, scale, false);
            assert!(
                rel_err(&out, &exact) > 10.0 * TOLERANCE,
                "{what}: no rounding seen"
            );
        }
    }
}
