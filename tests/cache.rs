//! The KV cache through its public API: what `read_back` returns for every scheme (pinned to the
//! reference quantizers bit for bit), the residual window, sinks, outlier stores, RoPE, typed
//! errors that leave the cache untouched, memory accounting and the table in `docs/formats.md`.

mod common;

use common::{attend_as_reference, config, fill, naive_attend, rel_err, with_rope};
use hipkv::quant::{
    self, Codebook, dequantize_chan_row, dequantize_row, quantize_chan, quantize_row,
};
use hipkv::scheme::{FRONTIER_PRESETS, HEAD_DIMS, PRESETS};
use hipkv::synth::{Rng, keys_with_outlier_channels};
use hipkv::{
    Backend, CacheConfig, Calibration, Error, Format, KvCache, LowBits, OutlierThresholds,
    RopeLayout, RopeTable, Scheme, Stream, StreamSet,
};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| quant::round_f16(x)).collect()
}

/// Everything observable about one sequence of one layer, bit for bit.
fn snapshot(cache: &KvCache, layer: usize, seq: usize) -> (usize, Vec<u32>, Vec<u32>) {
    let (k, v) = cache.read_back(layer, seq).unwrap();
    (cache.len(layer, seq).unwrap(), bits(&k), bits(&v))
}

/// `n` tokens of keys (with two large-magnitude channels per head) and values for `cfg`.
fn kv(rng: &mut Rng, cfg: &CacheConfig, n: usize) -> (Vec<f32>, Vec<f32>) {
    let k = keys_with_outlier_channels(rng, n, cfg.kv_heads, cfg.head_dim, 2, 6.0);
    let v = rng.normals(n * cfg.kv_heads * cfg.head_dim);
    (k, v)
}

fn append_chunks(
    cache: &mut KvCache,
    layer: usize,
    seq: usize,
    k: &[f32],
    v: &[f32],
    chunk: usize,
) {
    let c = *cache.config();
    let width = c.kv_heads * c.head_dim;
    let n = k.len() / width;
    for start in (0..n).step_by(chunk) {
        let r = start * width..(start + chunk).min(n) * width;
        cache.append(layer, seq, &k[r.clone()], &v[r]).unwrap();
    }
}

/// Independent model of what the cache stores, built only from the public reference quantizers:
/// returns the `(k, v)` that `read_back` must give after appending `k`, `v` (unrotated,
/// `len × kv_heads × head_dim`), and the number of outliers dropped for lack of slots.
///
/// Sinks are f16; per-token formats quantize each token as it arrives; per-channel formats
/// quantize full pages and leave the open page f16. With outliers, each stored (non-sink) token
/// is split (`split_outliers`) before quantization, the dense part is clipped, and the kept
/// outliers overwrite the dequantized row; per-channel streams split when their page fills.
fn model(
    cfg: &CacheConfig,
    k: &[f32],
    v: &[f32],
    thresholds: [Option<&OutlierThresholds>; 2],
    books: [Option<&Codebook>; 2],
) -> (Vec<f32>, Vec<f32>, u64) {
    let s = cfg.scheme;
    let (h, d, g) = (cfg.kv_heads, cfg.head_dim, s.group_tokens);
    let len = k.len() / (h * d);
    let table = cfg.rope.map(|r| RopeTable::new(r, d, cfg.capacity));
    let mut k = k.to_vec();
    if let (Some(t), false) = (&table, s.pre_rope) {
        for (i, row) in k.chunks_exact_mut(d).enumerate() {
            t.rotate(row, i / h);
        }
    }
    let mut dropped = 0u64;
    let mut out = [Vec::new(), Vec::new()];
    for (si, (stream, x)) in [(Stream::K, rounded(&k)), (Stream::V, rounded(v))]
        .into_iter()
        .enumerate()
    {
        let f = s.format(stream);
        let slots = s.outlier_slots(stream, d);
        let th = thresholds[si];
        let book = books[si];
        let mut y = x.clone();
        for head in 0..h {
            let at = |pos: usize| (pos * h + head) * d;
            // Block b holds positions b·g..(b + 1)·g; those below `sinks` live f16 in the
            // slot state instead, and are left out of the block.
            for block in (0..len).step_by(g) {
                let first = block.max(s.sinks);
                let end = (block + g).min(len);
                if first >= end {
                    continue;
                }
                let n = end - first;
                if f.is_grouped_by_tokens() && block + g > len {
                    continue; // the open block, in the residual window: f16, already in `y`
                }
                let mut dense: Vec<f32> = Vec::with_capacity(n * d);
                let mut kept = Vec::new();
                for pos in first..first + n {
                    let mut row = x[at(pos)..at(pos) + d].to_vec();
                    if let Some(th) = th {
                        let (lo, hi) = th.head(head);
                        let (o, dr) = quant::split_outliers(&mut row, lo, hi, slots);
                        dropped += dr as u64;
                        kept.push(o);
                    }
                    dense.extend(row);
                }
                match f {
                    Format::Chan { bits } => {
                        let rb = f.row_bytes(d);
                        let mut rows = vec![0u8; n * rb];
                        let mut params = vec![0u8; d * 4];
                        quantize_chan(bits, &dense, d, &mut rows, &mut params, book);
                        for t in 0..n {
                            let o = at(first + t);
                            dequantize_chan_row(
                                bits,
                                &rows[t * rb..][..rb],
                                &params,
                                &mut y[o..o + d],
                                book,
                            );
                        }
                    }
                    _ => {
                        let mut row = vec![0u8; f.row_bytes(d)];
                        let mut params = vec![0u8; f.params_bytes(1, d)];
                        for t in 0..n {
                            let o = at(first + t);
                            let x = &dense[t * d..(t + 1) * d];
                            quantize_row(f, x, &mut row, &mut params, book);
                            dequantize_row(f, &row, &params, &mut y[o..o + d], book);
                        }
                    }
                }
                for (t, outliers) in kept.iter().enumerate() {
                    for o in outliers {
                        y[at(first + t) + usize::from(o.channel)] = o.value;
                    }
                }
                // A block holding any of the last `rv` positions reads its values f16 from the
                // value window (quantized into the block all the same, outliers counted).
                if stream == Stream::V && s.value_window > 0 && block + g + s.value_window > len {
                    y[at(first)..at(end - 1) + d].copy_from_slice(&x[at(first)..at(end - 1) + d]);
                }
            }
        }
        if let (Some(t), true, Stream::K) = (&table, s.pre_rope, stream) {
            for (i, row) in y.chunks_exact_mut(d).enumerate() {
                t.rotate(row, i / h);
            }
        }
        out[si] = y;
    }
    let [k, v] = out;
    (k, v, dropped)
}

fn assert_matches_model(
    cache: &KvCache,
    k: &[f32],
    v: &[f32],
    th: [Option<&OutlierThresholds>; 2],
    what: &str,
) {
    assert_matches_model_with(cache, k, v, th, [None, None], what)
}

