# Session 35: more of ordered_ablate.py: the dSᵀ exchange's lockstep (non-causal), and every
# cut of the causal kernel.
. "$(dirname "$0")/../device_env.sh"
echo "== ordered_ablate non-causal" | tee $OUT/ablate.log
timeout -k 5 ${ABL_S:-150} python3 benchmarks/scratch/ordered_ablate.py --rounds ${ROUNDS:-5} \
  --cuts "${CUTS_NC:-no dS wait;no exp2}" 2>&1 | grep -v -i warn | tail -8 | tee -a $OUT/ablate.log
echo "== ordered_ablate causal" | tee -a $OUT/ablate.log
timeout -k 5 ${ABL_S:-300} python3 benchmarks/scratch/ordered_ablate.py --causal --rounds ${ROUNDS:-5} \
  ${CUTS_C:+--cuts "$CUTS_C"} 2>&1 | grep -v -i warn | tail -20 | tee -a $OUT/ablate.log
