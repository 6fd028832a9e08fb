# Session 30: the headline half SET (headline-noncausal or headline-causal) with dq_ordered as
# the deterministic default, then GPU test groups (TEST_GROUPS, ';'-separated -k expressions)
# side by side in the time left (TEST_S seconds).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout -k 5 ${BENCH_S:-330} python3 benchmarks/flash_attention.py --set $SET --rounds 3 \
  --providers memeff,memeff:nondeterministic,cudnn,tokamax:mosaic \
  --out $OUT/flash_attention.jsonl 2>&1 | grep -v -i warn | tee $OUT/headline.log | tail -24
IFS=';' read -ra groups <<< "${TEST_GROUPS:-}"
gpu_test_groups ${TEST_S:-200} "${groups[@]}"
