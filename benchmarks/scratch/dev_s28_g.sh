# Session 28: the tuned one-pass backward's SASS (non-causal), to find where ptxas spills:
# the Mosaic GPU dump flags of the installed jaxlib, then the kernel compiled once with
# them; dumps under $OUT/dump (or on stdout).
. "$(dirname "$0")/../device_env.sh"
so=$(python3 -c "import jax_plugins, os; print(os.path.dirname(jax_plugins.__path__[0]))" 2>/dev/null)
find / -name "*.so" -path "*jax*" 2>/dev/null | xargs strings 2>/dev/null | grep -E "^MOSAIC_GPU_[A-Z_]+$" | sort -u
mkdir -p $OUT/dump
MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/dump timeout 200 python3 - > $OUT/sass-stdout.txt 2>&1 <<'PY'
import sys
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks/scratch")
import jax, jax.numpy as jnp
from _measure import attention_backward_problem
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb
*_, ct, opts, res, stats = attention_backward_problem(False)
cfg = mb.MosaicBackwardConfig.tuned(128, False)
f = jax.jit(lambda res, ct, stats: mb.backward(opts, cfg, res, (ct, jnp.zeros_like(res.lse)), stats=stats)[:3])
jax.block_until_ready(f(res, ct, stats))
print("done")
PY
ls -la $OUT/dump | head; wc -l $OUT/sass-stdout.txt; grep -c -E "STL|LDL" $OUT/sass-stdout.txt