fn assert_matches_model_with(
    cache: &KvCache,
    k: &[f32],
    v: &[f32],
    th: [Option<&OutlierThresholds>; 2],
    books: [Option<&Codebook>; 2],
    what: &str,
) {
    let cfg = cache.config();
    let (mk, mv, _) = model(cfg, k, v, th, books);
    let (rk, rv) = cache.read_back(0, 0).unwrap();
    let d = cfg.head_dim;
    for (name, got, want) in [("k", &rk, &mk), ("v", &rv, &mv)] {
        assert_eq!(got.len(), want.len(), "{what}: {name} length");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            let w = cfg.kv_heads * d;
            panic!(
                "{what}: {name} token {} head {} channel {}: read_back {} vs reference {}",
                i / w,
                i % w / d,
                i % d,
                got[i],
                want[i]
            );
        }
    }
}

/// `read_back` equals the reference quantizers applied as the layout says, bit for bit, for
/// every preset and mixed schemes with sinks, G = 64 and RoPE, after every chunk.
#[test]
fn read_back_matches_the_reference_quantizers() {
    let mut schemes: Vec<String> = PRESETS.iter().map(|p| p.to_string()).collect();
    schemes.extend(
        [
            "kivi2,sinks=4",
            "kivi4,g=64",
            "k=q2_chan,v=q4_chan,sinks=3,g=64",
            "k=q8_0,v=q2_tok@head",
            "k=q4_tok@64,v=q8",
            "k=q2_tok@128,v=f16",
            "k=f16,v=q2_chan,sinks=40",
        ]
        .map(String::from),
    );
    let mut rng = Rng::new(1);
    for (i, name) in schemes.iter().enumerate() {
        for d in HEAD_DIMS {
            let mut cfg = config(name, 2, 1, d, 100);
            if i % 3 == 1 {
                cfg = with_rope(cfg, RopeLayout::Interleaved);
            } else if i % 3 == 2 {
                cfg = with_rope(cfg, RopeLayout::Halves);
                cfg.scheme.pre_rope = i % 2 == 0;
                // Pre-RoPE keys are rotated after decoding: no `iq` for them.
                cfg.scheme.int_query &= cfg.scheme.int_query_applies();
            }
            let mut cache = KvCache::new(cfg).unwrap();
            let (k, v) = kv(&mut rng, &cfg, 100);
            let width = 2 * d;
            let mut len = 0;
            for chunk in [1, 30, 1, 2, 31, 35] {
                let r = len * width..(len + chunk) * width;
                cache.append(0, 0, &k[r.clone()], &v[r]).unwrap();
                len += chunk;
                let what = format!("{} d={d} len={len}", cfg.scheme);
                assert_matches_model(
                    &cache,
                    &k[..len * width],
                    &v[..len * width],
                    [None, None],
                    &what,
                );
            }
        }
    }
}

/// kivi2 (G = 32, without its value window) after 40 tokens: the last 8 keys are the open page,
/// f16 in the residual window, so they read back exactly; tokens 0..32 are a quantized 2-bit
/// group.
#[test]
fn residual_window_keeps_the_open_page_exact() {
    let cfg = config("kivi2,rv=0", 2, 1, 64, 64);
    let mut cache = KvCache::new(cfg).unwrap();
    let mut rng = Rng::new(2);
    let (k, v) = kv(&mut rng, &cfg, 64);
    let w = 2 * 64;
    append_chunks(&mut cache, 0, 0, &k[..40 * w], &v[..40 * w], 7);
    let (rk, rv) = cache.read_back(0, 0).unwrap();
    assert_eq!(
        bits(&rk[32 * w..]),
        bits(&rounded(&k[32 * w..40 * w])),
        "residual keys exact"
    );
    let exact = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() == y.to_bits())
            .count()
    };
    let (ek, ev) = (
        exact(&rk[..32 * w], &rounded(&k[..32 * w])),
        exact(&rv, &rounded(&v[..40 * w])),
    );
    assert!(ek < 32 * w / 2, "quantized keys: {ek} of {} exact", 32 * w);
    assert!(
        ev < 40 * w / 2,
        "values are q2_tok from the first token: {ev} exact"
    );
    // 24 more tokens fill the page: now every key is quantized.
    cache.append(0, 0, &k[40 * w..], &v[40 * w..]).unwrap();
    let (rk, _) = cache.read_back(0, 0).unwrap();
    assert!(exact(&rk[32 * w..], &rounded(&k[32 * w..])) < 32 * w / 2);
    assert_matches_model(&cache, &k, &v, [None, None], "kivi2 64 tokens");
}

/// kivi2's value window (R = 128, G = 32): after 200 tokens, the values of the blocks holding
/// the last 128 positions (64..200) read back exactly, the older ones past the sinks as 2-bit
/// codes.
#[test]
fn value_window_keeps_the_last_values_exact() {
    let cfg = config("kivi2", 2, 1, 64, 200);
    let mut cache = KvCache::new(cfg).unwrap();
    let mut rng = Rng::new(4);
    let (k, v) = kv(&mut rng, &cfg, 200);
    let w = 2 * 64;
    append_chunks(&mut cache, 0, 0, &k, &v, 23);
    let (_, rv) = cache.read_back(0, 0).unwrap();
    assert_eq!(bits(&rv[64 * w..]), bits(&rounded(&v[64 * w..])));
    // Past the preset's 4 sinks, which are f16 too.
    for pos in 4..64 {
        let r = pos * w..(pos + 1) * w;
        assert_ne!(
            bits(&rv[r.clone()]),
            bits(&rounded(&v[r])),
            "position {pos}"
        );
    }
    assert_matches_model(&cache, &k, &v, [None, None], "kivi2 200 tokens");
}

/// The first `sinks` tokens stay f16 in every format; the tokens after them do not.
#[test]
fn sinks_stay_exact() {
    for (name, sinks) in [
        ("kivi2,sinks=4,rv=0", 4),
        ("q2_tok,sinks=5", 5),
        ("q8_0,sinks=33", 33),
    ] {
        let cfg = config(name, 2, 1, 128, 80);
        let mut cache = KvCache::new(cfg).unwrap();
        let (k, v) = kv(&mut Rng::new(3), &cfg, 80);
        append_chunks(&mut cache, 0, 0, &k, &v, 9);
        let (rk, rv) = cache.read_back(0, 0).unwrap();
        let w = 2 * 128;
        assert_eq!(
            bits(&rk[..sinks * w]),
            bits(&rounded(&k[..sinks * w])),
            "{name} keys"
        );
        assert_eq!(
            bits(&rv[..sinks * w]),
            bits(&rounded(&v[..sinks * w])),
            "{name} values"
        );
        assert_ne!(
            bits(&rv[sinks * w..]),
            bits(&rounded(&v[sinks * w..])),
            "{name}"
        );
    }
}

/// Thresholds the cache computes from calibration data (no RoPE: the keys as given).
fn thresholds(cfg: &CacheConfig, k: &[f32], v: &[f32]) -> [Option<OutlierThresholds>; 2] {
    let o = cfg.scheme.outliers.unwrap();
    let (h, d) = (cfg.kv_heads, cfg.head_dim);
    let kt = OutlierThresholds::calibrate(k, h, d, o.fraction).unwrap();
    let vt = o
        .values
        .then(|| OutlierThresholds::calibrate(v, h, d, o.fraction).unwrap());
    [Some(kt), vt]
}

