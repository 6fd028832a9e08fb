# Session 33: the persistent forward's GPU tests after the grid fix (the grid's and the
# persistent's bits, the default forward's features: persistent at D = 128 without a mask),
# then grid against persistent, dense, in more rounds.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
gpu_test_groups ${TEST_S:-280} "persistent_forward_gives_the_grids_bits" \
  "TestMosaicGpuFeatures and not D64 and not D256 and not Deterministic" \
  "TestMosaicGpu and (test_matches_reference or wide_heads)" "TestMosaicGpuPersistentForward"
SHAPES=${SHAPES:-4x4096x32} ROUNDS=${ROUNDS:-7} MASKS=dense PROVIDERS=grid,persistent,cudnn \
  timeout -k 5 ${TIME_S:-200} python3 benchmarks/scratch/fwd_persistent.py 2>&1 \
  | grep -v "^E11\|^W11\|^I11" | tail -20 | tee $OUT/fwd_persistent.log
