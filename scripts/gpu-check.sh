#!/usr/bin/env bash
# gpu-check.sh: everything that needs a real NVIDIA GPU, in one run on a bare machine.
#
# Written for the lent GPU machine (H200, Python 3.12, no network, root), usable on any
# Linux box with an NVIDIA driver. Run it from the repository root or anywhere:
#     bash scripts/gpu-check.sh            # results in $OUT (default ./gpu-check-out)
#
# WHAT MUST BE CARRIED (git-ignored folders; name them in the device tool's `carry`):
#   .whl/  Python 3.12 manylinux x86_64 wheels of what the machine's image lacks:
#          vulkan (the Vulkan binding), cffi and pycparser (its needs), and, optional,
#          nvmath-python (the cuBLAS column prefers it; CuPy from the image is the
#          fallback). cuda-bindings / nvidia-cuda-nvrtc only if the image's are missing
#          or too old. Fetch them here with:
#            echo /.whl/ >> .git/info/exclude
#            python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#              --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#              --platform manylinux2014_x86_64 -d .whl vulkan cffi pycparser nvmath-python
#          and gguf (pure Python; the reference of the quantized weights) with what it needs
#          beyond the image's (pyyaml, tqdm, requests):
#            python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#              --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#              --platform manylinux2014_x86_64 -d .whl gguf
#          Where the machine has network access and .whl/ is absent, pip fetches them.
#   .gl/   the Vulkan loader as Ubuntu debs, when `ldconfig -p` there shows no libvulkan:
#            echo /.gl/ >> .git/info/exclude; mkdir -p .gl /tmp/amd64/partial
#            o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
#            apt-get $o update; (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 \
#              libopengl0 libgl1 libglx0 libgles2)
#   Device tool call:  run(command="bash scripts/gpu-check.sh", carry=[".whl", ".gl"], timeout_s=600)
#
# What it does:
#   1. a venv in /tmp/flare-venv that sees the image's packages (numpy, cuda-bindings,
#      nvidia-cuda-nvrtc, CuPy ...; also when the image's python3 is itself a venv), plus the
#      missing ones from .whl/;
#      Flare installed into it from this tree (a real wheel build; if that fails, a
#      symlink tree with generated entry points);
#   2. the Vulkan loader from .gl/*.deb if none is installed, and VK_DRIVER_FILES set to
#      the NVIDIA ICD json wherever the driver put it (searched below);
#   3. probe of every backend; CUDA's own tests with a GPU required; the conformance
#      suite on cpu, cuda and vulkan;
#   4. benchmarks: Flare's matmul kernels beside cuBLAS at three sizes
#      (bench/cuda_matmul.py), end-to-end model timings on cpu, cuda and vulkan
#      (bench/gpu_kernels.py), CUDA graph replay vs plain launches, the quantized-weight
#      kernels beside f16/f32 at decode and prefill shapes (bench/cuda_quant.py).
# Results (at most 8 files, so all come back from the device tool), in $OUT:
#   summary.txt env.txt gpu-check.log tests.log bench-matmul.json bench-e2e.json bench-graph.json
#   bench-quant.json
# Steps have their own time limits (555 s together, plus about a minute of setup) to fit one
# 10-minute call; the NVRTC cache (FLARE_CACHE_DIR=/tmp/flare-cache) is shared between steps.
# Exit status: 0 when every step passed, else 1 (summary.txt says which).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
export FLARE_CACHE_DIR="${FLARE_CACHE_DIR:-/tmp/flare-cache}"
BASE_PY="${PYTHON:-python3}"
VENV="${FLARE_GPU_VENV:-/tmp/flare-venv}"
declare -a RESULTS=()

step() {  # step NAME SECONDS LOG CMD...: run with a timeout (output also appended to $OUT/LOG
          # unless LOG is ""), record pass/fail, never stop the script
    local name="$1" limit="$2" log="$3"
    shift 3
    echo "=== $name: $*"
    local start=$SECONDS rc
    if [ -n "$log" ]; then
        echo "=== $name: $*" >> "$OUT/$log"
        timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
        rc=${PIPESTATUS[0]}
    else
        timeout "$limit" "$@"
        rc=$?
    fi
    RESULTS+=("$(printf '%-14s %s (rc=%s, %ss)' "$name" "$([ "$rc" = 0 ] && echo PASS || echo FAIL)" "$rc" "$((SECONDS - start))")")
    return 0
}

# --- 1. Python environment -------------------------------------------------------------
echo "=== venv $VENV (with the image's site packages)"
rm -rf "$VENV"
"$BASE_PY" -m venv --system-site-packages "$VENV" || { echo "cannot create a venv"; exit 1; }
PY="$VENV/bin/python"
# The image's python3 may itself be a venv (/opt/torch/.venv on the H200 image), whose packages
# --system-site-packages does not see: list its site folders in a .pth file so they come after
# the new venv's own (what is installed here wins).
VENV_SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$BASE_PY" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    > "$VENV_SITE/_flare_image_site.pth"
missing=()
for spec in "cuda.bindings:cuda-bindings" "cuda.bindings.nvrtc:nvidia-cuda-nvrtc" "cffi:cffi" \
            "pycparser:pycparser" "vulkan:vulkan" "nvmath:nvmath-python" "gguf:gguf"; do
    "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec##*:}")
done
# NVRTC's shared library is what cuda.bindings.nvrtc needs at call time, not at import
"$PY" -c "from cuda.bindings import nvrtc; assert nvrtc.nvrtcVersion()[0] == 0" 2>/dev/null \
    || missing+=(nvidia-cuda-nvrtc)
