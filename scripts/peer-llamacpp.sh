#!/usr/bin/env bash
# hipkv against llama.cpp in the same run, with llama.cpp built for this CPU.
#
#   scripts/peer-llamacpp.sh bench [hipkv bench flags]   the comparison (`hipkv bench --peer llama.cpp`)
#   scripts/peer-llamacpp.sh test [cargo test flags]     the tests of the peer itself
#
# The `peer-llamacpp` feature builds llama.cpp from the sources vendored by the llama-cpp-sys-2
# crate, with cmake. That crate turns GGML_NATIVE off and enables only the instruction sets it is
# told of (GGML_AVX2=ON and so on), while hipkv picks its AVX2 kernels at run time; without the
# flags set here llama.cpp would run SSE2 code against hipkv's AVX2. So this script reads the
# CPU's flags and enables each one ggml can use, AVX-512 included: llama.cpp at its best here.
# llama-cpp-sys-2 reruns its build when one of the GGML_* variables it saw at its last build
# changes, not when a new one appears: after moving target/ to another CPU, run
# `cargo clean -p llama-cpp-sys-2 --release` first (the bench's header lists what ggml has).
# Needs cmake and a C++ compiler (installed with apt-get where missing) and libclang for bindgen
# (LIBCLANG_PATH, as the rest of the build).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}
case "$mode" in
bench | test) shift ;;
*)
    echo "usage: $0 bench|test [flags]" >&2
    exit 2
    ;;
esac

if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends cmake g++
fi

cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
    avx512_vnni:AVX512_VNNI avx512vbmi:AVX512_VBMI avx512_bf16:AVX512_BF16; do
    if [[ $cpu_flags == *" ${pair%%:*} "* ]]; then
        export "GGML_${pair#*:}=ON"
    fi
done
env | grep '^GGML_' | sort | tr '\n' ' '
echo

if [[ $mode == bench ]]; then
    exec cargo run --release --features peer-llamacpp --bin hipkv -- bench --peer llama.cpp "$@"
else
    exec cargo test --release --features peer-llamacpp "$@"
fi
