//! The continuous-batching example as a test: 300 steps of arrivals, chunked prefills beside
//! decodes, forks with copy-on-write, preemptions and re-prefills, every output checked against
//! the reference and every block back at the end; on the CPU, the emulated device and, where
//! one is usable, the GPU.

#[path = "../examples/server_loop.rs"]
mod server_loop;

use hipkv::Backend;
use hipkv::backend::HipStatus;

#[test]
fn a_continuous_batching_run_matches_the_reference_on_every_backend() {
    let mut backends = vec![Backend::Cpu, Backend::Emu];
    if HipStatus::probe().obstacle().is_none() {
        backends.push(Backend::Hip);
    }
    for backend in backends {
        let setup = server_loop::Setup {
            backend,
            steps: 300,
            // Exact key scores: the loop's reference is over the stored rows.
            scheme: "kivi2,iq=0".parse().unwrap(),
            seed: 1,
        };
        let s = server_loop::run(&setup).unwrap_or_else(|why| panic!("{backend:?}: {why}"));
        // The run exercised what it is for.
        assert!(
            s.finished > 10 && s.forks > 5 && s.preemptions > 5,
            "{backend:?}: {s:?}"
        );
        assert!(
            s.prefill_tokens > 1000 && s.decode_tokens > 1000,
            "{backend:?}: {s:?}"
        );
        println!("{backend:?}: {s:?}");
    }
}