/// Elements of `x` (f16-rounded) outside the thresholds, per `(token, head)`: `(channel, |x -
/// clip(x)|)`.
fn outside(x: &[f32], th: &OutlierThresholds) -> Vec<Vec<(usize, f32)>> {
    let d = th.head_dim;
    x.chunks_exact(d)
        .enumerate()
        .map(|(i, row)| {
            let (lo, hi) = th.head(i % th.heads);
            (0..d)
                .filter_map(|c| {
                    let x = quant::round_f16(row[c]);
                    let dist = (x - x.clamp(lo[c], hi[c])).abs();
                    (dist > 0.0).then_some((c, dist))
                })
                .collect()
        })
        .collect()
}

/// Calibrates on one draw, appends another (noisier, so many elements fall outside) in a cache
/// with `slots` outlier slots per token; returns the cache, the appended data and thresholds.
fn outlier_cache(
    name: &str,
    len: usize,
) -> (KvCache, Vec<f32>, Vec<f32>, [Option<OutlierThresholds>; 2]) {
    let cfg = config(name, 2, 1, 64, 128);
    let mut cache = KvCache::new(cfg).unwrap();
    let mut rng = Rng::new(4);
    let (kc, vc) = kv(&mut rng, &cfg, 128);
    cache.calibrate_outliers(0, &kc, &vc, 0).unwrap();
    let th = thresholds(&cfg, &kc, &vc);
    let (k, v) = kv(&mut rng, &cfg, len);
    let (k, v): (Vec<f32>, Vec<f32>) = (
        k.iter().map(|x| x * 1.3).collect(),
        v.iter().map(|x| x * 1.3).collect(),
    );
    append_chunks(&mut cache, 0, 0, &k, &v, 5);
    (cache, k, v, th)
}

/// With enough slots every element outside the calibrated thresholds reads back exactly (its
/// f16-rounded input), wherever it is stored, and nothing is dropped.
#[test]
fn outliers_read_back_exactly_when_slots_suffice() {
    for name in [
        "kivi2,outliers=kv,outlier_slots=64",
        "q4_tok,outliers=kv,outlier_slots=64,sinks=3",
        "k=q8_0,v=q2_tok@head,outliers,outlier_slots=64",
    ] {
        let (cache, k, v, th) = outlier_cache(name, 70);
        let (rk, rv) = cache.read_back(0, 0).unwrap();
        assert_eq!(cache.outliers_dropped(), 0, "{name}");
        for (stream, x, got, th) in [("k", &k, &rk, &th[0]), ("v", &v, &rv, &th[1])] {
            let Some(th) = th else { continue };
            let out = outside(x, th);
            let total: usize = out.iter().map(Vec::len).sum();
            assert!(
                total > 70,
                "{name} {stream}: only {total} outliers; the test needs many"
            );
            for (i, row) in out.iter().enumerate() {
                for &(c, _) in row {
                    let at = i * 64 + c;
                    assert_eq!(
                        got[at],
                        quant::round_f16(x[at]),
                        "{name} {stream} row {i} ch {c}"
                    );
                }
            }
        }
        assert_matches_model(&cache, &k, &v, [th[0].as_ref(), th[1].as_ref()], name);
    }
}

/// With one slot per token, the farthest outlier of each stored token-head reads back exactly
/// and every other one is counted in `outliers_dropped` (per-channel keys count when their page
/// is quantized: the open page is f16 and drops nothing).
#[test]
fn outlier_overflow_is_counted() {
    for (name, chan_keys) in [
        ("kivi2,outliers=kv,outlier_slots=1", true),
        ("q4_tok,outliers=kv,outlier_slots=1", false),
        ("k=q2_tok,v=q8,outliers,outlier_slots=1,sinks=2", false),
    ] {
        let len = 70;
        let (cache, k, v, th) = outlier_cache(name, len);
        let sinks = cache.config().scheme.sinks;
        let (rk, rv) = cache.read_back(0, 0).unwrap();
        let mut want = 0;
        for (si, (x, got)) in [(&k, &rk), (&v, &rv)].into_iter().enumerate() {
            let Some(th) = &th[si] else { continue };
            // Per-channel keys: the positions of full pages (blocks start at position 0,
            // whatever the sinks).
            let stored = if si == 0 && chan_keys {
                len / 32 * 32
            } else {
                len
            };
            for (i, row) in outside(x, th)
                .iter()
                .enumerate()
                .take(stored * 2)
                .skip(sinks * 2)
            {
                want += row.len().saturating_sub(1);
                // Farthest outside; ties go to the lower channel.
                if let Some(&(c, _)) =
                    row.iter()
                        .fold(None, |b: Option<&(usize, f32)>, o| match b {
                            Some(b) if b.1 >= o.1 => Some(b),
                            _ => Some(o),
                        })
                {
                    let at = i * 64 + c;
                    assert_eq!(
                        got[at],
                        quant::round_f16(x[at]),
                        "{name} stream {si} row {i}"
                    );
                }
            }
        }
        assert!(want > 0, "{name}: the test needs overflow");
        assert_eq!(cache.outliers_dropped(), want as u64, "{name}");
        let th_refs = [th[0].as_ref(), th[1].as_ref()];
        let (_, _, model_dropped) = model(cache.config(), &k, &v, th_refs, [None, None]);
        assert_eq!(model_dropped, want as u64, "{name}: model");
        assert_matches_model(&cache, &k, &v, [th[0].as_ref(), th[1].as_ref()], name);
    }
}

#[test]
fn outlier_threshold_errors() {
    let cfg = config("q8,outliers", 2, 1, 64, 16);
    let mut cache = KvCache::new(cfg).unwrap();
    let (k, v) = kv(&mut Rng::new(5), &cfg, 4);
    // No thresholds yet: typed error, nothing written.
    assert_eq!(
        cache.append(0, 0, &k, &v),
        Err(Error::OutliersNotCalibrated { layer: 0 })
    );
    assert_eq!(cache.len(0, 0), Ok(0));
    let t = |heads, d| OutlierThresholds::calibrate(&vec![0.0; heads * d], heads, d, 0.01).unwrap();
    assert!(matches!(
        cache.set_outlier_thresholds(0, t(1, 64), None),
        Err(Error::Shape {
            expected: 128,
            got: 64,
            ..
        })
    ));
    assert!(matches!(
        cache.set_outlier_thresholds(0, t(2, 64), Some(t(2, 64))),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        cache.set_outlier_thresholds(1, t(2, 64), None),
        Err(Error::OutOfRange {
            what: "layer",
            index: 1,
            limit: 1
        })
    ));
    cache.set_outlier_thresholds(0, t(2, 64), None).unwrap();
    cache.append(0, 0, &k, &v).unwrap();
    let mut kv_cache = KvCache::new(config("q8,outliers=kv", 2, 1, 64, 16)).unwrap();
    assert!(matches!(
        kv_cache.set_outlier_thresholds(0, t(2, 64), None),
        Err(Error::Unsupported(_))
    ));
    let mut plain = KvCache::new(config("q8", 2, 1, 64, 16)).unwrap();
    assert!(matches!(
        plain.set_outlier_thresholds(0, t(2, 64), None),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        plain.calibrate_outliers(0, &k, &v, 0),
        Err(Error::Unsupported(_))
    ));
}

