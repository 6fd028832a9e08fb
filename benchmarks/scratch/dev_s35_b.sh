# Session 35: dq_pairs (clusters of two CTAs summing their dQ before one reduction): its GPU
# test, then the headline's non-causal fwd+bwd against the default, under both lowerings.
. "$(dirname "$0")/../device_env.sh"
gpu_test_groups ${TEST_S:-240} "${TESTS:-test_paired_dq_is_reproducible_and_matches}"
echo "== bwd_config_ab" | tee $OUT/ab.log
timeout -k 5 ${AB_S:-300} python3 benchmarks/scratch/bwd_config_ab.py --rounds ${ROUNDS:-5} \
  ${VARIANTS:-dq_pairs=true dq_pairs=true,semantics=lane semantics=lane} 2>&1 \
  | grep -v -i warn | tail -${TAIL:-16} | tee -a $OUT/ab.log
