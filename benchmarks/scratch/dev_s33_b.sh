# Session 33: the persistent forward (MosaicConfig(persistent=True)) against the grid and
# cuDNN at the headline, both masks (bitwise check first), then its GPU tests.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
SHAPES=${SHAPES:-4x4096x32} ROUNDS=${ROUNDS:-5} timeout -k 5 ${TIME_S:-250} \
  python3 benchmarks/scratch/fwd_persistent.py 2>&1 | grep -v "^E11\|^W11\|^I11" \
  | tail -40 | tee $OUT/fwd_persistent.log
gpu_test_groups ${TEST_S:-270} "persistent_forward_gives_the_grids_bits" \
  "test_overlapped_forward_matches_reference and True" "TestMosaicGpuPersistentForward"
