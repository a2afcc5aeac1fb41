//! The paged API as a server drives it: varlen batches mixing decodes and prefill chunks in
//! every dtype, blocks handed out by the server in any order, copy-on-write forks, and bad
//! indices that come back as typed errors without touching other sequences. On the CPU and the
//! emulated device (the HIP kernels' own code) everywhere, and on a GPU where one is usable.
//! Each output is compared with a naive f64 attention over that sequence's stored tokens.

mod common;

use common::rig::{Rig, Server, step, step_windowed};
use common::{assert_rows_close, naive_chunk};
use hipkv::backend::HipStatus;
use hipkv::hip::{StreamHandle, traffic};
use hipkv::paged::{DType, Layout, LayoutSpec, Workspace};
use hipkv::synth::Rng;
use hipkv::{Backend, Error, Rope, RopeLayout};

fn backends() -> Vec<Backend> {
    let mut b = vec![Backend::Cpu, Backend::Emu];
    if HipStatus::probe().obstacle().is_none() {
        b.push(Backend::Hip);
    }
    b
}

fn layout(scheme: &str, gqa: usize, head_dim: usize) -> Layout {
    Layout::new(LayoutSpec {
        scheme: scheme.parse().unwrap(),
        kv_heads: 2,
        q_heads: 2 * gqa,
        head_dim,
        num_blocks: 48,
        max_seqs: 6,
        max_positions: 512,
        rope: Some(Rope {
            base: 10000.0,
            layout: RopeLayout::Interleaved,
        }),
    })
    .unwrap()
}

#[test]
fn mixed_batches_of_decodes_and_prefill_chunks_match_the_reference() {
    let cases = [
        ("q8", 4, 64, DType::F32),
        ("kivi2,iq=0", 4, 64, DType::F16),
        ("k=q4_tok,v=q8_0", 8, 128, DType::BF16),
        ("f16", 1, 64, DType::F32),
        ("kivi4,g=64,rv=64", 2, 256, DType::F16),
        ("q2_tok,pre_rope,sinks=2", 4, 64, DType::F32),
        ("kivi2,rv=32,sinks=3", 2, 64, DType::F32),
        ("kivi2,rv=0,iq=0", 4, 64, DType::BF16),
        ("kivi4,g=64", 4, 128, DType::F32),
        ("kivi2,sinks=0", 2, 64, DType::F16),
        ("k=q4_tok@64,v=q4_tok@64,rot", 2, 128, DType::F16),
        (
            "k=q4_chan,v=q2_tok,rv=64,sinks=3,pre_rope,rot=v",
            4,
            64,
            DType::F32,
        ),
        ("k=q2_tok,v=q8,sinks=2,rot=k", 2, 256, DType::BF16),
        // The preset scores keys from the int8 query (`iq`); the reference rounds it too.
        ("q2_tok", 8, 128, DType::F16),
    ];
    for backend in backends() {
        for (scheme, gqa, d, dtype) in cases {
            let what = format!("{backend:?} {scheme} gqa {gqa} d {d} {dtype:?}");
            let layout = layout(scheme, gqa, d);
            let rig = Rig::new(layout, 1, backend, 128);
            let mut rng = Rng::new(7);
            let mut server = Server::new(&layout, &mut rng);
            for slot in [3, 0, 5] {
                server.seqs.push((slot, Vec::new(), 0));
            }
            // Two prefill chunks, then decodes of both beside a third sequence's prefill,
            // then chunks that cross and complete blocks.
            step(
                &rig,
                &mut server,
                &mut rng,
                &[(0, 40), (1, 70)],
                dtype,
                &what,
            );
            step(
                &rig,
                &mut server,
                &mut rng,
                &[(0, 1), (2, 33), (1, 1)],
                dtype,
                &what,
            );
            step(
                &rig,
                &mut server,
                &mut rng,
                &[(2, 31), (0, 23), (1, 1)],
                dtype,
                &what,
            );
        }
    }
}

