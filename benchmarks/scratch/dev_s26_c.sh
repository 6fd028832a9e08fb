# Session 26: ping-pong on own slots (each warpgroup waits on and releases only its own
# tiles' slots where K steps are a multiple of twice the slots): GPU tests, the dW GEMM alone
# over 16 chunks, the loss with the dW and the exp GEMMs on ping-pong tiles.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/ops/test_mosaic_gemm.py -k "pingpong" --tb=short > $OUT/pp-tests-full.log 2>&1
rc=$?; grep -v "^E1124\|^===\|^external\|^$" $OUT/pp-tests-full.log | tail -25 | tee $OUT/pp-tests.log
[ $rc = 0 ] || exit $rc
timeout 170 python3 benchmarks/scratch/lce_dw_accumulate.py --rounds 5 --no-power \
  --tiles ${TILES:-pp128_s4_ep64,pp128_s4,pp192_s4_ep64,pp128_s4_nocl} \
  --variants "cublas store,mosaic tma store,mosaic tma" 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/pp-dw-alone.log
timeout 150 python3 benchmarks/scratch/dx_gemm_tiles.py --gemm dw_tma_dv --loss ${DW_LOSS:-pp128_s4_ep64,pp128_s4,pp192_s4_ep64} --rounds 5 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/pp-dw-loss.log
timeout 100 python3 benchmarks/scratch/dx_gemm_tiles.py --gemm logits --loss pp128_s4_ep64 --rounds 5 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/pp-logits-loss.log
