# Session 34: fused_delta (Δ in the backward kernel) against the XLA pass and cuDNN at the
# headline, both masks, then its GPU tests and the ordered kernel's bitwise test.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" --causal; do
  echo "== fused_delta_ab $c"
  timeout -k 5 ${AB_S:-150} python3 benchmarks/scratch/fused_delta_ab.py $c --rounds ${ROUNDS:-5} 2>&1 \
    | grep -v -i warn | tail -12
done | tee $OUT/ab.log
IFS=';' read -ra groups <<< "${TEST_GROUPS:-}"
gpu_test_groups ${TEST_S:-200} "${groups[@]}"
