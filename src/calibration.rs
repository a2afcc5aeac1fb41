//! Calibration files: what a cache learned from sample activations (outlier thresholds and
//! codebooks, per layer), written by `hipkv calibrate` and loaded into a cache of the same
//! scheme (up to `iq`, which changes nothing stored) and shape, so that a model is calibrated
//! once, on text of one's choosing, and every cache of it reuses that.
//!
//! The format is text, one item per line, floats in Rust's shortest round-trip notation (so a
//! file reads back bit for bit):
//!
//! ```text
//! hipkv-calibration 1
//! scheme kivi2,nuq
//! shape layers=30 kv_heads=3 head_dim=64
//! layer 0 k_levels 0.29 1.07 1.93 2.71
//! layer 0 v_levels …
//! layer 0 k_lo …            (kv_heads × head_dim outlier thresholds, with `outliers`)
//! layer 0 k_hi …
//! ```
//!
//! A layer has a line for each item its scheme needs (`v_lo`/`v_hi` with `outliers=kv`) and no
//! other; [`Calibration::check_fits`] checks that, before
//! [`KvCache::apply_calibration`](crate::KvCache::apply_calibration) or
//! [`PagedCache::apply_calibration`](crate::paged::PagedCache::apply_calibration) sets anything.

use std::fmt::Write as _;

use crate::error::{Error, Result};
use crate::quant::{Codebook, OutlierThresholds};
use crate::scheme::{Scheme, Stream, StreamSet};

/// The first line of every calibration file, with its version.
const MAGIC: &str = "hipkv-calibration 1";

/// What one layer was calibrated to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerCalibration {
    /// Key thresholds, and value thresholds with `outliers=kv`.
    pub outliers: Option<(OutlierThresholds, Option<OutlierThresholds>)>,
    /// The codebooks of the `nuq` streams (keys, values).
    pub codebooks: Option<(Option<Codebook>, Option<Codebook>)>,
}

/// The calibration of every layer of a cache.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub scheme: Scheme,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layers: Vec<LayerCalibration>,
}

