# Session 35: the step's K/V offset loaded a step ahead (key_tiles(z)): GPU tests of the
# backward, then A/B against the load at its use (ordered_ablate's "z at use"), both masks.
. "$(dirname "$0")/../device_env.sh"
gpu_test_groups ${TEST_S:-200} "${T1:-default_backward_is_bitwise or ordered_backward_is_bitwise or fused_delta_is_reproducible}" "${T2:-TestMosaicGpuFeaturesDeterministic}"
for c in "" --causal; do
  echo "== ordered_ablate $c" | tee -a $OUT/ab.log
  timeout -k 5 ${ABL_S:-150} python3 benchmarks/scratch/ordered_ablate.py $c --rounds ${ROUNDS:-7} \
    --cuts "${CUTS:-z at use}" 2>&1 | grep -v -i warn | tail -6 | tee -a $OUT/ab.log
done