/// A full cache answers `CacheFull` and stays exactly as it was.
#[test]
fn full_cache_is_an_error_and_changes_nothing() {
    for name in [
        "q8",
        "kivi2,sinks=3",
        "q4_tok,outliers=kv",
        "k=q2_chan,v=f16,g=64",
    ] {
        let cfg = config(name, 2, 2, 64, 40);
        let mut cache = KvCache::new(cfg).unwrap();
        let (k, v) = kv(&mut Rng::new(6), &cfg, 41);
        if cfg.scheme.outliers.is_some() {
            cache.calibrate_outliers(0, &k, &v, 0).unwrap();
        }
        let w = 2 * 64;
        append_chunks(&mut cache, 0, 0, &k[..37 * w], &v[..37 * w], 6);
        let before = snapshot(&cache, 0, 0);
        let q = Rng::new(7).normals(cfg.q_heads * 64);
        let mut out_before = vec![0f32; q.len()];
        cache.attend(0, 0, &q, 0.125, &mut out_before).unwrap();
        let r = 37 * w..41 * w;
        assert_eq!(
            cache.append(0, 0, &k[r.clone()], &v[r]),
            Err(Error::CacheFull {
                layer: 0,
                seq: 0,
                len: 37,
                capacity: 40,
                requested: 4
            }),
            "{name}"
        );
        assert_eq!(snapshot(&cache, 0, 0), before, "{name}: unchanged");
        let mut out = vec![0f32; q.len()];
        cache.attend(0, 0, &q, 0.125, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&out_before), "{name}: attention unchanged");
        // Exactly the room left still fits, then nothing more.
        cache
            .append(0, 0, &k[37 * w..40 * w], &v[37 * w..40 * w])
            .unwrap();
        let full = snapshot(&cache, 0, 0);
        assert_eq!(full.0, 40);
        assert!(matches!(
            cache.append(0, 0, &k[40 * w..], &v[40 * w..]),
            Err(Error::CacheFull {
                len: 40,
                requested: 1,
                ..
            })
        ));
        assert_eq!(snapshot(&cache, 0, 0), full, "{name}: unchanged when full");
    }
}

/// NaN, ±Inf and values beyond the f16 range are refused, naming the stream, token, head and
/// channel of the first one (keys are checked before values), and nothing is written.
#[test]
fn non_finite_inputs_are_named_and_write_nothing() {
    let cfg = config("kivi2", 3, 1, 64, 64);
    let mut cache = KvCache::new(cfg).unwrap();
    let (k, v) = kv(&mut Rng::new(8), &cfg, 40);
    let w = 3 * 64;
    cache.append(0, 0, &k[..35 * w], &v[..35 * w]).unwrap();
    let before = snapshot(&cache, 0, 0);
    for bad in [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65536.0,
        -1.0e6,
        f32::MAX,
    ] {
        for stream in [Stream::K, Stream::V] {
            let (mut k, mut v) = (k[35 * w..].to_vec(), v[35 * w..].to_vec());
            let (token, head, channel) = (2, 1, 17);
            let at = (token * 3 + head) * 64 + channel;
            let x = if stream == Stream::K { &mut k } else { &mut v };
            x[at] = bad;
            x[at + 9] = f32::NAN; // a later bad element is not the one named
            let e = cache.append(0, 0, &k, &v).unwrap_err();
            assert!(
                matches!(e, Error::NonFinite { stream: s, token: 2, head: 1, channel: 17, value }
                    if s == stream && (value.to_bits() == bad.to_bits())),
                "{bad} in {stream}: {e:?}"
            );
            assert!(e.to_string().contains(&stream.to_string()), "{e}");
            assert_eq!(
                snapshot(&cache, 0, 0),
                before,
                "{bad} in {stream}: nothing written"
            );
        }
    }
    // Keys are checked first: a bad value in both streams names the key.
    let (mut k2, mut v2) = (k[35 * w..].to_vec(), v[35 * w..].to_vec());
    k2[2 * w + 2 * 64 + 44] = f32::INFINITY;
    v2[5] = f32::NAN;
    assert!(matches!(
        cache.append(0, 0, &k2, &v2),
        Err(Error::NonFinite {
            stream: Stream::K,
            token: 2,
            head: 2,
            channel: 44,
            ..
        })
    ));
    // The f16 extremes themselves are accepted and stored exactly (here in the residual window).
    let (mut k3, mut v3) = (k[35 * w..36 * w].to_vec(), v[35 * w..36 * w].to_vec());
    k3[3] = 65504.0;
    k3[4] = -65504.0;
    v3[0] = 65504.0;
    cache.append(0, 0, &k3, &v3).unwrap();
    let (rk, _) = cache.read_back(0, 0).unwrap();
    assert_eq!(rk[35 * w + 3..35 * w + 5], [65504.0, -65504.0]);
}

