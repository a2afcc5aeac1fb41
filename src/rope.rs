//! Rotary position embedding, applied by the cache to keys (at append, or inside attention for
//! `pre_rope` schemes) and to queries.

/// How a head's channels are paired for rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i+1)`, as llama.cpp's GGUF Llama conversion stores Q and K.
    Interleaved,
    /// Pairs `(i, i + d/2)`, as Hugging Face Llama does.
    Halves,
}

/// RoPE parameters of a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub base: f32,
    pub layout: RopeLayout,
}

/// `cos`/`sin` for every position below a capacity and every channel pair, computed in f64.
#[derive(Clone, Debug)]
pub struct RopeTable {
    layout: RopeLayout,
    pairs: usize,
    /// `[position][pair] -> [cos, sin]`.
    cos_sin: Vec<[f32; 2]>,
}

impl RopeTable {
    /// The pair layout the table rotates.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// `[position][pair][cos, sin]` as plain floats, the device ABI's `rope_cos_sin`.
    pub(crate) fn flat(&self) -> Vec<f32> {
        self.cos_sin.as_flattened().to_vec()
    }

    /// Position `position`'s `[pair][cos, sin]`: `head_dim` floats.
    pub(crate) fn row(&self, position: usize) -> &[f32] {
        self.pairs_at(position).as_flattened()
    }

    /// Positions `first .. first + n`'s rows, one after the other: `n × head_dim` floats.
    pub(crate) fn rows(&self, first: usize, n: usize) -> &[f32] {
        self.cos_sin[first * self.pairs..(first + n) * self.pairs].as_flattened()
    }

    fn pairs_at(&self, position: usize) -> &[[f32; 2]] {
        &self.cos_sin[position * self.pairs..(position + 1) * self.pairs]
    }

    pub fn new(rope: Rope, head_dim: usize, positions: usize) -> RopeTable {
        let pairs = head_dim / 2;
        let inv_freq: Vec<f64> = (0..pairs)
            .map(|i| f64::from(rope.base).powf(-2.0 * i as f64 / head_dim as f64))
            .collect();
        let cos_sin = (0..positions)
            .flat_map(|p| {
                inv_freq.iter().map(move |f| {
                    let (s, c) = (p as f64 * f).sin_cos();
                    [c as f32, s as f32]
                })
            })
            .collect();
        RopeTable {
            layout: rope.layout,
            pairs,
            cos_sin,
        }
    }

    /// Rotates one head vector `x` (`head_dim` values) to `position`.
    #[inline(always)]
    pub fn rotate(&self, x: &mut [f32], position: usize) {
        let cs = self.pairs_at(position);
        match self.layout {
            RopeLayout::Interleaved => {
                for (pair, &[c, s]) in x.chunks_exact_mut(2).zip(cs) {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * c - b * s;
                    pair[1] = a * s + b * c;
                }
            }
            RopeLayout::Halves => {
                let (lo, hi) = x.split_at_mut(self.pairs);
                for ((a, b), &[c, s]) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                    let (x0, x1) = (*a, *b);
                    *a = x0 * c - x1 * s;
                    *b = x0 * s + x1 * c;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_relative_position() {
        for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
            let table = RopeTable::new(
                Rope {
                    base: 10000.0,
                    layout,
                },
                8,
                16,
            );
            let q0: Vec<f32> = (0..8).map(|i| i as f32 * 0.3 - 1.0).collect();
            let k0: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).sin()).collect();
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
            let at = |v: &[f32], p| {
                let mut v = v.to_vec();
                table.rotate(&mut v, p);
                v
            };
            assert!((dot(&at(&q0, 5), &at(&q0, 5)) - dot(&q0, &q0)).abs() < 1e-5);
            // q·k depends only on the distance between positions.
            let d1 = dot(&at(&q0, 9), &at(&k0, 4));
            let d2 = dot(&at(&q0, 12), &at(&k0, 7));
            assert!((d1 - d2).abs() < 1e-5, "{d1} vs {d2}");
            assert_eq!(at(&q0, 0), q0);
        }
    }

    #[test]
    fn layouts_pair_different_channels() {
        let rope = |layout| Rope {
            base: 10000.0,
            layout,
        };
        let mut a = vec![1.0, 0.0, 0.0, 0.0];
        let mut b = a.clone();
        RopeTable::new(rope(RopeLayout::Interleaved), 4, 2).rotate(&mut a, 1);
        RopeTable::new(rope(RopeLayout::Halves), 4, 2).rotate(&mut b, 1);
        assert!(a[1] > 0.8 && a[2] == 0.0);
        assert!(b[2] > 0.8 && b[1] == 0.0);
    }
}
