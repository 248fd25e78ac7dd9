#!/usr/bin/env bash
# gpu-check.sh: the checks that need a real NVIDIA GPU, in one short run.
#
# For the lent GPU machine (H200, Python 3.12, no network). Run from anywhere;
# it works in the repository root. Results and logs go to $OUT (default
# ./gpu-check-out); at most 8 files, so they come back from the device tool:
#   summary.txt  env.txt  gpu-check.log  cuda-tests.log  conformance.log
#   bench.log  bench-cuda-graph.json
#
# Packages: the machine's image has numpy, pluggy, pytest, rich, safetensors,
# cuda-bindings and nvidia-cuda-nvrtc. Anything else (or other versions) is
# carried as wheels in .whl/ and installed with --no-index into /tmp/site,
# which goes first on PYTHONPATH. Flare itself is installed from this working
# tree into /tmp/flare-site (a real wheel build, so package data and entry
# points are what users get); if that build fails, a symlink tree plus a
# generated dist-info stands in for it.
# Vulkan loaders, if carried as .gl/*.deb (see the device notes), are unpacked
# so that the vulkan backend can be probed too.
#
# Steps have their own time limits (about 9 minutes at worst, well under that
# normally), so the whole script fits one 10-minute device call.
# Exit status: 0 when every step passed, else 1 (summary.txt says which).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
export FLARE_CACHE_DIR="${FLARE_CACHE_DIR:-/tmp/flare-cache}"
PY="${PYTHON:-python3}"
declare -a RESULTS=()

step() {  # step NAME SECONDS LOGFILE CMD...: run with a timeout, record pass/fail
    local name="$1" limit="$2" log="$3"
    shift 3
    echo "=== $name: $*"
    local start=$SECONDS rc
    if [ -n "$log" ]; then
        timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
        rc=${PIPESTATUS[0]}
    else
        timeout "$limit" "$@"
        rc=$?
    fi
    RESULTS+=("$(printf '%-12s %s (rc=%s, %ss)' "$name" "$([ "$rc" = 0 ] && echo PASS || echo FAIL)" "$rc" "$((SECONDS - start))")")
    return 0
}

# --- environment -------------------------------------------------------------
{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -a)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "nvidia-smi: not available"
    "$PY" --version
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(numpy|pluggy|pytest|cuda-bindings|cuda-pathfinder|nvidia-cuda-nvrtc|rich|safetensors|vulkan) ' || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# --- packages ---------------------------------------------------------------------
SITE=/tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
    wheels=()
    for w in .whl/*.whl; do
        case "$(basename "$w")" in flare_runtime-*) ;; *) wheels+=("$w") ;; esac  # flare comes from the tree
    done
    if [ "${#wheels[@]}" -gt 0 ]; then
        echo "=== installing ${#wheels[@]} carried wheels into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}" \
            || echo "WARNING: carried wheels did not all install"
    fi
fi
if compgen -G ".gl/*.deb" > /dev/null; then
    echo "=== unpacking carried Vulkan/GL loaders"
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig || true
    if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
        export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    fi
fi

FLARE_SITE=/tmp/flare-site
rm -rf "$FLARE_SITE"
echo "=== installing flare from the working tree into $FLARE_SITE"
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$FLARE_SITE" . ; then
    echo "wheel build failed: using a symlink tree with generated entry points instead"
    rm -rf "$FLARE_SITE"
    mkdir -p "$FLARE_SITE/flare"
    for f in core/*; do ln -s "$ROOT/$f" "$FLARE_SITE/flare/$(basename "$f")"; done
    for sub in plugins backends models; do ln -sfn "$ROOT/$sub" "$FLARE_SITE/flare/$sub"; done
    "$PY" - "$FLARE_SITE" <<'EOF'
import sys, tomllib, pathlib
site = pathlib.Path(sys.argv[1])
meta = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = site / f"flare_runtime-{meta['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flare-runtime\nVersion: {meta['version']}\n")
lines = []
for group, eps in meta.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{k} = {v}" for k, v in eps.items()]
if "scripts" in meta:
    lines.append("[console_scripts]")
    lines += [f"{k} = {v}" for k, v in meta["scripts"].items()]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
EOF
fi
export PYTHONPATH="$SITE:$FLARE_SITE${PYTHONPATH:+:$PYTHONPATH}"
cd /tmp  # import flare from the install, not from the source folders
TESTS="$ROOT/tests"

# --- what the backends say ---------------------------------------------------------
step probe 60 "" "$PY" -c '
from flare.plugin_manager import get_plugin_manager
for name, spec in get_plugin_manager().backends().items():
    r = spec.backend.probe()
    state = "usable" if r.usable else "UNUSABLE"
    print(f"{name}: {state} - {r.reason}")
from flare.backends.cuda.device import CudaBackend
raise SystemExit(0 if CudaBackend.probe().usable else 1)
'

# --- tests: CUDA's own (GPU required), then the conformance matrix --------------------
# (--require-backends takes an optional value: always give it one, or it eats the next path)
export FLARE_REQUIRE_CUDA=1
step cuda-tests 180 cuda-tests.log "$PY" -m pytest -q -rs -p no:cacheprovider --rootdir="$ROOT" \
    --backends=cpu,cuda --require-backends=cpu,cuda "$TESTS"/test_cuda_*.py
step conformance 200 conformance.log "$PY" -m pytest -q -rs -p no:cacheprovider \
    --backends=cpu,cuda,vulkan --require-backends=cpu,cuda,vulkan --pyargs flare.plugins.testing.conformance

# --- benchmark: CUDA graph replay vs plain launches ---------------------------------
step bench 90 bench.log "$PY" "$ROOT/bench/cuda_graph_replay.py" --out "$OUT/bench-cuda-graph.json"

# --- summary ---------------------------------------------------------------------------
status=0
{
    echo "gpu-check $(date -u +%FT%TZ)"
    for line in "${RESULTS[@]}"; do
        echo "$line"
        case "$line" in *FAIL*) status=1 ;; esac
    done
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit "$status"
