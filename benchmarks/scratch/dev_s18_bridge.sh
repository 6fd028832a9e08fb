# Session 18: where the bridged light setting's time goes (bridge_overhead.py), with Liger.
. "$(dirname "$0")/../device_env.sh"
python3 - <<'PY' | tee $OUT/torch-custom-ops.txt
import inspect, torch._library.custom_ops as c
src = inspect.getsource(c)
i = src.find("def backend_impl")
print(torch.__version__); print(src[i - 200:i + 2500])
PY
ROUNDS=${ROUNDS:-5} timeout ${BENCH_S:-400} python3 benchmarks/scratch/bridge_overhead.py 2>&1 \
  | grep -v -i warn | tee $OUT/bridge-overhead.log
