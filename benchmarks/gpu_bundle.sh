#!/usr/bin/env bash
# Fill gpu_bundle/ with the pinned wheels an offline GPU host needs (issue 16); run where pip works.
#
#   benchmarks/gpu_bundle.sh                      # gpu_bundle/: CPython 3.12, manylinux x86_64
#   benchmarks/gpu_bundle.sh --python-version 3.11 --dest DIR   # another CPython (manylinux x86_64)
#   benchmarks/gpu_bundle.sh --local --dest DIR   # for the running interpreter, plus DIR/host/: the
#                                                 # "#host:" packages (the CPU dry run stands for a host)
#   --list FILE: another pin list (default benchmarks/gpu_bundle.txt)
#
# The list is benchmarks/gpu_bundle.txt (pins; "#host:" lines name what the host already has and
# is never bundled). Binary wheels come from the index (pip download --only-binary=:all:);
# DeepSpeed is built from its sdist as a pure-Python wheel (DS_BUILD_OPS=0: its ops are JIT-built
# on first use, and autotune's GPU check uses torch's AdamW so it needs none). Copy the folder
# next to the repository (it is git-ignored) and run benchmarks/gpu_check.sh there: it installs
# from it with --no-index. Prints the total size and fails if it reaches 64 MiB (the host's limit).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIST="$ROOT/benchmarks/gpu_bundle.txt"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
DEST="$ROOT/gpu_bundle"
PYVER=3.12
LOCAL=0
LIMIT_MIB=64
while [ $# -gt 0 ]; do
    case "$1" in
        --dest) DEST="$2"; shift 2 ;;
        --python-version) PYVER="$2"; shift 2 ;;
        --local) LOCAL=1; shift ;;
        --list) LIST="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "gpu_bundle.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$PYVER" in
    3.[0-9]|3.[0-9][0-9]) ;;
    *) echo "gpu_bundle.sh: error: --python-version: expected 3.N, got '$PYVER'" >&2; exit 2 ;;
esac

# the pins (comments and blank lines dropped) and the host's packages
[ -f "$LIST" ] || { echo "gpu_bundle.sh: error: $LIST: no such file" >&2; exit 2; }
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | awk NF)
mapfile -t HOST < <(sed -n 's/^#host:[[:space:]]*\([^[:space:]]*\).*/\1/p' "$LIST")
DS_PIN=""
OTHERS=()
for p in "${PINS[@]}"; do
    case "$p" in
        deepspeed==*) DS_PIN="$p" ;;
        *==*) OTHERS+=("$p") ;;
        *) echo "gpu_bundle.sh: error: $LIST: '$p' is not pinned (name==version)" >&2; exit 2 ;;
    esac
done
[ -n "$DS_PIN" ] || { echo "gpu_bundle.sh: error: $LIST: no deepspeed==VERSION line" >&2; exit 2; }

if [ "$LOCAL" = 1 ]; then
    PLAT=()
    PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    what="the running interpreter ($PY, CPython $PYVER)"
else
    # torch >= 2.5 wheels are manylinux_2_28, so such a host has glibc >= 2.28
    PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --python-version "$PYVER"
          --implementation cp --abi "cp${PYVER/./}")
    what="CPython $PYVER manylinux x86_64"
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_() {  # pip, without the warnings about index folders that lack a package
    "$PY" -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2)
}
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
rm -rf "$DEST"
mkdir -p "$DEST"
echo "gpu_bundle: ${#PINS[@]} pinned packages for $what -> $DEST" >&2
pip_ download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$DEST" "${OTHERS[@]}"
pip_ download -q --no-deps --no-binary=:all: -d "$TMP/sdist" "$DS_PIN"
export DS_BUILD_OPS=0  # a pure-Python wheel: no op is compiled
pip_ wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$DEST" "$TMP"/sdist/deepspeed-*.tar.gz
cp "$LIST" "$DEST/gpu_bundle.txt"  # what the folder was filled from (gpu_check.sh compares)

if [ "$LOCAL" = 1 ]; then
    # the dry run's stand-in for the host's own packages (never copied to a GPU host)
    want=()
    for h in "${HOST[@]}"; do [ "$h" = torch ] || want+=("$h"); done
    pip_ download -q --only-binary=:all: -c "$DEST/gpu_bundle.txt" -d "$DEST/host" "${want[@]}"
    echo "gpu_bundle: host stand-in: $(ls "$DEST/host" | wc -l) wheels in $DEST/host" >&2
fi

n=$(ls "$DEST"/*.whl | wc -l)
bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_bundle: $n wheels, total $mib MiB ($bytes bytes) in $DEST"
if [ "$bytes" -ge $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_bundle.sh: error: the bundle is $mib MiB, over the host's $LIMIT_MIB MiB" >&2
    exit 1
fi
