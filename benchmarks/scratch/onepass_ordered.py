"""The one-pass attention backward with its dq reductions in a fixed order (dq_ordered)
against the same kernel in arrival order and the deterministic default's pair (dK/dV-only
kernel and mosaic_gpu_dq's), at the headline (device only): each a whole backward from the
residuals (Δ, the float32 dq's zeroing where it has one, and the cast included).

    python benchmarks/scratch/onepass_ordered.py [--causal] [--rounds 5] [--kv-heads 8]
        [--variants arrival,ordered,pair]

Variants: "arrival" (the tuned one-pass kernel, deterministic=False), "ordered" (the same
with dq_ordered: the memory warpgroup sends dQ in rank order), "no waits" (ordered without
its semaphore waits: what the hand-off to the memory warpgroup costs by itself), "no
landing wait" (no waits, and the counter signalled once the tiles are read rather than
landed), "send warp", "two slots" and "send warp+two slots" (dq_send_warp, dq_buffers=2),
"all+rotate" (those and dq_rotate: no effect with a mask), "send warp+rotate" (one slot),
"all+rotate+convert" and "send warp+rotate+convert" (dq_convert: the last adders write
dq in bf16; checked against the same variant without it, bit for bit), "ordered dq_split" (dq_ordered
without dq_pipelined), and "pair". Run with
MOSAIC_GPU_DUMP_PTXAS=1 to see ptxas's spills and any WGMMA serialization per variant.
Checks that "ordered" gives identical bits on three calls, and its distance to "arrival".
"""
import argparse
import dataclasses
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch")
from _measure import attention_backward_problem, rounds_then_power, try_variant  # noqa: E402
from onepass_ablate import patched  # noqa: E402
from memeff_jax.ops.flash_attention import MosaicDqConfig  # noqa: E402
from memeff_jax.ops.flash_attention import PallasMosaicGpu  # noqa: E402
from memeff_jax.ops.flash_attention import mosaic_gpu_backward as mb  # noqa: E402

D = 128
_FULL = "        plgpu.barrier_wait(full)\n"
_WAIT = _FULL + '        plgpu.semaphore_wait(counter, rank, decrement=False, memory_scope="gpu")'
NO_WAITS = ((_WAIT,), _FULL + "        pass")
NO_LANDING = ((("      plgpu.wait_smem_to_gmem(0)  # landed: the next key block may add",),
               "      pass"), NO_WAITS)


