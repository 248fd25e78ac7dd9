#!/usr/bin/env bash
# The side-by-side figures of the closing notes, on a quiet machine (no tests running):
#   bash bench/side_by_side.sh ROUND GROUP... (groups: silero minilm moe prefetch smol serve load piper cold)
# Each pair is `flare bench A B --blocks 2` (A B B A); the B/A lines go to $FLARE_BENCH_OUT (default /tmp),
# the whole tables to the same name with .full.
set -u
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1
round=$1; shift
out=${FLARE_BENCH_OUT:-/tmp}/side-by-side-r$round-$(date +%H%M).txt
# pair A B LABEL [extra flare bench arguments]
pair() { echo "=== $1 vs $2 ($3) ${4:-}" | tee -a $out; timeout 1200 flare bench "$1" "$2" --blocks 2 ${4:-} --no-progress --json /tmp/b.json 2>&1 | tee -a ${out%.txt}.full | grep -E "B/A|│ +[0-9]+ │|identical|DIFFERENT|median|ratio|accept|not comparable" | tee -a $out; }
C=bench/configs
for g in "$@"; do case $g in
 silero) pair $C/silero_onnxruntime.toml $C/silero_flare_cpu.toml t1; pair $C/silero_onnxruntime_t2.toml $C/silero_flare_cpu_t2.toml t2;;
 minilm) pair $C/minilm_onnxruntime_b1.toml $C/minilm_flare_b1.toml t1; pair $C/minilm_onnxruntime_b1_t2.toml $C/minilm_flare_b1_t2.toml t2
         pair $C/minilm_onnxruntime_b32.toml $C/minilm_flare_b32.toml t1; pair $C/minilm_onnxruntime_b32_t2.toml $C/minilm_flare_b32_t2.toml t2
         pair $C/minilm_flare_b32.toml $C/minilm_flare_b32_t2.toml scaling;;
 moe) pair $C/moe_resident.toml $C/moe_resident_t2.toml scaling; pair $C/moe_resident_small.toml $C/moe_resident_small_t2.toml scaling-small
      # staging pairs at 8 requests a run: at the default 2 a run is ~0.1 s and the ratio swings with any noise
      pair $C/moe_resident.toml $C/moe_offload.toml offload "--requests 8"
      pair $C/moe_resident.toml $C/moe_offload_12slots.toml offload-12slots "--requests 8"
      pair $C/gguf_moe_resident.toml $C/gguf_moe_offload.toml gguf-offload "--requests 8";;
 prefetch) pair $C/moe_resident.toml $C/moe_offload_prefetch.toml offload-prefetch "--requests 8"
      pair $C/gguf_moe_resident.toml $C/gguf_moe_offload_prefetch.toml gguf-offload-prefetch "--requests 8";;
 smol) pair $C/smollm2_decode_llamacpp_t1.toml $C/smollm2_decode_cpu_t1.toml t1; pair $C/smollm2_decode_llamacpp_t2.toml $C/smollm2_decode_cpu_t2.toml t2
       pair $C/smollm2_prefill_llamacpp_t1.toml $C/smollm2_prefill_cpu_t1.toml t1; pair $C/smollm2_prefill_llamacpp_t2.toml $C/smollm2_prefill_cpu_t2.toml t2
       echo "=== fresh-process RSS decode t1" | tee -a $out; timeout 900 python bench/fresh_rss.py $C/smollm2_decode_llamacpp_t1.toml $C/smollm2_decode_cpu_t1.toml --blocks 1 2>&1 | tail -2 | tee -a $out;;
 serve) pair $C/serve_smollm2_repeat_plain.toml $C/serve_smollm2_repeat_ngram.toml repeat; pair $C/serve_smollm2_nocopy_plain.toml $C/serve_smollm2_nocopy_ngram.toml nocopy
        pair $C/serve_smollm2_unique_cache_off.toml $C/serve_smollm2_unique_cache_on.toml cache0hit "--requests 8"
        echo "=== cache at 0% hits, both servers side by side" | tee -a $out; timeout 1200 python bench/serve_cache_cost_http.py --requests 30 --json ${out%.txt}-cache0http.json 2>&1 | grep -E "B / A|same greedy" | tee -a $out
        echo "=== prefix smollm2" | tee -a $out; timeout 1200 python bench/serve_prefix.py --model smollm2 --rounds 2 --json ${out%.txt}-prefix.json 2>&1 | tail -30 | tee -a $out;;
 load) echo "=== serve_load 32 chat clients 60 s" | tee -a $out; timeout 1500 python bench/serve_load.py --model smollm2 --chat --clients 32 --seconds 60 --json ${out%.txt}-load.json > ${out%.txt}-load.log 2>&1; cat ${out%.txt}-load.json | tee -a $out;;
 piper) pair $C/piper_onnx_onnxruntime.toml $C/piper_onnx_flare.toml t1; echo "=== piper_onnx.py" | tee -a $out; timeout 900 python bench/piper_onnx.py 2>&1 | tail -6 | tee -a $out;;
 cold) bash bench/cold_start.sh 2>&1 | tee -a $out;;
esac; done
echo "results in $out"
