#!/usr/bin/env bash
# Cold and warm start, wall seconds of the whole command (GNU time), two rounds:
#   flare run minilm-l6 / silero-vad --backends vulkan with empty XDG_CACHE_HOME and FLARE_CACHE_DIR
#   (then warm, same folders), and the first CPU `flare run silero-vad` with an empty Flare cache
#   (counting its "building" progress lines) against a run on the install's cache.
#     bash bench/cold_start.sh
set -u
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1
wall() { { /usr/bin/time -f "%e" "$@" >/dev/null 2>/tmp/flare-cold.err; } 2>&1; tail -1 /tmp/flare-cold.err; }
for round in 1 2; do
  for model in minilm-l6 silero-vad; do
    if [[ $model == minilm-l6 ]]; then args=(minilm-l6 --backends vulkan "The weather is lovely today." "It's so sunny outside!")
    else args=(silero-vad --backends vulkan); fi
    x=$(mktemp -d); f=$(mktemp -d)
    cold=$(XDG_CACHE_HOME=$x FLARE_CACHE_DIR=$f wall flare run "${args[@]}")
    warm=$(XDG_CACHE_HOME=$x FLARE_CACHE_DIR=$f wall flare run "${args[@]}")
    echo "round $round: flare run $model --backends vulkan: cold ${cold} s, warm ${warm} s"
    rm -rf "$x" "$f"
  done
  f=$(mktemp -d)
  cold=$(FLARE_CACHE_DIR=$f wall flare run silero-vad); lines=$(grep -c building /tmp/flare-cold.err)
  warm=$(wall flare run silero-vad)
  echo "round $round: flare run silero-vad (cpu): empty Flare cache ${cold} s (${lines} progress line(s)); after the install's build ${warm} s"
  rm -rf "$f"
done