def landing_exit():
  """mosaic_gpu_backward with its CTAs' last waits for their stores to land (before
  session 32), not only to have read shared memory."""
  src = inspect.getsource(mb).replace("_mosaic.wait_stores_read()", "plgpu.wait_smem_to_gmem(0)")
  return patched([], src=src)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--variants", default="", help="comma-separated names; default all")
  parser.add_argument("--kv-heads", type=int, default=None,
                      help="GQA: key heads (of 32); arrival is then the tuned GQA kernel")
  parser.add_argument("--shape", default=None,
                      help="B,T,H (D = 128); default the headline's 4,4096,32")
  args = parser.parse_args()
  wanted = set(args.variants.split(",")) if args.variants else None
  q, k, v, ct, opts, res, _ = attention_backward_problem(
      args.causal, kv_heads=args.kv_heads,
      **({} if args.shape is None else dict(shape=(*map(int, args.shape.split(",")), D))))
  cts = (ct, jnp.zeros_like(res.lse))
  gqa = args.kv_heads is not None and args.kv_heads < q.shape[2]
  tuned = mb.MosaicBackwardConfig.tuned(D, args.causal, gqa)
  # With GQA the ordered kernel is the MHA section's (a CTA per key head looping over its
  # query heads): the GQA one's CTA per query head adds dK and dV in arrival order.
  ordered = dataclasses.replace(mb.MosaicBackwardConfig.tuned(D, args.causal), dq_ordered=True)
  print(f"arrival: {tuned}", flush=True)
  fns, outs = {}, {}
  for name, module, cfg in (("arrival", mb, tuned), ("ordered", mb, ordered),
                            ("no waits", lambda: patched([NO_WAITS]), ordered),
                            ("no landing wait", lambda: patched(NO_LANDING), ordered),
                            ("send warp", mb, dataclasses.replace(ordered, dq_send_warp=True)),
                            ("two slots", mb, dataclasses.replace(ordered, dq_buffers=2)),
                            ("send warp+two slots", mb,
                             dataclasses.replace(ordered, dq_send_warp=True, dq_buffers=2)),
                            ("all+rotate", mb, dataclasses.replace(
                                ordered, dq_send_warp=True, dq_buffers=2, dq_rotate=True)),
                            ("all+rotate+convert", mb, dataclasses.replace(
                                ordered, dq_send_warp=True, dq_buffers=2, dq_rotate=True,
                                dq_convert=True)),
                            ("send warp+rotate", mb, dataclasses.replace(
                                ordered, dq_send_warp=True, dq_rotate=True)),
                            ("send warp+rotate+convert", mb, dataclasses.replace(
                                ordered, dq_send_warp=True, dq_rotate=True, dq_convert=True)),
                            ("ordered dq_split", mb,
                             dataclasses.replace(ordered, dq_pipelined=False)),
                            ("arrival+persistent", mb,
                             dataclasses.replace(tuned, persistent=True)),
                            ("send warp+two slots+persistent", mb, dataclasses.replace(
                                ordered, dq_send_warp=True, dq_buffers=2, persistent=True)),
                            ("all+rotate+persistent", mb, dataclasses.replace(
                                ordered, dq_send_warp=True, dq_buffers=2, dq_rotate=True,
                                persistent=True)),
                            ("arrival (landing exit)", landing_exit, tuned),
                            ("all+rotate (landing exit)", landing_exit, dataclasses.replace(
                                ordered, dq_send_warp=True, dq_buffers=2, dq_rotate=True)),
                            ("send warp+two slots (landing exit)", landing_exit,
                             dataclasses.replace(ordered, dq_send_warp=True, dq_buffers=2))):
    if wanted is not None and name not in wanted:
      continue
    module = module() if callable(module) else module  # a patched copy, built when wanted
    c = module.MosaicBackwardConfig(**dataclasses.asdict(cfg))
    # Δ and the row statistics inside, as the pair computes them: whole backwards alike.
    f = jax.jit(lambda res, ct, m=module, c=c: m.backward(opts, c, res, (ct, cts[1]))[:3])
    try_variant(fns, outs, name, f, res, ct)
  if wanted is None or "pair" in wanted:
    pair = PallasMosaicGpu(dq_config=MosaicDqConfig())  # the pair even where _ordered serves
    det = dataclasses.replace(opts, deterministic=True)
    f = jax.jit(lambda res, ct: pair.backward(q, k, v, None, None, res.out, res.lse, ct,
                                              cts[1], opts=det))
    try_variant(fns, outs, "pair", f, res, ct)
  same_bits = lambda xs, ys: [bool(np.array_equal(np.asarray(x, np.float32),
                                                 np.asarray(y, np.float32)))
                              for x, y in zip(xs, ys)]
  max_diff = lambda xs, ys: [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                             for x, y in zip(xs, ys)]
  # A converted variant: reproducible, and the same bits as the variant it converts for
  # (the same float32 sum, scaled and rounded alike); a persistent ordered one the same bits
  # as the grid it replaces (the same additions in the same order).
  for name in [n for n in outs if n == "ordered" or "convert" in n
               or (n.endswith("+persistent") and "arrival" not in n)]:
    f, a = fns[name]
    for _ in range(2 if name == "ordered" else 1):
      again = jax.block_until_ready(f(*a))
      print(f"{name}: identical bits on another call (dq, dk, dv): "
            f"{same_bits(outs[name], again)}", flush=True)
    others = (("arrival", "pair") if name == "ordered"
              else (name.replace("+convert", "").replace("+persistent", ""),))
    for other in others:
      if other in outs:
        print(f"{name}: identical bits to {other} {same_bits(outs[name], outs[other])}, "
              f"max |diff| (dq, dk, dv) {max_diff(outs[name], outs[other])}", flush=True)
  rounds_then_power(fns, args.rounds, width=18)


if __name__ == "__main__":
  main()
