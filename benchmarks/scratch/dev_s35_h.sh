# Session 35: dq_send_warps=2 (the even and odd steps' dQ sends by two warps): its GPU test,
# then the headline fwd+bwd against the default, both masks.
. "$(dirname "$0")/../device_env.sh"
gpu_test_groups ${TEST_S:-150} "${T1:-two_send_warps_give_one_warps_bits}"
for c in "" --causal; do
  echo "== bwd_config_ab $c" | tee -a $OUT/ab.log
  timeout -k 5 ${AB_S:-150} python3 benchmarks/scratch/bwd_config_ab.py $c --rounds ${ROUNDS:-5} \
    ${VARIANTS:-dq_send_warps=2} 2>&1 | grep -v -i warn | tail -${TAIL:-9} | tee -a $OUT/ab.log
done
