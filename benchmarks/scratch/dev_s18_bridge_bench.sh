# Session 18: the bridged loss at llama3-8b with the queued timing (torch_bridge.py's
# queued_ms): the light setting alternated three times with Liger-Kernel, beside the floor,
# the default and the same JAX function called directly.
. "$(dirname "$0")/../device_env.sh"
BENCH_S=${BENCH_S:-580} LOG=bridge.log . "$(dirname "$0")/bridge_loss_vs_liger.sh"
