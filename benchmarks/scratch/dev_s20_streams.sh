# Session 20: side-stream ordering tests of the bridge, and whether they could fail.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/interop 2>&1 | grep -E "Error|assert|passed|failed" | tail -12 | tee $OUT/interop-gpu-tests.log
timeout 100 python3 benchmarks/scratch/stream_race_check.py 2>&1 | grep -v -i warning | tee $OUT/stream-race.log