/// Wrong shapes and out-of-range indices give the right typed error and write nothing.
#[test]
fn shape_and_range_errors() {
    let cfg = config("q8", 2, 2, 64, 16); // K/V width 128, query width 256
    let mut cache = KvCache::new(cfg).unwrap();
    let (k, v) = kv(&mut Rng::new(9), &cfg, 4);
    cache.append(0, 0, &k[..3 * 128], &v[..3 * 128]).unwrap();
    let before = snapshot(&cache, 0, 0);
    assert!(matches!(
        cache.append(0, 0, &k[..129], &v[..129]),
        Err(Error::Shape {
            expected: 256,
            got: 129,
            ..
        })
    ));
    assert!(matches!(
        cache.append(0, 0, &k[..128], &v[..127]),
        Err(Error::Shape {
            expected: 128,
            got: 127,
            ..
        })
    ));
    assert!(matches!(
        cache.append(0, 0, &[], &v[..128]),
        Err(Error::Shape {
            expected: 0,
            got: 128,
            ..
        })
    ));
    assert_eq!(snapshot(&cache, 0, 0), before);
    // Appending nothing is allowed and changes nothing.
    cache.append(0, 0, &[], &[]).unwrap();
    assert_eq!(snapshot(&cache, 0, 0), before);

    let q = vec![0.5f32; 4 * 256];
    let mut out = vec![0f32; 4 * 256];
    for (n, expected) in [(0, 256), (255, 256), (257, 256), (300, 256)] {
        assert!(
            matches!(
                cache.attend(0, 0, &q[..n], 1.0, &mut out[..n]),
                Err(Error::Shape { expected: e, got, .. }) if e == expected && got == n
            ),
            "q of {n}"
        );
    }
    assert!(matches!(
        cache.attend(0, 0, &q[..256], 1.0, &mut out[..255]),
        Err(Error::Shape {
            expected: 256,
            got: 255,
            ..
        })
    ));
    assert_eq!(
        cache.attend(0, 0, &q, 1.0, &mut out),
        Err(Error::QueryBeyondCache {
            layer: 0,
            seq: 0,
            q_len: 4,
            len: 3
        })
    );
    let mut bad_q = q[..512].to_vec();
    bad_q[256 + 3 * 64 + 5] = f32::NEG_INFINITY;
    assert!(matches!(
        cache.attend(0, 0, &bad_q, 1.0, &mut out[..512]),
        Err(Error::NonFiniteQuery {
            token: 1,
            head: 3,
            channel: 5,
            ..
        })
    ));
    assert!(matches!(
        cache.attend(0, 0, &q[..256], f32::NAN, &mut out[..256]),
        Err(Error::BadSoftmaxScale(_))
    ));

    let layer = Err(Error::OutOfRange {
        what: "layer",
        index: 1,
        limit: 1,
    });
    let seq = Err(Error::OutOfRange {
        what: "sequence",
        index: 1,
        limit: 1,
    });
    assert_eq!(cache.append(1, 0, &k[..128], &v[..128]), layer);
    assert_eq!(cache.append(0, 1, &k[..128], &v[..128]), seq);
    assert_eq!(cache.attend(1, 0, &q[..256], 1.0, &mut out[..256]), layer);
    assert_eq!(cache.attend(0, 1, &q[..256], 1.0, &mut out[..256]), seq);
    assert_eq!(cache.read_back(1, 0).map(|_| ()), layer);
    assert_eq!(cache.read_back(0, 1).map(|_| ()), seq);
    assert_eq!(cache.len(1, 0).map(|_| ()), layer);
    assert_eq!(cache.bytes_read(0, 1).map(|_| ()), seq);
    assert_eq!(cache.clear(1), seq);
    assert_eq!(snapshot(&cache, 0, 0), before);

    // Configurations the cache cannot hold.
    let bad = |f: &dyn Fn(&mut CacheConfig)| {
        let mut c = config("kivi2", 2, 2, 64, 16);
        f(&mut c);
        KvCache::new(c).map(|_| ())
    };
    for (what, r) in [
        ("head_dim 96", bad(&|c| c.head_dim = 96)),
        ("q_heads 3", bad(&|c| c.q_heads = 3)),
        ("layers 0", bad(&|c| c.layers = 0)),
        ("capacity 0", bad(&|c| c.capacity = 0)),
        ("pre_rope without RoPE", bad(&|c| c.scheme.pre_rope = true)),
    ] {
        assert!(matches!(r, Err(Error::Unsupported(_))), "{what}: {r:?}");
    }
}

/// `Scheme::memory` is exactly what the cache allocates, for every shape of scheme.
#[test]
fn memory_matches_allocation() {
    let mut schemes: Vec<String> = PRESETS.iter().map(|p| p.to_string()).collect();
    schemes.extend(
        [
            "kivi2,sinks=4",
            "kivi4,g=64",
            "kivi2,outliers",
            "q4_tok,outliers=kv,outlier_frac=0.05",
            "k=q2_chan,v=q4_chan,outliers=kv,outlier_slots=5,sinks=7",
            "q8_0,sinks=100",
            "k=f16,v=q2_chan",
            "k=q4_tok@head,v=q2_tok@64,g=64,sinks=1",
        ]
        .map(String::from),
    );
    for name in &schemes {
        for d in HEAD_DIMS {
            for capacity in [1, 7, 31, 32, 33, 100, 1000] {
                let cfg = CacheConfig {
                    layers: 2,
                    sequences: 3,
                    kv_heads: 2,
                    q_heads: 4,
                    ..config(name, 2, 2, d, capacity)
                };
                let cache = KvCache::new(cfg).unwrap();
                let m = cfg.scheme.memory(d, capacity);
                assert_eq!(
                    m.total() * 2 * 3 * 2,
                    cache.allocated_bytes(),
                    "{name} d={d} cap={capacity}"
                );
                assert_eq!(m.capacity, capacity);
                let sinks = cfg.scheme.sinks.min(capacity);
                assert_eq!(m.sink_bytes, 2 * sinks * 2 * d, "{name}");
                // Every position has its block row, the sinks' too (never read).
                let pages = capacity.div_ceil(cfg.scheme.group_tokens);
                assert_eq!(
                    m.page_bytes,
                    pages * cfg.scheme.head_layout(d).bytes,
                    "{name}"
                );
                let chan = [cfg.scheme.k, cfg.scheme.v]
                    .iter()
                    .filter(|f| f.is_grouped_by_tokens())
                    .count();
                let resid = if pages > 0 {
                    chan * cfg.scheme.group_tokens * 2 * d
                } else {
                    0
                };
                assert_eq!(m.residual_bytes, resid, "{name} d={d} cap={capacity}");
            }
        }
    }
}

/// `clear` returns a sequence's pages in every layer; the sequence refills to full capacity and
/// reads back exactly as in a fresh cache; other sequences are untouched.
#[test]
fn clear_returns_pages_and_the_sequence_refills() {
    for name in ["kivi2,sinks=2,outliers", "q4_tok", "k=q8,v=q2_chan,g=64"] {
        let cfg = CacheConfig {
            layers: 2,
            sequences: 2,
            ..config(name, 2, 1, 64, 70)
        };
        let mut rng = Rng::new(10);
        let data: Vec<(Vec<f32>, Vec<f32>)> = (0..3).map(|_| kv(&mut rng, &cfg, 70)).collect();
        let fresh = || {
            let mut c = KvCache::new(cfg).unwrap();
            if cfg.scheme.outliers.is_some() {
                for layer in 0..2 {
                    c.calibrate_outliers(layer, &data[0].0, &data[0].1, 0)
                        .unwrap();
                }
            }
            c
        };
        let mut cache = fresh();
        for layer in 0..2 {
            append_chunks(&mut cache, layer, 0, &data[0].0, &data[0].1, 11);
            append_chunks(&mut cache, layer, 1, &data[1].0, &data[1].1, 13);
        }
        let other: Vec<_> = (0..2).map(|l| snapshot(&cache, l, 1)).collect();
        cache.clear(0).unwrap();
        for (layer, other) in other.iter().enumerate() {
            assert_eq!(cache.len(layer, 0), Ok(0), "{name}");
            assert_eq!(cache.read_back(layer, 0).unwrap().0.len(), 0);
            assert_eq!(&snapshot(&cache, layer, 1), other, "{name}: other sequence");
        }
        // The pool holds exactly each sequence's pages: refilling needs every one back.
        let mut want = fresh();
        for (layer, other) in other.iter().enumerate() {
            append_chunks(&mut cache, layer, 0, &data[2].0, &data[2].1, 9);
            append_chunks(&mut want, layer, 0, &data[2].0, &data[2].1, 9);
            assert_eq!(
                snapshot(&cache, layer, 0),
                snapshot(&want, layer, 0),
                "{name} layer {layer}"
            );
            assert_eq!(&snapshot(&cache, layer, 1), other, "{name}: other sequence");
        }
        assert!(matches!(
            cache.append(0, 0, &data[2].0[..128], &data[2].1[..128]),
            Err(Error::CacheFull { .. })
        ));
    }
}

