# Session 24: the default (exp GEMM on Mosaic, dx and dW on cuBLAS) against the all-Mosaic
# exp_logits setting on every GPU shape set, and on llama3-8b in both weight layouts: is the
# all-Mosaic setting a default everywhere it runs?
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
ALL=memeff:pallas_gpu:gemms=logits+dx+dw:dw=tma_add
for set in ${SETS:-llama3-8b gemma2-2b gpt2}; do
  providers=floor,memeff,$ALL${MORE:-}
  if [ $set = llama3-8b ]; then providers=$providers,memeff:pallas_gpu:layout=vd,$ALL:layout=vd${MORE_VD:-}; fi
  echo "== $set"
  timeout ${BENCH_S:-200} python3 benchmarks/linear_cross_entropy.py --set $set --rounds ${ROUNDS:-3} \
    --providers $providers --out $OUT/linear_cross_entropy.jsonl 2>&1 | grep -v -i warn \
    | grep -v "^  File\|^    " | tee -a $OUT/sets.log | tail -8
done
