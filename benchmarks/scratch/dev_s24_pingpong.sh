# Session 24: the exp_logits GEMM on the ping-pong schedule (each warpgroup's exponentials
# under the other's main loop), alone and inside the loss (default and all-Mosaic settings).
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks/scratch
timeout 200 python3 exp_gemm_tiles.py --rounds 5 --variants ${VARIANTS:-base,pp4,pp5,pp6,pp5_cluster_m,pp5_minor_m_band8,pp5_inflight0} \
  --loss ${LOSS:-pp4,pp5,pp6} 2>&1 | grep -v -i warn | tee $OUT/pp.log
timeout 150 python3 exp_gemm_tiles.py --rounds 5 --variants base --all-mosaic \
  --loss ${LOSS_ALL:-pp5,pp6} 2>&1 | grep -v -i warn | tee $OUT/pp-all.log
