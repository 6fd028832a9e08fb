# Session 35: the last partial wave's cost (H=32 against H=33, both masks), then where the
# deterministic non-causal backward's energy goes (ordered_ablate.py).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" --causal; do
  echo "== wave_tail $c"
  timeout -k 5 ${TAIL_S:-150} python3 benchmarks/scratch/wave_tail.py $c --rounds ${ROUNDS:-5} 2>&1 \
    | grep -v -i warn | tail -6
done | tee $OUT/tail.log
echo "== ordered_ablate" | tee $OUT/ablate.log
timeout -k 5 ${ABL_S:-240} python3 benchmarks/scratch/ordered_ablate.py --rounds ${ROUNDS:-5} 2>&1 \
  | grep -v -i warn | tail -20 | tee -a $OUT/ablate.log
