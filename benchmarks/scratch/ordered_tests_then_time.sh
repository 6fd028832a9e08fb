# dq_ordered on the GPU, the body of dev_s30_a.sh, dev_s30_b.sh and dev_s31_a.sh: test groups
# (TEST_GROUPS, ';'-separated -k expressions, TEST_S seconds) side by side, then
# onepass_ordered.py at the headline, both masks: the variants NC (non-causal, NC_S seconds)
# and CA (causal, CA_S) if $OUT/tests.log matches GATE (the ordered kernel's test finished;
# a hang would eat the call), else SAFE_NC and SAFE_CA. ptxas's reports per variant.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
IFS=';' read -ra groups <<< "$TEST_GROUPS"
gpu_test_groups ${TEST_S:-170} "${groups[@]}"
if grep -q "$GATE" $OUT/tests.log; then nc=$NC; ca=$CA; else nc=$SAFE_NC; ca=$SAFE_CA; fi
for c in "" "--causal"; do
  if [ -z "$c" ]; then vs=$nc; lim=$NC_S; else vs=$ca; lim=$CA_S; fi
  MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 5 $lim python3 benchmarks/scratch/onepass_ordered.py \
    --rounds 3 --variants "$vs" $c > /tmp/raw$c.log 2>&1
  grep -i -E "bytes stack frame|serializ|C75[0-9][0-9]" /tmp/raw$c.log > $OUT/ptxas$c.log
  grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
    /tmp/raw$c.log | tee $OUT/ordered$c.log
done
