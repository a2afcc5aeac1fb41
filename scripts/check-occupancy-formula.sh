#!/usr/bin/env bash
# Checks hipkv::codeobj's occupancy formula (ArchLimits::occupancy) against the compiler's own
# `; Occupancy: N` comments, for every processor ArchLimits knows: per processor and mode
# (wave32, wave64, wave32 in CU mode) it compiles 256 kernels using 1..256 VGPRs and 80 kernels
# with LDS of 0..64 KiB and workgroups of 32..1024 work-items, then runs the ignored test
# tests/occupancy_formula.rs over the code objects. Needs only clang (no HIP headers or device
# libraries: the kernels use clang builtins).
#
# Usage: scripts/check-occupancy-formula.sh [ARCH...]   (default: every processor ArchLimits knows)
#   HIPKV_CLANG (default /usr/bin/clang++-19) names the compiler; cargo runs as usual
#   (CARGO_TARGET_DIR is honoured).
set -euo pipefail
cd "$(dirname "$0")/.."

CLANG="${HIPKV_CLANG:-/usr/bin/clang++-19}"
if (($#)); then
    ARCHS=("$@")
else
    ARCHS=(gfx1010 gfx1011 gfx1012 gfx1013 gfx1030 gfx1031 gfx1032 gfx1033 gfx1034 gfx1035 gfx1036
           gfx1100 gfx1101 gfx1102 gfx1103 gfx1150 gfx1151 gfx1152 gfx1200 gfx1201)
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# The kernels, for a given wavefront size (the VGPR kernels are one wave per workgroup).
sweep_source() {
    local wave=$1 n wg lds bounds body
    echo '#define KERNEL extern "C" __attribute__((global))'
    echo '#define TID __builtin_amdgcn_workitem_id_x()'
    echo "KERNEL __attribute__((launch_bounds($wave))) void v1(float *p) { p[TID] = 1.0f; }"
    for ((n = 2; n <= 256; n++)); do
        echo "KERNEL __attribute__((launch_bounds($wave))) void v$n(float *p) {" \
             "asm volatile(\"\" ::: \"v$((n - 1))\"); p[TID] = 1.0f; }"
    done
    for wg in 32 64 96 128 256 512 1024 default; do
        for lds in 0 256 4096 8192 9000 16384 20000 32768 40000 65536; do
            bounds=""
            [[ $wg == default ]] || bounds="__attribute__((launch_bounds($wg)))"
            body="p[TID] = 1.0f;"
            if ((lds)); then
                body="__attribute__((shared)) float s[$((lds / 4))]; s[TID % $((lds / 4))] = p[TID];"
                body+=" __builtin_amdgcn_s_barrier(); p[TID] = s[(TID * 7 + 1) % $((lds / 4))];"
            fi
            echo "KERNEL $bounds void lds_${wg}_$lds(float *p) { $body }"
        done
    done
}

sweep_source 32 > "$dir/wave32.hip"
sweep_source 64 > "$dir/wave64.hip"
for arch in "${ARCHS[@]}"; do
    for mode in wave32 wave64 cumode; do
        src=$dir/wave32.hip flags=()
        case $mode in
            wave64) src=$dir/wave64.hip flags=(-mwavefrontsize64) ;;
            cumode) flags=(-mcumode) ;;
        esac
        out=$dir/$arch-$mode
        common=(-x hip --offload-arch="$arch" --cuda-device-only --no-gpu-bundle-output -O3
                -nogpuinc -nogpulib "${flags[@]}")
        "$CLANG" "${common[@]}" -c "$src" -o "$out.hsaco"
        "$CLANG" "${common[@]}" -S "$src" -o "$out.s"
        awk '/^[A-Za-z_][A-Za-z0-9_]*:/ { sub(":.*", ""); kernel = $0 }
             /^; Occupancy: / { print kernel, $3 }' "$out.s" > "$out.occupancy.txt"
        rm "$out.s"
    done
    echo "compiled $arch"
done
HIPKV_OCCUPANCY_SWEEP="$dir" cargo test --release --test occupancy_formula -- --ignored --nocapture
