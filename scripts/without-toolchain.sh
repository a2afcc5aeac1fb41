#!/usr/bin/env bash
# Runs a command as it would run on a newcomer's machine: Debian with Rust and nothing else. The
# command runs in a private mount namespace in which the GPU toolchain is hidden (clang and LLVM,
# libclang, Debian's HIP headers, runtime and device libraries, any ROCm install, and the
# device-library folder scripts/install-hip-toolchain.sh builds) and in which the variables that
# point at it are unset. The machine itself is left as it is. CI runs the README's commands
# through this, after installing the toolchain for the rest of its checks.
#
# Usage (as root, or through sudo):  scripts/without-toolchain.sh COMMAND [ARG...]
set -euo pipefail

die() { echo "without-toolchain: $*" >&2; exit 1; }
(($#)) || die "usage: $0 COMMAND [ARG...]"

if [[ -z ${HIPKV_HIDDEN_TOOLCHAIN:-} ]]; then
    [[ $(id -u) -eq 0 ]] || exec sudo --preserve-env "$0" "$@"
    command -v unshare >/dev/null || die "unshare (package util-linux) is missing"
    # Re-run this script inside a new mount namespace whose mounts do not reach the machine.
    HIPKV_HIDDEN_TOOLCHAIN=1 exec unshare --mount --propagation private "$0" "$@"
fi

# --- inside the namespace -------------------------------------------------------------------
# What the toolchain puts under /usr, by name: hidden by an overlay whose upper layer holds a
# whiteout for each. (Whole folders for LLVM and the HIP headers and bitcode.)
HIDDEN_USR=(
    'bin/clang*' 'bin/llvm-*' 'bin/ld.lld*' 'bin/lld*' 'bin/hipcc*' 'bin/hipconfig*'
    'lib/llvm-*'
    'include/hip'
    'lib/x86_64-linux-gnu/amdgcn'
    'lib/x86_64-linux-gnu/libclang*'
    'lib/x86_64-linux-gnu/libLLVM*'
    'lib/x86_64-linux-gnu/libamdhip64*'
    'lib/x86_64-linux-gnu/libhsa-runtime64*'
    'lib/x86_64-linux-gnu/libhsakmt*'
)
# Folders outside /usr: covered by an empty tmpfs.
HIDDEN_DIRS=(/opt/rocm /opt/rocm-* /opt/hipkv-devlibs)
[[ -n ${HIPKV_DEVLIB_DIR:-} ]] && HIDDEN_DIRS+=("$HIPKV_DEVLIB_DIR")

scratch=$(mktemp -d)
mount -t tmpfs hipkv-hidden "$scratch"
mkdir "$scratch/upper" "$scratch/work"
shopt -s nullglob
hidden=0
for pattern in "${HIDDEN_USR[@]}"; do
    for path in /usr/$pattern; do
        rel=${path#/usr/}
        mkdir -p "$scratch/upper/$(dirname "$rel")"
        mknod "$scratch/upper/$rel" c 0 0 # an overlay whiteout: the path is gone
        hidden=$((hidden + 1))
    done
done
if ((hidden)); then
    mount -t overlay hipkv-no-toolchain \
        -o "lowerdir=/usr,upperdir=$scratch/upper,workdir=$scratch/work" /usr
fi
for dir in "${HIDDEN_DIRS[@]}"; do
    [[ -d $dir ]] && mount -t tmpfs hipkv-hidden "$dir"
done
shopt -u nullglob

unset HIPKV_CLANG HIPKV_DEVLIB_DIR HIPKV_LLVM_BIN HIPKV_REQUIRE_HIP LIBCLANG_PATH CLANG_PATH \
    LLVM_CONFIG_PATH HIPCC ROCM_PATH HIP_PATH HIPKV_HIDDEN_TOOLCHAIN

# Nothing of the toolchain may be left in reach, or the run would prove nothing.
left=$(
    for pattern in "${HIDDEN_USR[@]}"; do compgen -G "/usr/$pattern" || true; done
    for tool in clang clang++ clang-19 clang++-19 hipcc hipconfig llvm-config; do
        command -v "$tool" || true
    done
    find /opt -maxdepth 3 \( -name 'libamdhip64*' -o -name 'hipcc' -o -name '*.bc' \) \
        2>/dev/null || true
)
[[ -z $left ]] || die "still in reach with the toolchain hidden: $left"
echo "without-toolchain: $hidden toolchain paths under /usr hidden; running: $*" >&2
exec "$@"
