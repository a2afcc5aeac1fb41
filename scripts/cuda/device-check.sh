#!/usr/bin/env bash
# The kernels on real parallel hardware: an NVIDIA GPU through CUDA, where a warp is the same 32
# lanes as a gfx1201 wave32. The same `.hip` sources compile for CUDA through hipkv_device.h;
# hip_on_cuda.cpp stands in for libamdhip64, so the crate's own HIP backend (`Backend::Hip`)
# and its tests drive them. This finds what the SIMT emulator cannot: races between waves and
# lanes that really run at once, and a kernel missing from the object the backend loads.
#
# Two halves, since a GPU machine may have CUDA and no Rust:
#   scripts/cuda/device-check.sh prepare DIR
#       Here (Rust, the toolchain of scripts/install-hip-toolchain.sh): builds the test
#       binaries with the gfx1201 code objects embedded (the backend picks its objects by the
#       arch the shim reports) and packs them into DIR with Debian's HIP headers, which give the
#       shim hipDeviceProp_t's layout as the crate's bindings see it. With HIPKV_CUDA_PATH (a
#       CUDA tree with include/, bin/ptxas and nvvm/libdevice) it also compiles every kernel
#       source and head_dim for sm_90 with clang-19, a fallback for a machine whose nvcc fails.
#   scripts/cuda/device-check.sh run DIR OUT
#       There (nvcc, libcuda): builds the shim and runs the kernels' differential tests
#       (tests/kernels.rs, tests/sweep.rs, with HIPKV_TEST_BACKEND=hip) and the tests that run on
#       every usable GPU (device_cache, paged, server_loop, hip_runtime) on clang's objects, a
#       short test under compute-sanitizer, the kernels' tests again on objects nvcc compiled
#       meanwhile (its resource report in ptxas.log), and `hipkv bench`. Logs in
#       OUT/logs.tar.gz; a summary last, also in OUT/summary.txt.
#
# A CUDA tree for `prepare` from PyPI, where no CUDA is installed (clang-19 knows CUDA up to
# 12.5 and warns, harmlessly, about 12.6):
#   pip install --target T "nvidia-cuda-nvcc-cu12==12.6.*" "nvidia-cuda-runtime-cu12==12.6.*" \
#       "nvidia-cuda-cccl-cu12==12.6.*"
#   then a tree C with C/bin/ptxas, C/nvvm (from T/nvidia/cuda_nvcc), C/include holding the
#   three packages' include/ folders, and an empty C/include/curand_mtgp32_kernel.h (clang's
#   CUDA wrapper includes it; the kernels use nothing of cuRAND).
set -uo pipefail

die() { echo "device-check: $*" >&2; exit 1; }
HEAD_DIMS=(64 128 256)
SOURCES=(attention write)
TESTS=(kernels sweep device_cache paged hip_runtime server_loop)

prepare() {
    local dir=$1
    mkdir -p "$dir/bin" "$dir/include" "$dir/modules"
    [[ -d /usr/include/hip ]] || die "Debian's HIP headers are missing (scripts/install-hip-toolchain.sh)"
    cp -r /usr/include/hip "$dir/include/"
    local args=() t
    for t in "${TESTS[@]}"; do args+=(--test "$t"); done
    HIPKV_REQUIRE_HIP=1 cargo test --release --no-run "${args[@]}" 2>&1 | tee "$dir/cargo.log" ||
        die "the test binaries did not build"
    for t in "${TESTS[@]}"; do
        local exe
        exe=$(grep -o "(target/release/deps/$t-[0-9a-f]*)" "$dir/cargo.log" | tail -1 | tr -d '()')
        [[ -n $exe ]] || die "no binary for tests/$t.rs in cargo's output"
        strip -o "$dir/bin/$t" "$exe"
    done
    HIPKV_REQUIRE_HIP=1 cargo build --release --bin hipkv || die "the CLI did not build"
    strip -o "$dir/bin/hipkv" target/release/hipkv
    if [[ -n ${HIPKV_CUDA_PATH:-} ]]; then
        local src d
        for src in "${SOURCES[@]}"; do
            for d in "${HEAD_DIMS[@]}"; do
                clang++-19 -x cuda --cuda-path="$HIPKV_CUDA_PATH" --cuda-gpu-arch=sm_90 \
                    --cuda-device-only -Wno-unknown-cuda-version -O3 -std=c++17 \
                    -DHIPKV_HEAD_DIM="$d" -Ihip/include "hip/$src.hip" -c \
                    -o "$dir/modules/$src.d$d.cubin" || die "clang could not compile $src.hip at d$d"
            done
        done
    fi
    tar -C "$dir" -cJf "$dir.tar.xz" . && echo "packed $(du -h "$dir.tar.xz" | cut -f1) into $dir.tar.xz"
}

