# Session 22: exp_logits beside the chunked design's pure-GEMM floor (lce_decompose.py at
# 1,024 tokens, interleaved rounds, then power), and its kernels traced under load.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python3 benchmarks/scratch/lce_decompose.py --rounds ${ROUNDS:-3} --chunks ${CHUNKS:-1024} \
  --exp ${EXP:-exp,exp-dwtma} --seconds 2 2>&1 | grep -v -i warning | tee $OUT/decompose.log
if [ "${TRACE:-1}" = 1 ]; then
  MODES=memeff CHUNK=1024 REPS=5 LCE_EXP=1 TAG=-exp timeout 150 \
    bash benchmarks/scratch/dev_lce_trace.sh 2>&1 | tee $OUT/exp-trace.log | head -14
fi
