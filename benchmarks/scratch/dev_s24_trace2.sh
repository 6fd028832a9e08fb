# Session 24: kernels under load of the new default (all three GEMMs on Mosaic at llama3-8b "dv",
# the dW tile of the running sum prefetched into L2) beside cuBLAS's dx and dW.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
MODES=memeff CHUNK=1024 REPS=8 TAG=-default timeout 200 \
  bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | tee $OUT/trace.log | head -24
MODES=memeff CHUNK=1024 REPS=8 LCE_EXP=1 LCE_DW=weight TAG=-cublas timeout 200 \
  bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | tee -a $OUT/trace.log | head -24
