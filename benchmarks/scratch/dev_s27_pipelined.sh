# Session 27: the one-pass backward with dq_pipelined: GPU tests first (stop on failure),
# then the kernel and fwd+bwd timings (onepass_pipelined.py), both masks.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "Pipelined or (mosaic_backward_matches_reference and (backward7 or backward8 or backward0))" 2>&1 \
  | grep -v "^E1124\|^external\|^$" | tail -15 | tee $OUT/pipelined-tests.log
grep -q " passed" $OUT/pipelined-tests.log && ! grep -q "failed\|error" $OUT/pipelined-tests.log || exit 1
for c in "" "--causal"; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 benchmarks/scratch/onepass_pipelined.py --rounds 5 $c \
    > $OUT/pipelined-raw$c.log 2>&1
  grep -i -E "spill" $OUT/pipelined-raw$c.log | sort | uniq -c | head > $OUT/pipelined-ptxas$c.log
  grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
    $OUT/pipelined-raw$c.log | tee $OUT/pipelined$c.log | tail -25
done
