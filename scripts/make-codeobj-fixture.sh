#!/usr/bin/env bash
# Rebuilds the code-object fixture of the src/codeobj.rs tests from tests/data/codeobj-fixture.hip:
#   tests/data/codeobj-fixture.gfx1201.hsaco     the code object (device-only, as build.rs builds)
#   tests/data/codeobj-fixture.notes.txt         what `llvm-readelf --notes` says of it
#   tests/data/codeobj-fixture.occupancy.txt     `kernel occupancy` from the compiler's `-S`
#                                                output (`; Occupancy: N`), for the formula test
# The tests compare the parser with the last two, so the three files are committed together.
#
# Usage: scripts/make-codeobj-fixture.sh
#   HIPKV_CLANG (default /usr/bin/clang++-19), HIPKV_DEVLIB_DIR (default /opt/hipkv-devlibs) and
#   HIPKV_LLVM_BIN (default /usr/lib/llvm-19/bin) name the toolchain that
#   scripts/install-hip-toolchain.sh installs.
set -euo pipefail
cd "$(dirname "$0")/.."

CLANG="${HIPKV_CLANG:-/usr/bin/clang++-19}"
DEVLIBS="${HIPKV_DEVLIB_DIR:-/opt/hipkv-devlibs}"
LLVM_BIN="${HIPKV_LLVM_BIN:-/usr/lib/llvm-19/bin}"
ARCH=gfx1201
SRC=tests/data/codeobj-fixture.hip
OUT=tests/data/codeobj-fixture.$ARCH

FLAGS=(-x hip --offload-arch="$ARCH" --cuda-device-only --no-gpu-bundle-output -O3 -std=c++17
       --rocm-device-lib-path="$DEVLIBS")
"$CLANG" "${FLAGS[@]}" -c "$SRC" -o "$OUT.hsaco"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$CLANG" "${FLAGS[@]}" -S "$SRC" -o "$tmp/fixture.s"
"$LLVM_BIN/llvm-readelf" --notes "$OUT.hsaco" > tests/data/codeobj-fixture.notes.txt
# Each kernel's `; Kernel info:` block follows its label and ends with `; Occupancy: N`.
awk '/^[A-Za-z_][A-Za-z0-9_]*:/ { sub(":.*", ""); kernel = $0 }
     /^; Occupancy: / { print kernel, $3 }' "$tmp/fixture.s" > tests/data/codeobj-fixture.occupancy.txt
"$CLANG" --version | head -1
echo "wrote $OUT.hsaco ($(stat -c %s "$OUT.hsaco") bytes), tests/data/codeobj-fixture.notes.txt," \
     "tests/data/codeobj-fixture.occupancy.txt"