impl Calibration {
    /// The file's text.
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "{MAGIC}\nscheme {}\nshape layers={} kv_heads={} head_dim={}\n",
            self.scheme,
            self.layers.len(),
            self.kv_heads,
            self.head_dim
        );
        let mut line = |layer: usize, name: &str, values: &[f32]| {
            let _ = write!(out, "layer {layer} {name}");
            for v in values {
                let _ = write!(out, " {v}");
            }
            out.push('\n');
        };
        for (l, layer) in self.layers.iter().enumerate() {
            if let Some((k, v)) = &layer.codebooks {
                for (name, book) in [("k_levels", k), ("v_levels", v)] {
                    if let Some(b) = book {
                        line(l, name, b.levels());
                    }
                }
            }
            if let Some((k, v)) = &layer.outliers {
                for (prefix, t) in [("k", Some(k)), ("v", v.as_ref())] {
                    if let Some(t) = t {
                        line(l, &format!("{prefix}_lo"), &t.lo);
                        line(l, &format!("{prefix}_hi"), &t.hi);
                    }
                }
            }
        }
        out
    }

    /// Checks that this calibration is for `scheme` ([`Scheme::stores_like`]: `iq` or not) and
    /// the shape of a cache (`layers` × `kv_heads` × `head_dim`), that every layer has exactly
    /// the items the scheme needs (codebooks of its streams' code widths), and that its
    /// thresholds are valid: what a cache checks before setting any of it.
    pub fn check_fits(
        &self,
        scheme: Scheme,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let mismatch = |what, file: String, cache: String| {
            Err(Error::CalibrationMismatch { what, file, cache })
        };
        if !self.scheme.stores_like(&scheme) {
            return mismatch("scheme", self.scheme.to_string(), scheme.to_string());
        }
        let shape = |layers, heads, d| format!("{layers} layers × {heads} KV heads × head_dim {d}");
        if (self.layers.len(), self.kv_heads, self.head_dim) != (layers, kv_heads, head_dim) {
            return mismatch(
                "shape",
                shape(self.layers.len(), self.kv_heads, self.head_dim),
                shape(layers, kv_heads, head_dim),
            );
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let outliers_fit = match (&layer.outliers, scheme.outliers) {
                (Some((_, v)), Some(o)) => v.is_some() == o.values,
                (None, None) => true,
                _ => false,
            };
            let book_fits = |stream, book: &Option<Codebook>| {
                book.as_ref().map(Codebook::bits) == scheme.codebook_bits(stream)
            };
            let books_fit = match &layer.codebooks {
                Some((k, v)) => book_fits(Stream::K, k) && book_fits(Stream::V, v),
                None => scheme.nuq == StreamSet::None,
            };
            if !(outliers_fit && books_fit) {
                return Err(Error::CalibrationIncomplete {
                    layer: l,
                    scheme: scheme.to_string(),
                });
            }
            if let Some((k, v)) = &layer.outliers {
                for t in std::iter::once(k).chain(v) {
                    t.validate(kv_heads, head_dim)?;
                }
            }
        }
        Ok(())
    }

    /// Parses a file's text. Every item is checked as it would be when set: codebooks by
    /// [`Codebook::new`], thresholds by [`OutlierThresholds::validate`].
    pub fn parse(text: &str) -> Result<Calibration> {
        let bad = |line: usize, problem: &'static str| Error::BadCalibration { line, problem };
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
        if lines.next().map(|(_, l)| l) != Some(MAGIC) {
            return Err(bad(1, "not a hipkv calibration file of version 1"));
        }
        let (n, scheme) = lines.next().ok_or(bad(2, "no scheme line"))?;
        let scheme: Scheme = scheme
            .strip_prefix("scheme ")
            .ok_or(bad(n, "expected `scheme …`"))?
            .parse()
            .map_err(|_| bad(n, "the scheme does not parse"))?;
        let (n, shape) = lines.next().ok_or(bad(3, "no shape line"))?;
        let mut fields = shape
            .strip_prefix("shape ")
            .ok_or(bad(n, "expected `shape layers=… kv_heads=… head_dim=…`"))?
            .split_whitespace();
        let mut field = |key: &str| -> Result<usize> {
            fields
                .next()
                .and_then(|f| f.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .ok_or(bad(n, "expected `shape layers=… kv_heads=… head_dim=…`"))
        };
        let (layers, kv_heads, head_dim) =
            (field("layers")?, field("kv_heads")?, field("head_dim")?);
        let mut out = Calibration {
            scheme,
            kv_heads,
            head_dim,
            layers: vec![LayerCalibration::default(); layers],
        };
        // Thresholds arrive as lo then hi lines; the lo half waits here.
        let mut pending_lo: Option<(usize, Stream, Vec<f32>)> = None;
        for (n, line) in lines.filter(|(_, l)| !l.is_empty()) {
            let mut words = line.split_whitespace();
            let (Some("layer"), Some(layer), Some(name)) =
                (words.next(), words.next(), words.next())
            else {
                return Err(bad(n, "expected `layer N name values…`"));
            };
            let layer: usize = layer.parse().map_err(|_| bad(n, "a layer number"))?;
            let entry = out
                .layers
                .get_mut(layer)
                .ok_or(bad(n, "a layer beyond the shape's layers"))?;
            let values = words
                .map(str::parse::<f32>)
                .collect::<std::result::Result<Vec<f32>, _>>()
                .map_err(|_| bad(n, "a value that is not a number"))?;
            let stream = if name.starts_with('k') {
                Stream::K
            } else {
                Stream::V
            };
            match name {
                "k_levels" | "v_levels" => {
                    let bits = scheme
                        .codebook_bits(stream)
                        .ok_or(bad(n, "a codebook for a stream the scheme has none for"))?;
                    let book =
                        Codebook::new(bits, &values).map_err(|_| bad(n, "a bad codebook"))?;
                    let books = entry.codebooks.get_or_insert((None, None));
                    let slot = if stream == Stream::K {
                        &mut books.0
                    } else {
                        &mut books.1
                    };
                    if slot.replace(book).is_some() {
                        return Err(bad(n, "a codebook given twice"));
                    }
                }
                "k_lo" | "v_lo" => {
                    if pending_lo.replace((layer, stream, values)).is_some() {
                        return Err(bad(n, "a `_lo` line not followed by its `_hi` line"));
                    }
                }
                "k_hi" | "v_hi" => {
                    let Some((lo_layer, lo_stream, lo)) = pending_lo.take() else {
                        return Err(bad(n, "a `_hi` line without its `_lo` line before it"));
                    };
                    if (lo_layer, lo_stream) != (layer, stream) {
                        return Err(bad(n, "a `_hi` line not matching the `_lo` line before it"));
                    }
                    let t = OutlierThresholds {
                        heads: kv_heads,
                        head_dim,
                        lo,
                        hi: values,
                    };
                    t.validate(kv_heads, head_dim)
                        .map_err(|_| bad(n, "thresholds of the wrong size or not a range"))?;
                    match (stream, &mut entry.outliers) {
                        (Stream::K, o @ None) => *o = Some((t, None)),
                        (Stream::V, Some((_, v @ None))) => *v = Some(t),
                        _ => return Err(bad(n, "thresholds out of order (k before v) or twice")),
                    }
                }
                _ => return Err(bad(n, "an unknown item")),
            }
        }
        if pending_lo.is_some() {
            return Err(bad(
                text.lines().count(),
                "a `_lo` line without its `_hi` line",
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheme::LowBits;

    fn sample() -> Calibration {
        let t = |base: f32| OutlierThresholds {
            heads: 2,
            head_dim: 64,
            lo: (0..128).map(|i| base - i as f32 * 0.1).collect(),
            hi: (0..128).map(|i| base + 1.0 / (i + 1) as f32).collect(),
        };
        let book = Codebook::new(LowBits::Two, &[0.3, 1.1, 1.9, 2.7]).unwrap();
        let layer = |i: usize| LayerCalibration {
            outliers: Some((t(i as f32), Some(t(-(i as f32))))),
            codebooks: Some((None, Some(book.clone()))),
        };
        Calibration {
            scheme: "k=q8,v=q2_tok,outliers=kv,nuq=v".parse().unwrap(),
            kv_heads: 2,
            head_dim: 64,
            layers: (0..3).map(layer).collect(),
        }
    }

    #[test]
    fn text_round_trips_bit_for_bit() {
        let c = sample();
        let text = c.to_text();
        assert!(text.starts_with("hipkv-calibration 1\nscheme k=q8,v=q2_tok,outliers=kv,nuq=v\n"));
        assert_eq!(Calibration::parse(&text).unwrap(), c);
    }

    #[test]
    fn a_calibration_fits_its_scheme_with_or_without_iq() {
        let c = sample();
        let with_iq = Scheme {
            int_query: true,
            ..c.scheme
        };
        for scheme in [c.scheme, with_iq] {
            assert!(c.check_fits(scheme, 3, 2, 64).is_ok(), "{scheme}");
        }
        let keys_only: Scheme = "k=q8,v=q2_tok,outliers,nuq=v".parse().unwrap();
        assert!(matches!(
            c.check_fits(keys_only, 3, 2, 64),
            Err(Error::CalibrationMismatch { what: "scheme", .. })
        ));
    }

    #[test]
    fn bad_files_name_the_line() {
        let text = sample().to_text();
        let lines: Vec<&str> = text.lines().collect();
        let edit = |i: usize, new: &str| {
            let mut l = lines.clone();
            l[i] = new;
            l.join("\n")
        };
        for (bad, line) in [
            (edit(0, "hipkv-calibration 2"), 1),
            (edit(1, "scheme q9"), 2),
            (edit(2, "shape layers=3 kv_heads=2"), 3),
            (edit(3, "layer 7 v_levels 0 1 2 3"), 4),
            (edit(3, "layer 0 k_levels 0 1 2 3"), 4),
            (edit(3, "layer 0 v_levels 0 2 1 3"), 4),
            (edit(3, "layer 0 v_levels 0 1 x 3"), 4),
            (edit(3, "layer 0 w_levels 0 1 2 3"), 4),
            (edit(5, "layer 0 k_hi 1 2"), 6),
            (edit(5, "layer 0 k_lo 1 2"), 6),
        ] {
            match Calibration::parse(&bad) {
                Err(Error::BadCalibration { line: l, .. }) => assert_eq!(l, line, "{bad}"),
                other => panic!("{other:?} for line {line}"),
            }
        }
    }
}