/// Sliding windows (1 token, shorter than a block, several blocks) over decodes and prefill
/// chunks that start and end inside blocks: each output matches the reference within its
/// window, and the blocks wholly below the windows are not read (freed ids give the same bits).
#[test]
fn sliding_windows_match_the_reference_and_leave_the_blocks_below_unread() {
    let cases = [
        ("q8", 4, 64, DType::F32),
        ("kivi2,iq=0", 4, 64, DType::F16),
        ("kivi4,g=64,rv=64", 2, 128, DType::F32),
        ("kivi2", 4, 64, DType::F32),
        (
            "k=q4_chan,v=q2_tok,rv=64,sinks=3,pre_rope,rot=v",
            8,
            64,
            DType::BF16,
        ),
        ("q8_0,sinks=2", 1, 256, DType::F32),
    ];
    for backend in backends() {
        for (scheme, gqa, d, dtype) in cases {
            for window in [1, 29, 100] {
                let what = format!("{backend:?} {scheme} gqa {gqa} d {d} window {window}");
                let layout = layout(scheme, gqa, d);
                let rig = Rig::new(layout, 1, backend, 128);
                let mut rng = Rng::new(window as u64);
                let mut server = Server::new(&layout, &mut rng);
                for slot in [3, 0] {
                    server.seqs.push((slot, Vec::new(), 0));
                }
                let w = Some(window);
                for chunks in [[(0, 40), (1, 80)], [(0, 77), (1, 1)], [(1, 45), (0, 1)]] {
                    step_windowed(&rig, &mut server, &mut rng, &chunks, dtype, w, &what);
                }
            }
        }
    }
}

/// A forked sequence shares its parent's full blocks, gets a copy of the partial one
/// (`copy_blocks`) and of the slot state (`fork`); both then go their own ways.
#[test]
fn forks_share_full_blocks_and_copy_the_partial_one() {
    for backend in backends() {
        for scheme in ["kivi2,sinks=2", "q4_tok"] {
            let what = format!("{backend:?} {scheme}");
            let layout = layout(scheme, 4, 64);
            let rig = Rig::new(layout, 1, backend, 64);
            let mut rng = Rng::new(11);
            let mut server = Server::new(&layout, &mut rng);
            server.seqs.push((1, Vec::new(), 0));
            step(&rig, &mut server, &mut rng, &[(0, 45)], DType::F32, &what);
            // Fork: full block shared, partial block copied.
            let (_, blocks, len) = server.seqs[0].clone();
            let copy = server.free.pop().unwrap();
            let pairs = rig.upload(&[&[blocks[1].to_le_bytes(), copy.to_le_bytes()].concat()]);
            // SAFETY: the rig's cache and one uploaded pair, alive over the call.
            unsafe {
                rig.paged
                    .copy_blocks(
                        rig.caches[0].addr(),
                        pairs.addr(0),
                        1,
                        StreamHandle::DEFAULT,
                    )
                    .unwrap()
            };
            rig.paged.fork(1, 4, StreamHandle::DEFAULT).unwrap();
            rig.paged.check(StreamHandle::DEFAULT).unwrap();
            server.seqs.push((4, vec![blocks[0], copy], len));
            step(
                &rig,
                &mut server,
                &mut rng,
                &[(0, 20), (1, 20)],
                DType::F32,
                &what,
            );
            step(
                &rig,
                &mut server,
                &mut rng,
                &[(1, 1), (0, 1)],
                DType::F32,
                &what,
            );
        }
    }
}

