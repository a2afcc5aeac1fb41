#!/usr/bin/env bash
# Regenerates src/capi/header.rs (bindgen's reading of include/hipkv.h, the C ABI) the same way
# tests/capi.rs checks it. Needs libclang: LIBCLANG_PATH=/usr/lib/llvm-19/lib after
# scripts/install-hip-toolchain.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export LIBCLANG_PATH="${LIBCLANG_PATH:-/usr/lib/llvm-19/lib}"
HIPKV_BLESS=1 cargo test --release --test capi -- --exact committed_capi_bindings_match_the_header
echo "wrote src/capi/header.rs"
