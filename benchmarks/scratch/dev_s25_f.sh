# Session 25: the first chunk of D tokens with its exponentials in dW's buffer (needs
# git apply benchmarks/scratch/patches/first_chunk_of_d.diff): GPU tests, then an A/B in one process.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 100 python3 -m pytest -q -m gpu tests/ops/test_mosaic_gemm.py -k "column" --tb=short 2>&1 | tail -${TAILN:-4} | tee $OUT/gemm-tests.log
timeout 300 python3 -m pytest -q -x -m gpu tests/ops/linear_cross_entropy \
  -k "${K1:-first_chunk or test_memory or exp_logits_matches}" --tb=short 2>&1 | tail -${TAILN:-4} | tee $OUT/lce-gpu-tests.log
timeout 250 python3 benchmarks/scratch/lce_flag_ab.py --flags ${FLAGS:-_FIRST_CHUNK_OF_D} --rounds ${ROUNDS:-7} 2>&1 | grep -v -i warn | tee $OUT/ab.log | tail -8