/// Appending one token at a time stores exactly what appending all at once does.
#[test]
fn token_by_token_equals_all_at_once() {
    for (name, rope) in [
        ("kivi2,sinks=3,outliers=kv", None),
        ("k=q4_tok@64,v=q4_tok@64", Some(RopeLayout::Interleaved)),
        ("kivi4,pre_rope,g=64", Some(RopeLayout::Halves)),
        ("q8_0", None),
        ("k=q2_tok@head,v=q8,outliers", Some(RopeLayout::Interleaved)),
    ] {
        let mut cfg = config(name, 2, 2, 128, 100);
        if let Some(layout) = rope {
            cfg = with_rope(cfg, layout);
        }
        let (k, v) = kv(&mut Rng::new(11), &cfg, 100);
        let make = |chunk: usize| {
            let mut c = KvCache::new(cfg).unwrap();
            if cfg.scheme.outliers.is_some() {
                c.calibrate_outliers(0, &k, &v, 0).unwrap();
            }
            append_chunks(&mut c, 0, 0, &k, &v, chunk);
            c
        };
        let (one, all) = (make(1), make(100));
        assert_eq!(snapshot(&one, 0, 0), snapshot(&all, 0, 0), "{name}");
        assert_eq!(one.outliers_dropped(), all.outliers_dropped(), "{name}");
        let q = Rng::new(12).normals(3 * cfg.q_heads * 128);
        let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        one.attend(0, 0, &q, 0.1, &mut a).unwrap();
        all.attend(0, 0, &q, 0.1, &mut b).unwrap();
        assert_eq!(bits(&a), bits(&b), "{name}: attention");
    }
}

/// With RoPE the cache rotates the f32 input keys to their position and then rounds to f16;
/// with `pre_rope` it stores the f16-rounded unrotated keys and rotates the stored value (in
/// f32) when reading. Values are never rotated.
#[test]
fn rope_rotates_keys_by_position() {
    for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
        for name in ["f16", "f16,pre_rope", "kivi2", "kivi2,pre_rope"] {
            let cfg = with_rope(config(name, 2, 1, 64, 50), layout);
            let mut cache = KvCache::new(cfg).unwrap();
            let (k, v) = kv(&mut Rng::new(13), &cfg, 45);
            append_chunks(&mut cache, 0, 0, &k, &v, 4);
            let table = RopeTable::new(cfg.rope.unwrap(), 64, 50);
            let mut want = k.clone();
            for (i, row) in want.chunks_exact_mut(64).enumerate() {
                if cfg.scheme.pre_rope {
                    row.copy_from_slice(&rounded(row));
                    table.rotate(row, i / 2);
                } else {
                    table.rotate(row, i / 2);
                    row.copy_from_slice(&rounded(row));
                }
            }
            let (rk, rv) = cache.read_back(0, 0).unwrap();
            // f16 keys everywhere; kivi2 keys in the open page (tokens 32..45).
            let from = if cfg.scheme.k == Format::F16 {
                0
            } else {
                32 * 128
            };
            assert_eq!(bits(&rk[from..]), bits(&want[from..]), "{name} {layout:?}");
            if cfg.scheme.v == Format::F16 {
                assert_eq!(bits(&rv), bits(&rounded(&v)), "{name}: values unrotated");
            }
            // Position 0 is the identity.
            if cfg.scheme.k == Format::F16 {
                assert_eq!(bits(&rk[..128]), bits(&rounded(&k[..128])), "{name}");
            }
        }
    }
}

/// Keys within the f16 range can leave it once rotated: (60000, 60000) at position 1 becomes
/// (60000·(cos 1 − sin 1), 60000·(sin 1 + cos 1)) ≈ (−18064, 82906). The cache must either
/// refuse such a token as `NonFinite` (writing nothing) or store something finite.
#[test]
fn rotated_keys_beyond_f16_are_refused_or_finite() {
    for name in ["f16", "q8", "q4_tok", "kivi2"] {
        let cfg = with_rope(config(name, 1, 1, 64, 8), RopeLayout::Interleaved);
        let mut cache = KvCache::new(cfg).unwrap();
        let zeros = vec![0f32; 64];
        let ones = vec![1f32; 64];
        cache.append(0, 0, &zeros, &ones).unwrap();
        let before = snapshot(&cache, 0, 0);
        let mut k = zeros.clone();
        k[0] = 60000.0;
        k[1] = 60000.0;
        match cache.append(0, 0, &k, &ones) {
            Err(Error::NonFinite {
                stream: Stream::K,
                token: 0,
                head: 0,
                ..
            }) => {
                assert_eq!(snapshot(&cache, 0, 0), before, "{name}: nothing written")
            }
            Err(e) => panic!("{name}: unexpected {e:?}"),
            Ok(()) => {
                let (rk, rv) = cache.read_back(0, 0).unwrap();
                assert!(
                    rk.iter().chain(&rv).all(|x| x.is_finite()),
                    "{name}: stored {:?}",
                    &rk[64..66]
                );
                let mut out = vec![0f32; 64];
                cache.attend(0, 0, &ones, 0.125, &mut out).unwrap();
                assert!(
                    out.iter().all(|x| x.is_finite()),
                    "{name}: attention {}",
                    out[0]
                );
            }
        }
    }
}

/// Thresholds with `lo > hi` (or NaN) would make `split_outliers`' `clamp` panic inside `append`,
/// after the sequence length was already bumped, so `set_outlier_thresholds` refuses them.
#[test]
fn inverted_outlier_thresholds_are_refused() {
    let mut cache = KvCache::new(config("q8,outliers", 1, 1, 64, 8)).unwrap();
    let th = |lo: f32, hi: f32| OutlierThresholds {
        heads: 1,
        head_dim: 64,
        lo: vec![lo; 64],
        hi: vec![hi; 64],
    };
    assert!(
        cache
            .set_outlier_thresholds(0, th(1.0, -1.0), None)
            .is_err(),
        "lo > hi"
    );
    assert!(
        cache
            .set_outlier_thresholds(0, th(f32::NAN, 1.0), None)
            .is_err(),
        "NaN"
    );
}

