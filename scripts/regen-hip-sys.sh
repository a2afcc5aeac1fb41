#!/usr/bin/env bash
# Regenerates src/hip/sys.rs (the HIP runtime functions hipkv calls, loaded at run time) with
# bindgen from Debian 12's HIP 5.2 header, the same way tests/hip_sys.rs checks it. Needs
# libamdhip64-dev and libclang (LIBCLANG_PATH=/usr/lib/llvm-19/lib after
# scripts/install-hip-toolchain.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export LIBCLANG_PATH="${LIBCLANG_PATH:-/usr/lib/llvm-19/lib}"
HIPKV_BLESS=1 cargo test --release --test hip_sys -- --exact committed_hip_bindings_match_the_header
echo "wrote src/hip/sys.rs"
