#!/usr/bin/env bash
# Regenerates src/abi/generated.rs (Rust bindings of hip/include/hipkv_abi.h) with bindgen, the
# same way tests/abi.rs checks it. Needs libclang: LIBCLANG_PATH=/usr/lib/llvm-19/lib after
# scripts/install-hip-toolchain.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export LIBCLANG_PATH="${LIBCLANG_PATH:-/usr/lib/llvm-19/lib}"
HIPKV_BLESS=1 cargo test --release --test abi -- --exact committed_bindings_match_the_header
echo "wrote src/abi/generated.rs"