/// The bytes-per-token table of `docs/formats.md` is the code's `Scheme::bytes_per_token`, and
/// the worked layout and memory examples there are `Scheme::head_layout`'s and `Scheme::memory`'s.
#[test]
fn formats_doc_numbers_match_the_code() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/formats.md")).unwrap();
    let mut missing = Vec::new();
    let names = PRESETS
        .iter()
        .copied()
        .chain(["kivi4,outliers", "kivi2,outliers", "kivi2,g=64"])
        .chain(FRONTIER_PRESETS);
    for name in names {
        let s: Scheme = name.parse().unwrap();
        let cell = |d: usize| {
            let b = s.bytes_per_token(d);
            format!("{b} ({:.2})", b * 8.0 / (2 * d) as f64)
        };
        let line = format!(
            "| `{name}` | {} | {} | {} |",
            cell(64),
            cell(128),
            cell(256)
        );
        if !doc.contains(&line) {
            missing.push(line);
        }
    }
    let l = "kivi2,outliers".parse::<Scheme>().unwrap().head_layout(128);
    for (stream, sl) in [("K", l.k), ("V", l.v)] {
        let line = format!(
            "{stream}: rows {}, params {}, counts {}, slots {}, end {}",
            sl.rows, sl.params, sl.counts, sl.slots, sl.end
        );
        if !doc.contains(&line) {
            missing.push(line);
        }
    }
    let s: Scheme = "kivi2,sinks=4".parse().unwrap();
    let m = s.memory(128, 4096);
    let line = format!(
        "sinks {} + pages {} + residual {} + value window {} = {} bytes ({} per token)",
        m.sink_bytes,
        m.page_bytes,
        m.residual_bytes,
        m.window_bytes,
        m.total(),
        m.bytes_per_token()
    );
    if !doc.contains(&line) {
        missing.push(line);
    }
    assert!(
        missing.is_empty(),
        "docs/formats.md lacks these lines:\n{}",
        missing.join("\n")
    );
}