missing=($(printf '%s\n' "${missing[@]}" | sort -u))
if [ "${#missing[@]}" -gt 0 ]; then
    echo "=== installing ${missing[*]}"
    if [ -d .whl ]; then
        for pkg in "${missing[@]}"; do  # one at a time: an optional one missing from .whl/ stops nothing
            "$PY" -m pip install -q --no-index --find-links .whl "$pkg" || echo "NOTE: $pkg not installed from .whl/"
        done
    else
        for pkg in "${missing[@]}"; do
            "$PY" -m pip install -q "$pkg" || echo "NOTE: $pkg not installed (no .whl/ carried and no index)"
        done
    fi
fi

echo "=== installing flare from the working tree into $VENV"
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation "$ROOT" > /tmp/flare-wheel.log 2>&1; then
    tail -n 5 /tmp/flare-wheel.log
    echo "wheel build failed (log above): using a symlink tree with generated entry points instead"
    SITE="$VENV_SITE"
    mkdir -p "$SITE/flare"
    for sub in core plugins backends models; do ln -sfn "$ROOT/$sub/flare/$sub" "$SITE/flare/$sub"; done
    "$PY" - "$SITE" <<'EOF'
import sys, tomllib, pathlib
site = pathlib.Path(sys.argv[1])
meta = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = site / f"flare_runtime-{meta['version']}.dist-info"
info.mkdir(exist_ok=True)
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

# --- 2. Vulkan loader and the NVIDIA ICD ------------------------------------------------
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
    if compgen -G ".gl/*.deb" > /dev/null; then
        echo "=== no Vulkan loader installed: unpacking the carried .gl/*.deb"
        for f in .gl/*.deb; do dpkg -x "$f" /; done
        ldconfig || true
    else
        echo "NOTE: no Vulkan loader and no .gl/*.deb carried: the vulkan backend will be unusable"
    fi
fi
if [ -z "${VK_DRIVER_FILES:-}" ]; then
    for dir in /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d \
               /usr/local/nvidia/share/vulkan/icd.d /usr/local/nvidia /usr/lib/x86_64-linux-gnu/nvidia \
               /usr/lib/nvidia /usr/lib64/nvidia /opt/nvidia; do
        [ -d "$dir" ] || continue
        icd="$(find "$dir" -maxdepth 4 -name 'nvidia_icd*.json' 2>/dev/null | head -n 1)"
        if [ -n "$icd" ]; then
            export VK_DRIVER_FILES="$icd"
            break
        fi
    done
fi
echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-<unset: loader default search path>}"

{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -a)"
    echo "load: $(uptime)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "nvidia-smi: not available"
    "$PY" --version
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(numpy|cuda-bindings|cuda-pathfinder|nvidia-cuda-nvrtc|cupy|nvmath|vulkan|cffi|flare-runtime) ' || true
    echo "libvulkan: $(ldconfig -p 2>/dev/null | grep -m1 'libvulkan\.so\.1' || echo none)"
    echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-}"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

cd /tmp  # import flare from the install, not from the source folders
TESTS="$ROOT/tests"

# --- 3. probe and tests ------------------------------------------------------------------
step probe 30 "" "$PY" -c '
from flare.core.plugin_manager import get_plugin_manager
for name, spec in get_plugin_manager().backends().items():
    r = spec.backend.probe()
    state = "usable" if r.usable else "UNUSABLE"
    print(f"{name}: {state} - {r.reason}")
from flare.backends.cuda.backend import CudaBackend
raise SystemExit(0 if CudaBackend.probe().usable else 1)
'
# (--require-backends takes an optional value: always give it one, or it eats the next path)
export FLARE_REQUIRE_CUDA=1
# (the GPU-kind tests only: the emulator, the stand-in driver and the NVRTC matrix need no GPU
# and run in CI)
step cuda-tests 200 tests.log "$PY" -m pytest -q -rs -p no:cacheprovider --rootdir="$ROOT" \
    --backends=cpu,cuda --require-backends=cpu,cuda -k "not emulated and not export_tuning and not compile_for" \
    "$TESTS"/test_cuda_device.py "$TESTS"/test_cuda_kernels.py "$TESTS"/test_cuda_probe.py "$TESTS"/test_cuda_quant.py
step conformance 90 tests.log "$PY" -m pytest -q -rs -p no:cacheprovider \
    --backends=cpu,cuda,vulkan --require-backends=cpu,cuda,vulkan --pyargs flare.plugins.testing.conformance

# --- 4. benchmarks ---------------------------------------------------------------------------
step bench-matmul 75 "" "$PY" "$ROOT/bench/cuda_matmul.py" --sizes 256,1024,4096 --variants --out "$OUT/bench-matmul.json"
if [ -f "$ROOT/bench/gpu_kernels.py" ]; then
    step bench-e2e 100 "" bash -c "'$PY' '$ROOT/bench/gpu_kernels.py' --backends cpu,cuda,vulkan --sizes 128,256,512 \
        --json > '$OUT/bench-e2e.json'; rc=\$?; cat '$OUT/bench-e2e.json'; exit \$rc"
else
    RESULTS+=("bench-e2e      FAIL (bench/gpu_kernels.py is not in this tree)")
fi
step bench-graph 30 "" "$PY" "$ROOT/bench/cuda_graph_replay.py" --out "$OUT/bench-graph.json"
step bench-quant 30 "" "$PY" "$ROOT/bench/cuda_quant.py" --n 4096 --k 4096 --rows 1,128 --repeats 10 \
    --out "$OUT/bench-quant.json"

# --- summary -------------------------------------------------------------------------------------
status=0
{
    echo "gpu-check $(date -u +%FT%TZ)  load: $(uptime)"
    for line in "${RESULTS[@]}"; do
        echo "$line"
        case "$line" in *FAIL*) status=1 ;; esac
    done
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit "$status"
