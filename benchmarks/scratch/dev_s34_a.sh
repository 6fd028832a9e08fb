# Session 34: where one headline fwd+bwd's GPU time goes, kernel by kernel (ours and cuDNN,
# both masks; ptxas's spills of every Mosaic kernel compiled), then the persistent forward's
# GPU tests after its K/V stream's waits moved under one condition with their copies.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
MOSAIC_GPU_DUMP_PTXAS=1 timeout -k 5 ${KERNELS_S:-200} python3 benchmarks/scratch/attn_kernels.py \
  --calls 20 > /tmp/kernels.log 2>&1
grep -E "^==|^  " /tmp/kernels.log | tee $OUT/kernels.log
grep -E "spill|C75|Used|Compiling entry" /tmp/kernels.log > $OUT/ptxas.log
tail -5 /tmp/kernels.log
IFS=';' read -ra groups <<< "${TEST_GROUPS:-}"
gpu_test_groups ${TEST_S:-200} "${groups[@]}"
