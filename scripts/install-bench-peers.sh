#!/usr/bin/env bash
# Bench peers that are too slow to build in CI: llama.cpp (through llama-cpp-python, which
# vendors it) for `flare bench` on GGUF models. Builds a wheel once from the source
# distribution and caches it (FLARE_CACHE_DIR or ~/.cache/flare, wheels/), then installs it.
#
# The build matches this CPU without -march=native: the AVX/AVX2/FMA/F16C/AVX-512/VNNI
# switches are set from /proc/cpuinfo, and AMX is always off (these virtual machines report
# AMX but fault on its tile instructions). A cached wheel is reused only when it was built for
# the same switches (they are part of its folder name).
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
AVX=$(has avx); AVX2=$(has avx2); FMA=$(has fma); F16C=$(has f16c)
AVX512=$(has avx512f); VBMI=$(has avx512vbmi); VNNI=$(has avx512_vnni); BF16=$(has avx512_bf16)
AVXVNNI=$(has avx_vnni)
args="-DGGML_NATIVE=OFF -DGGML_AVX=$AVX -DGGML_AVX2=$AVX2 -DGGML_FMA=$FMA -DGGML_F16C=$F16C"
args="$args -DGGML_AVX512=$AVX512 -DGGML_AVX512_VBMI=$VBMI -DGGML_AVX512_VNNI=$VNNI -DGGML_AVX512_BF16=$BF16"
args="$args -DGGML_AVX_VNNI=$AVXVNNI -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
args="$args -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF"
tag=$(echo "$VERSION $args" | sha1sum | cut -c1-12)
cache=${FLARE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/flare}/wheels/llama-cpp-python-$tag
if ! ls "$cache"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION (llama.cpp, CPU only; several minutes) into $cache"
    echo "  cmake: $args"
    mkdir -p "$cache.tmp"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        $PY -m pip wheel -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -w "$cache.tmp"
    rm -rf "$cache" && mv "$cache.tmp" "$cache"
fi
$PY -m pip install -q --no-deps "$cache"/llama_cpp_python-*.whl
# its own (light) runtime dependencies, without letting pip rebuild it
$PY -m pip install -q "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3" "numpy>=1.20"
$PY -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
