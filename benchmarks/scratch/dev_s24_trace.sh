# Session 24: kernels under load, per chunk, of the floor, the default (exp GEMM on Mosaic,
# cuBLAS dx and dW +=) and the all-Mosaic exp_logits setting (0.248 GiB), llama3-8b "dv".
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
MODES="floor memeff" CHUNK=1024 REPS=8 LCE_EXP=1 TAG=-exp timeout 250 \
  bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | tee $OUT/trace.log | head -40
MODES=memeff CHUNK=1024 REPS=8 LCE_EXP=1 LCE_GEMMS=logits+dx+dw LCE_DW=tma_add TAG=-all timeout 200 \
  bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | tee -a $OUT/trace.log | head -40