/// The attention error of `scheme` (2 KV heads, GQA 4, head_dim 128) against an f16 cache of
/// the same `n` random tokens (appended in chunks of `chunk`, from `seed`), for `q_tokens`
/// query tokens; it also checks that attention equals the naive attention over the cache's own
/// rows (rotated schemes rotate back on reads).
fn error_against_f16(scheme: &str, n: usize, chunk: usize, q_tokens: usize, seed: u64) -> f32 {
    let d = 128;
    let cfg = config(scheme, 2, 4, d, n);
    let mut cache = KvCache::new(cfg).unwrap();
    let mut rng = Rng::new(seed);
    fill(&mut cache, 0, n, chunk, &mut rng);
    let q = rng.normals(q_tokens * cfg.q_heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    let out = attend_as_reference(&cache, &q, scale, &format!("{scheme}: its own rows"));
    let exact = {
        let mut f16 = KvCache::new(config("f16", 2, 4, d, n)).unwrap();
        fill(&mut f16, 0, n, chunk, &mut Rng::new(seed));
        naive_attend(&f16, 0, &q, scale)
    };
    rel_err(&out, &exact)
}

/// `rot` stores rows rotated and rotates queries and outputs: on f16 storage attention is the
/// unrotated cache's up to f16 rounding of rotated rows, and with outlier channels in the keys it
/// lowers a per-token format's error, which is what it is for.
#[test]
fn rotation_is_transparent_and_helps_per_token_keys() {
    let err = |name: &str| error_against_f16(name, 96, 40, 3, 21);
    assert!(err("f16,rot") < 2e-3, "f16,rot: {}", err("f16,rot"));
    // Gaussian values gain nothing from rotation: the keys (two outlier channels) are the test.
    let (plain, rotated) = (err("k=q4_tok,v=f16"), err("k=q4_tok,v=f16,rot=k"));
    assert!(
        rotated < 0.7 * plain,
        "q4_tok keys: {plain}, rotated: {rotated}"
    );
}

/// A row within the f16 range can leave it once Walsh–Hadamard rotated (a constant row of
/// 20000 becomes one element of 20000·√64): refused as `NonFinite`, nothing written.
#[test]
fn hadamard_overflow_is_refused_and_writes_nothing() {
    for name in ["q4_tok,rot", "k=f16,v=q8,rot=v"] {
        let cfg = config(name, 1, 1, 64, 8);
        let mut cache = KvCache::new(cfg).unwrap();
        cache.append(0, 0, &[0.5; 64], &[0.25; 64]).unwrap();
        let before = snapshot(&cache, 0, 0);
        let big = vec![20000f32; 64];
        let (k, v) = if name.starts_with("k=") {
            (vec![1f32; 64], big)
        } else {
            (big, vec![1f32; 64])
        };
        let e = cache.append(0, 0, &k, &v).unwrap_err();
        assert!(matches!(e, Error::NonFinite { .. }), "{name}: {e}");
        assert_eq!(snapshot(&cache, 0, 0), before, "{name}");
    }
}

/// Non-uniform levels of each width, exact in f32.
fn test_book(bits: LowBits) -> Codebook {
    let levels: Vec<f32> = match bits {
        LowBits::Two => vec![0.25, 1.125, 1.875, 2.75],
        LowBits::Four => (0..16)
            .map(|i: i32| {
                let z = (i - 8) as f32;
                (7.5 + z * z.abs() / 8.5 + 0.5 * z.signum()).clamp(0.0, 15.0)
            })
            .collect(),
    };
    Codebook::new(bits, &levels).unwrap()
}

fn test_books(scheme: &Scheme) -> [Option<Codebook>; 2] {
    [Stream::K, Stream::V].map(|s| {
        scheme
            .low_bits(s)
            .filter(|_| scheme.nuq.applies(s))
            .map(test_book)
    })
}

/// With codebooks, `read_back` equals the reference quantizers with the same codebooks, bit for
/// bit, and attention equals the naive attention over those rows.
#[test]
fn codebooks_read_back_and_attend_as_the_reference() {
    let mut rng = Rng::new(31);
    for (i, name) in [
        "kivi2,nuq",
        "kivi4,g=64,nuq=k",
        "q2_tok,nuq=v",
        "k=q4_tok@64,v=q2_chan,nuq",
        "k=q2_chan,v=q4_tok,sinks=3,rv=64,nuq,pre_rope",
    ]
    .into_iter()
    .enumerate()
    {
        for d in HEAD_DIMS {
            let mut cfg = config(name, 2, 3, d, 150);
            if cfg.scheme.pre_rope || i % 2 == 1 {
                cfg = with_rope(cfg, RopeLayout::Halves);
            }
            let mut cache = KvCache::new(cfg).unwrap();
            let [kb, vb] = test_books(&cfg.scheme);
            cache.set_codebooks(0, kb.clone(), vb.clone()).unwrap();
            let (k, v) = kv(&mut rng, &cfg, 150);
            append_chunks(&mut cache, 0, 0, &k, &v, 37);
            let what = format!("{} d={d}", cfg.scheme);
            assert_matches_model_with(
                &cache,
                &k,
                &v,
                [None, None],
                [kb.as_ref(), vb.as_ref()],
                &what,
            );
            let q = rng.normals(2 * cfg.q_heads * d);
            attend_as_reference(&cache, &q, 1.0 / (d as f32).sqrt(), &what);
        }
    }
}

/// Uniform codebooks store exactly the plain format's bytes and attend to the same outputs.
#[test]
fn uniform_codebooks_are_the_plain_formats() {
    for name in ["kivi2", "kivi4", "k=q4_tok@64,v=q2_tok,rv=32"] {
        let d = 128;
        let mut plain = config(name, 2, 2, d, 100);
        // Codebook keys decode to levels, so `iq` (the `kivi*` presets' default) cannot score
        // them: both score exactly.
        plain.scheme.int_query = false;
        let mut nuq = plain;
        nuq.scheme.nuq = StreamSet::Both;
        let outputs = |cfg: CacheConfig| {
            let mut cache = KvCache::new(cfg).unwrap();
            if cfg.scheme.nuq == StreamSet::Both {
                let book = |s| cfg.scheme.low_bits(s).map(Codebook::uniform);
                cache
                    .set_codebooks(0, book(Stream::K), book(Stream::V))
                    .unwrap();
            }
            let mut rng = Rng::new(5);
            let (k, v) = kv(&mut rng, &cfg, 100);
            append_chunks(&mut cache, 0, 0, &k, &v, 33);
            let q = rng.normals(cfg.q_heads * d);
            let mut out = vec![0f32; q.len()];
            cache.attend(0, 0, &q, 0.1, &mut out).unwrap();
            (snapshot(&cache, 0, 0), bits(&out))
        };
        assert_eq!(outputs(plain), outputs(nuq), "{name}");
    }
}

/// Calibrated codebooks cut the attention error of 2-bit values (rotated: near-Gaussian rows).
/// On i.i.d. Gaussian rows the gain is small (9% with seeds 3 and 8, over 10% with 1 and 2); on
/// SmolLM2's values, 28% of the KL (docs/accuracy.md).
#[test]
fn calibrated_codebooks_help_two_bit_values() {
    let err = |name: &str| error_against_f16(name, 256, 64, 4, 8);
    let plain = err("k=f16,v=q2_tok@64,rot=v");
    let nuq = err("k=f16,v=q2_tok@64,rot=v,nuq=v");
    assert!(
        nuq < 0.95 * plain,
        "q2 values: {plain}, with codebooks: {nuq}"
    );
}

#[test]
fn codebook_errors_are_typed_and_write_nothing() {
    let cfg = config("kivi2,nuq=v", 1, 1, 64, 64);
    let mut cache = KvCache::new(cfg).unwrap();
    let (k, v) = kv(&mut Rng::new(2), &cfg, 8);
    assert_eq!(
        cache.append(0, 0, &k, &v),
        Err(Error::CodebooksNotCalibrated { layer: 0 })
    );
    assert_eq!(cache.len(0, 0).unwrap(), 0);
    let two = Some(Codebook::uniform(LowBits::Two));
    let four = Some(Codebook::uniform(LowBits::Four));
    for (kb, vb) in [
        (None, four.clone()),
        (two.clone(), two.clone()),
        (None, None),
    ] {
        assert!(
            matches!(cache.set_codebooks(0, kb, vb), Err(Error::Unsupported(_))),
            "refused"
        );
    }
    assert!(matches!(
        cache.set_codebooks(1, None, two.clone()),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        cache.calibrate_codebooks(1, &k, &v, 0),
        Err(Error::OutOfRange { .. })
    ));
    let mut bad = v.clone();
    bad[3] = f32::NAN;
    assert!(matches!(
        cache.calibrate_codebooks(0, &k, &bad, 0),
        Err(Error::NonFinite { .. })
    ));
    cache.set_codebooks(0, None, two).unwrap();
    cache.append(0, 0, &k, &v).unwrap();
    assert_eq!(cache.len(0, 0).unwrap(), 8);
    let mut plain = KvCache::new(config("kivi2", 1, 1, 64, 64)).unwrap();
    assert!(matches!(
        plain.calibrate_codebooks(0, &k, &v, 0),
        Err(Error::Unsupported(_))
    ));
    // The device backends decode codebooks too (tests/kernels.rs): the cache moves with them.
    cache.set_backend(Backend::Emu).unwrap();
    cache.append(0, 0, &k, &v).unwrap();
    assert_eq!(cache.len(0, 0).unwrap(), 16);
}

/// A cache's calibration, through its file text, makes another cache of the same scheme store
/// the same bytes; a calibration of another scheme, shape or with a layer missing an item is
/// refused before anything is set.
#[test]
fn calibrations_carry_over_through_their_text() {
    let name = "kivi2,outliers=kv,nuq";
    let cfg = CacheConfig {
        layers: 2,
        ..config(name, 2, 2, 64, 96)
    };
    let mut rng = Rng::new(12);
    let (k, v) = kv(&mut rng, &cfg, 96);
    let mut first = KvCache::new(cfg).unwrap();
    for layer in 0..2 {
        first.calibrate(layer, &k, &v, 0).unwrap();
    }
    let text = first.calibration().to_text();
    let parsed = Calibration::parse(&text).unwrap();
    assert_eq!(parsed, first.calibration());
    let mut second = KvCache::new(cfg).unwrap();
    second.apply_calibration(&parsed).unwrap();
    for cache in [&mut first, &mut second] {
        append_chunks(cache, 1, 0, &k, &v, 40);
    }
    assert_eq!(snapshot(&first, 1, 0), snapshot(&second, 1, 0));

    let mut other = KvCache::new(cfg).unwrap();
    let mut wrong = parsed.clone();
    wrong.scheme = "kivi2,outliers=kv".parse().unwrap();
    assert!(matches!(
        other.apply_calibration(&wrong),
        Err(Error::CalibrationMismatch { what: "scheme", .. })
    ));
    let mut wrong = parsed.clone();
    wrong.layers.pop();
    assert!(matches!(
        other.apply_calibration(&wrong),
        Err(Error::CalibrationMismatch { what: "shape", .. })
    ));
    let mut wrong = parsed.clone();
    wrong.layers[1].codebooks = None;
    assert_eq!(
        other.apply_calibration(&wrong),
        Err(Error::CalibrationIncomplete {
            layer: 1,
            scheme: name.into()
        })
    );
    let mut wrong = parsed.clone();
    wrong.layers[1].outliers.as_mut().unwrap().0.lo.pop();
    assert!(matches!(
        other.apply_calibration(&wrong),
        Err(Error::Shape { .. })
    ));
    // A codebook of the wrong width (4-bit levels for 2-bit codes) in the last layer: refused
    // before layer 0's items are set, as the setters alone would refuse it.
    let mut wrong = parsed.clone();
    let four_bit = Codebook::new(
        LowBits::Four,
        &(0..16).map(|i| i as f32).collect::<Vec<_>>(),
    );
    wrong.layers[1].codebooks.as_mut().unwrap().0 = Some(four_bit.unwrap());
    assert_eq!(
        other.apply_calibration(&wrong),
        Err(Error::CalibrationIncomplete {
            layer: 1,
            scheme: name.into()
        })
    );
    // Nothing was set: layer 0 still has neither thresholds nor codebooks.
    assert_eq!(
        other.append(0, 0, &k[..128], &v[..128]),
        Err(Error::OutliersNotCalibrated { layer: 0 })
    );
    assert_eq!(other.calibration().layers[0], Default::default());
}
