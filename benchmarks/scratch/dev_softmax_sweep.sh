# The softmax-gradient kernel's tiles at 512-token chunks: alone (lce_kernel_sweep.py), then the
# most different in the whole all-Mosaic loss ("vd", dW by TMA reduce-add). ncu showed ours at
# 127 registers/thread (25% occupancy, 2 programs of 8 warps per SM, 37% L2 hits) against
# Liger's 64 (one 32-warp program per SM, 57% L2 hits).
. "$(dirname "$0")/../device_env.sh"
LCE_C=512 timeout 200 python3 benchmarks/scratch/lce_kernel_sweep.py num_stages=1 num_stages=3 \
  block_v=4096,num_warps=4 block_v=4096,num_warps=8 block_v=16384,num_warps=16 \
  block_v=32768,num_warps=32 block_v=16384,num_warps=16,num_stages=1 \
  block_v=32768,num_warps=32,num_stages=1 num_warps=16 num_warps=16,num_stages=1 l2_hints=0 \
  block_rows=2,block_v=4096 block_v=4096,num_warps=8,num_stages=1 2>&1 | grep -v -i warning
T='impl.dw_accumulation="tma_add"'
VARIANTS="$T;$T+kernel.num_stages=1;$T+kernel.block_v=16384+kernel.num_warps=16+kernel.num_stages=1;$T+kernel.block_v=32768+kernel.num_warps=32+kernel.num_stages=1;$T+kernel.num_warps=16+kernel.num_stages=1" \
  LAYOUT=vd CHUNK=512 ROUNDS=4 timeout 260 python3 benchmarks/scratch/lce_gemm_variants.py 2>&1 | grep -v Warning