/// Bad indices from a server: each skips only its own token or sequence and comes back from
/// `check` as a typed error naming the call, the item and the index; the rest of the batch is
/// served as if it were alone.
#[test]
fn bad_indices_are_typed_errors_and_skip_only_their_item() {
    for backend in backends() {
        let what = format!("{backend:?}");
        // Exact key scores: the good sequence is checked below against the naive attention
        // of its stored rows.
        let layout = layout("kivi2,iq=0", 4, 64);
        let rig = Rig::new(layout, 1, backend, 128);
        let mut rng = Rng::new(3);
        let mut server = Server::new(&layout, &mut rng);
        server.seqs.push((0, Vec::new(), 0));
        server.seqs.push((1, Vec::new(), 0));
        step(
            &rig,
            &mut server,
            &mut rng,
            &[(0, 33), (1, 40)],
            DType::F32,
            &what,
        );
        let (h, d) = (2, 64);
        let x = rng.normals(h * d);

        // A slot beyond the blocks, a slot at the wrong offset, a sequence slot beyond the pool:
        // one bad token each (with two, either could be the first the device reports).
        for (slot, seq, position, want) in [
            (48 * 32 + 5, 0, 33, "cache slot"),
            (10, 1, 40, "slot offset"),
            (8, 6, 40, "sequence slot"),
        ] {
            let err = rig
                .write(0, &x, &x, DType::F32, &[slot], &[seq], &[position])
                .unwrap_err();
            match &err {
                Error::DeviceIndex {
                    kernel: "write_kv",
                    item_kind: "token",
                    what,
                    ..
                } => {
                    assert_eq!(*what, want, "{err}")
                }
                other => panic!("{what}: expected a write_kv DeviceIndex, got {other}"),
            }
        }
        // Nothing was stored where it should not be: both sequences still attend as before.
        step(
            &rig,
            &mut server,
            &mut rng,
            &[(0, 1), (1, 1)],
            DType::F32,
            &what,
        );

        // A block id beyond the layout in sequence 1's table: sequence 1 is skipped (zeros),
        // sequence 0 is served.
        let width = 4;
        let (starts, lens, mut tables, slots) = server.batch(&[(0, 1), (1, 1)], width);
        tables[width] = 1000;
        let q = rng.normals(2 * 8 * d);
        let (result, out) = rig.attend(
            0,
            &q,
            DType::F32,
            &starts,
            &lens,
            &tables,
            width,
            &slots,
            0.125,
        );
        match result {
            Err(Error::DeviceIndex {
                kernel: "attend",
                item: 1,
                what: "block id",
                index: 1000,
                ..
            }) => {}
            other => panic!("{what}: expected a block id error for sequence 1, got {other:?}"),
        }
        assert!(
            out[8 * d..].iter().all(|&x| x == 0.0),
            "{what}: the skipped sequence's output"
        );
        let (s0, b0, l0) = &server.seqs[0];
        let (rk, rv) = rig
            .paged
            .read_back(0, &rig.caches[0], b0, *s0 as usize, *l0)
            .unwrap();
        let want = naive_chunk(&rk, &rv, &q[..8 * d], *l0, h, 8, d, 0.125, None);
        assert_rows_close(
            &out[..8 * d],
            &want,
            d,
            1e-5,
            &format!("{what}: the good sequence"),
        );
        // The error was cleared by the check that returned it.
        rig.paged.check(StreamHandle::DEFAULT).unwrap();

        // What the host knows is checked before anything is queued.
        let (mut batch, inputs) = rig.stage_attend(
            &q,
            DType::F32,
            &starts,
            &lens,
            &tables,
            width,
            &slots,
            0.125,
        );
        batch.tokens = 1000;
        let workspace = Workspace {
            addr: rig.workspace.addr(),
            limits: rig.limits,
        };
        // SAFETY: rejected before anything is read.
        let err = unsafe {
            rig.paged.attend(
                0,
                rig.caches[0].addr(),
                &batch,
                &workspace,
                StreamHandle::DEFAULT,
            )
        }
        .unwrap_err();
        assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
        drop(inputs);
    }
}