run() {
    local dir out logs
    dir=$(realpath -m "$1") out=$(realpath -m "$2") logs=$(realpath -m "$1")/logs
    mkdir -p "$out" "$logs"
    [[ -f $dir.tar.xz && ! -d $dir/bin ]] && { mkdir -p "$dir" && tar -C "$dir" -xJf "$dir.tar.xz"; }
    [[ -d $dir/bin ]] || die "$dir holds no prepared binaries (run 'prepare' first)"
    command -v nvcc >/dev/null || export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
    local cuda
    cuda=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")") || die "no nvcc"
    : >"$out/summary.txt"
    note() { echo "$*" | tee -a "$out/summary.txt"; }
    save() { tar -C "$logs" -czf "$out/logs.tar.gz" .; }
    note "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
    note "nvcc: $(nvcc --version | tail -1)"

    # nvcc compiles every source and head_dim in the background (its resource report is
    # ptxas.log); the tests start at once on the objects clang compiled in `prepare`, and the
    # differential tests run again on nvcc's objects at the end.
    local nvcc_modules=$dir/nvcc-modules src d
    mkdir -p "$nvcc_modules" "$dir/shim"
    for src in "${SOURCES[@]}"; do
        for d in "${HEAD_DIMS[@]}"; do
            timeout "${NVCC_LIMIT:-300}" nvcc -x cu -arch=sm_90 -cubin -O3 -std=c++17 -Xptxas -v \
                -DHIPKV_HEAD_DIM="$d" -Ihip/include "hip/$src.hip" \
                -o "$nvcc_modules/$src.d$d.cubin" >"$logs/nvcc.$src.d$d.log" 2>&1 &
        done
    done

    g++ -std=c++17 -O2 -Wall -shared -fPIC -D__HIP_PLATFORM_AMD__ -I"$dir/include" \
        -I"$cuda/include" -I"$cuda/targets/x86_64-linux/include" scripts/cuda/hip_on_cuda.cpp \
        -L"$cuda/lib64/stubs" -L"$cuda/targets/x86_64-linux/lib/stubs" -lcuda \
        -o "$dir/shim/libamdhip64.so" 2>"$logs/shim.log" || { cat "$logs/shim.log"; die "the shim did not build"; }

    # Without clang's objects (no HIPKV_CUDA_PATH at `prepare`), every pass runs on nvcc's.
    local first=$dir/modules
    if [[ ! -s $first/attention.d64.cubin ]]; then
        wait
        first=$nvcc_modules
    fi
    export HIPKV_HIP_LIBRARY=$dir/shim/libamdhip64.so HIPKV_CUDA_MODULES=$first
    export HIPKV_TEST_BACKEND=hip RUST_BACKTRACE=1
    local t rc
    for t in "${TESTS[@]}"; do
        timeout "${TEST_LIMIT:-240}" "$dir/bin/$t" --test-threads=8 >"$logs/$t.log" 2>&1
        rc=$?
        note "$t ($(basename "$first")): exit $rc, $(grep -h '^test result' "$logs/$t.log" | tail -1)"
        ((rc == 0)) || note "  failed: $(grep -h -- '^---- .* stdout ----$' "$logs/$t.log" | cut -d' ' -f2 | head -8 | tr '\n' ' ')"
        save
    done
    # Races and out-of-bounds accesses, on two short tests that launch every kernel kind.
    if command -v compute-sanitizer >/dev/null; then
        local tool
        for tool in racecheck memcheck; do
            timeout "${SANITIZER_LIMIT:-120}" compute-sanitizer --tool "$tool" --print-limit 20 \
                "$dir/bin/kernels" --test-threads=1 an_empty_split \
                >"$logs/sanitizer.$tool.log" 2>&1
            rc=$?
            note "compute-sanitizer $tool: exit $rc, $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$logs/sanitizer.$tool.log" | tail -1)"
        done
    fi

    wait
    cat "$logs"/nvcc.*.log >"$logs/ptxas.log" 2>/dev/null
    local built=0
    for src in "${SOURCES[@]}"; do
        for d in "${HEAD_DIMS[@]}"; do
            [[ -s $nvcc_modules/$src.d$d.cubin ]] && built=$((built + 1))
        done
    done
    note "nvcc objects built: $built of $(( ${#SOURCES[@]} * ${#HEAD_DIMS[@]} )); kernels spilling: $(grep -c '[1-9][0-9]* bytes spill' "$logs/ptxas.log")"
    if ((built < ${#SOURCES[@]} * ${#HEAD_DIMS[@]})); then
        grep -h "error" "$logs"/nvcc.*.log | head -20
    elif [[ $first != "$nvcc_modules" ]]; then
        export HIPKV_CUDA_MODULES=$nvcc_modules
        for t in kernels device_cache; do
            timeout "${TEST_LIMIT:-240}" "$dir/bin/$t" --test-threads=8 >"$logs/$t.nvcc.log" 2>&1
            rc=$?
            note "$t (nvcc-modules): exit $rc, $(grep -h '^test result' "$logs/$t.nvcc.log" | tail -1)"
        done
    fi
    save
    # Real parallel timings of the same kernels (an H200 is not a gfx1201: the ratios between
    # schemes are what carries over, not the times).
    "$dir/bin/hipkv" info >"$logs/info.log" 2>&1
    HIPKV_BACKEND=hip timeout "${BENCH_LIMIT:-150}" "$dir/bin/hipkv" bench --contexts 16384,65536 \
        --min-time 0.2 >"$logs/bench.log" 2>&1
    note "bench: exit $?"
    save
    cat "$logs/bench.log"
    cat "$out/summary.txt"
}

case ${1:-} in
    prepare) (($# == 2)) || die "usage: $0 prepare DIR"; prepare "$2" ;;
    run) (($# == 3)) || die "usage: $0 run DIR OUT"; run "$2" "$3" ;;
    *) die "usage: $0 prepare DIR | run DIR OUT" ;;
esac
