# Session 22: the exp_logits GEMM's tiles (exp_gemm_tiles.py), then the full-provider
# llama3-8b run for the README with exp_logits as the default.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T1:-240} python3 benchmarks/scratch/exp_gemm_tiles.py --rounds 5 ${LOSS:+--loss $LOSS} 2>&1 \
  | grep -v -i warn | tee $OUT/tiles.log
if [ "${FULL:-0}" = 1 ]; then
  timeout 330 python3 benchmarks/linear_cross_entropy.py --set llama3-8b --rounds 3 \
    --providers floor,memeff,memeff:pallas_gpu:exp_logits=0,memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add:fused_lse=1,jax_naive,torch_compile,liger \
    --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn | tee $OUT/lce.log | tail -12
fi
