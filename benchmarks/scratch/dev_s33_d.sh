# Session 33: the backward skipping the steps whose query block sees none of a warpgroup's
# keys (_SKIP_UNSEEN), against the kernel before (bit for bit, then time), causal; then
# the GPU tests of the masked pipelined kernels.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout -k 5 ${CA_S:-150} python3 benchmarks/scratch/onepass_ordered.py --rounds 5 --causal \
  --variants "send warp+two slots,send warp+two slots (no skip),arrival,arrival (no skip)" \
  2>&1 | grep -E " ms |identical|Error|error" | tee $OUT/skip.log
gpu_test_groups ${TEST_S:-300} "TestMosaicGpuOrderedDq and not D256 and not SendWarp and not Convert" \
  "TestMosaicGpuFeaturesDeterministic and not D64 and not D256" "TestMosaicGpuPipelinedDq" \
  "mosaic_backward_matches_reference and True" "TestMosaicGpuOrderedDqSendWarp"
