# Session 31 (written in session 30): dq_ordered's send warp, two dQ slots and rotated walks (their
# bitwise test and features suite), then onepass_ordered.py at the headline, both masks; the
# ordered variants only if the bitwise test finished.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
f=tests/ops/flash_attention/test_pallas_mosaic_gpu.py
groups=("ordered_backward_is_bitwise and send_warp" "TestMosaicGpuOrderedDqSendWarp")
i=0
for g in "${groups[@]}"; do
  timeout -k 5 ${TEST_S:-190} python3 -m pytest -q -rf -m gpu $f -k "$g" -p no:cacheprovider \
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
cat /tmp/t*.log | grep -v "^E1124\|^external\|^$" | tail -300 > $OUT/tests-full.log
if grep -q "ordered_backward_is_bitwise and send_warp: .*in [0-9.]*s" $OUT/tests.log; then
  nc="arrival,ordered,send warp,send warp+two slots,all+rotate,pair"; ca="arrival,ordered,send warp+two slots,pair"
else
  nc="arrival,pair"; ca="arrival,pair"
fi
for c in "" "--causal"; do
  if [ -z "$c" ]; then vs=$nc; lim=240; else vs=$ca; lim=150; fi
  MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 5 $lim python3 benchmarks/scratch/onepass_ordered.py \
    --rounds 3 --variants "$vs" $c > /tmp/raw$c.log 2>&1
  grep -i -E "bytes stack frame|serializ|C75[0-9][0-9]" /tmp/raw$c.log > $OUT/ptxas$c.log
  grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
    /tmp/raw$c.log | tee $OUT/ordered$c.log
done
