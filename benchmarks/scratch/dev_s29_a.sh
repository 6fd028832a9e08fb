# Session 29: the GPU features suites after key_tiles (K/V operands at an opaque offset, in
# the one-pass and the dK/dV-only kernels), nine pytest processes side by side (compiles are
# the time; the GPU is shared); one log per group, then each group's summary line.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
groups=("TestMosaicGpuFeaturesDeterministic and not D64 and not D256" "TestMosaicGpuPipelinedDq"
  "TestMosaicGpuFeaturesDeterministicD64" "TestMosaicGpuFeaturesDeterministicD256"
  "TestMosaicGpuFeaturesD64 and not Deterministic" "TestMosaicGpuFeaturesD256 and not Deterministic"
  "wide_step_dkv_kernel_matches and 2-256-384" "wide_step_dkv_kernel_matches and 1-384-256"
  "bitwise_reproducible or d64_and_lse or d256_column_split")
gpu_test_groups ${TEST_S:-230} "${groups[@]}"
