# Session 30: the headline half SET (headline-noncausal or headline-causal) with dq_ordered as
# the deterministic default, then GPU test groups (TEST_GROUPS, ';'-separated -k expressions)
# side by side in the time left (TEST_S seconds).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout -k 5 ${BENCH_S:-330} python3 benchmarks/flash_attention.py --set $SET --rounds 3 \
  --providers memeff,memeff:nondeterministic,cudnn,tokamax:mosaic \
  --out $OUT/flash_attention.jsonl 2>&1 | grep -v -i warn | tee $OUT/headline.log | tail -24
f=tests/ops/flash_attention/test_pallas_mosaic_gpu.py
IFS=';' read -ra groups <<< "${TEST_GROUPS:-}"
i=0
for g in "${groups[@]}"; do
  timeout -k 5 ${TEST_S:-200} python3 -m pytest -q -rf -m gpu $f -k "$g" -p no:cacheprovider \
    > /tmp/t$i.log 2>&1 &
  i=$((i+1))
done
wait
i=0
for g in "${groups[@]}"; do
  summary=$(grep -E ' (passed|failed|error)' /tmp/t$i.log | tail -1)
  echo "== $g: ${summary:-no summary (timed out)}"
  grep -E '^[.FEsx]+( |$)' /tmp/t$i.log | head -3
  grep -E "^FAILED|^ERROR|Error:|error:" /tmp/t$i.log | head -8
  i=$((i+1))
done | tee $OUT/tests.log
[ $i -gt 0 ] && cat /tmp/t*.log | grep -v "^E1124\|^external\|^$" | tail -300 > $OUT/tests-full.log
true