/// A two-layer step of decodes and a prefill chunk on the emulated device path makes no
/// allocation, copy or synchronization inside `write_kv` and `attend`: everything they touch
/// was set up before, and they only queue kernels.
#[test]
fn write_kv_and_attend_make_no_host_traffic() {
    let layout = layout("kivi2,sinks=4", 4, 64);
    let rig = Rig::new(layout, 2, Backend::Emu, 64);
    let mut rng = Rng::new(5);
    let mut server = Server::new(&layout, &mut rng);
    for slot in 0..3 {
        server.seqs.push((slot, Vec::new(), 0));
    }
    step(
        &rig,
        &mut server,
        &mut rng,
        &[(0, 20), (1, 35)],
        DType::F16,
        "setup",
    );
    // The step's inputs, staged beforehand as a server's would already be on the device.
    let chunks = [(0, 1), (1, 1), (2, 17)];
    let (mut slots, mut seqs, mut positions) = (Vec::new(), Vec::new(), Vec::new());
    for &(s, n) in &chunks {
        let (a, b, c) = server.grow(s, n);
        slots.extend(a);
        seqs.extend(b);
        positions.extend(c);
    }
    let x = rng.normals(slots.len() * 2 * 64);
    let (write, _w) = rig.stage_write(&x, &x, DType::F16, &slots, &seqs, &positions);
    let (starts, lens, tables, seq_slots) = server.batch(&chunks, 4);
    let q = rng.normals(slots.len() * 8 * 64);
    let (attend, _a) = rig.stage_attend(
        &q,
        DType::F16,
        &starts,
        &lens,
        &tables,
        4,
        &seq_slots,
        0.125,
    );
    let workspace = Workspace {
        addr: rig.workspace.addr(),
        limits: rig.limits,
    };

    let before = traffic();
    for layer in 0..2 {
        // SAFETY: the rig's caches and workspace, and inputs staged above, alive over the calls.
        unsafe {
            rig.paged
                .write_kv(
                    layer,
                    rig.caches[layer].addr(),
                    &write,
                    StreamHandle::DEFAULT,
                )
                .unwrap();
            rig.paged
                .attend(
                    layer,
                    rig.caches[layer].addr(),
                    &attend,
                    &workspace,
                    StreamHandle::DEFAULT,
                )
                .unwrap();
        }
    }
    assert_eq!(traffic(), before, "write_kv and attend made runtime calls");
    rig.paged.check(StreamHandle::DEFAULT).unwrap();
    assert!(
        traffic().synchronizations > before.synchronizations,
        "check waits (and is counted)"
    );
}

/// KIVI's value window: after a prefill longer than the window and decodes that wrap it, the
/// values of the blocks holding the last R positions read back as the f16 of what was written,
/// bit for bit, and older ones as their 2-bit codes; the sinks stay f16 and outside the window.
#[test]
fn the_value_window_holds_the_last_values_exactly() {
    for backend in backends() {
        let what = format!("{backend:?}");
        let layout = layout("kivi2,rv=64,sinks=2", 1, 64);
        let rig = Rig::new(layout, 1, backend, 160);
        let mut rng = Rng::new(21);
        let mut server = Server::new(&layout, &mut rng);
        server.seqs.push((2, Vec::new(), 0));
        let (h, d) = (2, 64);
        let mut written = Vec::new();
        for n in [150, 1, 1, 30] {
            let (slots, seqs, positions) = server.grow(0, n);
            let v = rng.normals(n * h * d);
            rig.write(0, &v, &v, DType::F32, &slots, &seqs, &positions)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            written.extend(v);
        }
        let (_, blocks, len) = &server.seqs[0];
        let (_, read) = rig
            .paged
            .read_back(0, &rig.caches[0], blocks, 2, *len)
            .unwrap();
        let row = h * d;
        let exact = |pos: usize| {
            (0..row).all(|i| {
                let x = written[pos * row + i];
                read[pos * row + i] == half::f16::from_f32(x).to_f32()
            })
        };
        // 182 tokens: the last 64 start in the block of positions 96..127.
        assert_eq!(*len, 182);
        for pos in 0..*len {
            let want = !(2..96).contains(&pos);
            assert_eq!(exact(pos), want, "{what}: position {pos} of {len}");
        }
    }
}
