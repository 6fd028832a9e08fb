# Session 21: K as the register operand of the dK/dV kernel's Sᵀ WGMMA: GPU tests, then
# the kernel alone against the tuned config (headline; non-causal, then causal).
. "$(dirname "$0")/../device_env.sh"
MOSAIC_GPU_DUMP_PTXAS=1 timeout 240 python3 benchmarks/scratch/dkv_k_registers.py --rounds 7 \
  > $OUT/kregs-raw.log 2>&1
grep -i -E "spill|registers|^compiling" $OUT/kregs-raw.log | head -60 > $OUT/kregs-ptxas.log
grep -v -i -E "ptxas|warn|spill|registers|^$|bytes stack|Compiling entry|Function properties" \
  $OUT/kregs-raw.log | tee $OUT/kregs.log | tail -30
timeout 240 python3 -m pytest -q -m gpu tests/ops/flash_attention/test_pallas_mosaic_gpu.py \
  -k "wide_step_dkv_kernel_matches_reference" 2>&1 | tail -3 | tee $OUT/kregs-tests.log
