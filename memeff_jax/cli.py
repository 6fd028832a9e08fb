"""memeff-jax: train LLMs in less GPU memory from JAX (fused LM-head loss, flash attention).

  memeff-jax demo          train a tiny model twice, plain Flax layers vs memeff layers
  memeff-jax train         the same loop at a configured size (tiny, 125m, 1b or a TOML file)
  memeff-jax report        memory report of a model's train step, and of each remat policy
  memeff-jax compare-loss  the fused LM-head loss beside the naive one
  memeff-jax bench         run a benchmark script from a source checkout (benchmarks/<op>.py)
"""

from __future__ import annotations

import argparse
import pathlib
import runpy
import sys
import time


def _config_path(name: str) -> pathlib.Path:
  path = pathlib.Path(name)
  if path.exists():
    return path
  from memeff_jax import _tuning  # pylint: disable=import-outside-toplevel
  bundled = _tuning.PACKAGE_CONFIGS / "models" / f"{name}.toml"
  if bundled.exists():
    return bundled
  names = sorted(p.stem for p in (_tuning.PACKAGE_CONFIGS / "models").glob("*.toml"))
  raise SystemExit(f"no model config {name!r}: give a path to a TOML file or one of {names}")


def _demo(args) -> int:
  import jax  # pylint: disable=import-outside-toplevel

  from memeff_jax.models import LlamaConfig  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import run  # pylint: disable=import-outside-toplevel

  cfg, train_cfg = LlamaConfig.from_toml(_config_path("tiny"))
  steps = args.steps or train_cfg["steps"]
  batch, seq_len = train_cfg["batch"], train_cfg["seq_len"]
  device = jax.devices()[0]
  print(f"memeff-jax demo on {device.platform} ({device.device_kind}): a {cfg.n_layers}-layer "
        f"byte-level Llama trained on this package's source, {batch}×{seq_len} tokens per "
        f"step (packed files, segment ids), {steps} steps, twice from the same parameters:")
  print("  plain  = jax.nn.dot_product_attention + nnx.Linear head + optax loss")
  print("  memeff = memeff_jax.flash_attention + FusedLMHead (linear_cross_entropy)\n")
  results = [run.train(cfg, train_cfg, kernels=k, steps=steps, batch=batch, seq_len=seq_len)
             for k in ("plain", "memeff")]
  plain, ours = results
  print(f"\n{'step':>5s} {'plain':>10s} {'memeff':>10s} {'|diff|':>10s}")
  worst = 0.0
  for i, (a, b) in enumerate(zip(plain.losses, ours.losses)):
    worst = max(worst, abs(a - b) / abs(a))
    if i % max(1, steps // 10) == 0 or i == steps - 1:
      print(f"{i + 1:5d} {a:10.5f} {b:10.5f} {abs(a - b):10.2e}")
  print(f"\nlosses agree step by step: largest relative difference {worst:.1e}")
  print(f"\n{'':8s} {'train-step temporaries':>24s} {'tokens/s':>10s}")
  for r in results:
    mem = "n/a" if r.temp_bytes is None else f"{r.temp_bytes / 2**20:.1f} MiB"
    print(f"{r.kernels:8s} {mem:>24s} {r.tokens_per_s:10.0f}")
  if plain.temp_bytes and ours.temp_bytes:
    print(f"memeff layers need {1 - ours.temp_bytes / plain.temp_bytes:.0%} less temporary "
          "memory per step (XLA's compiled memory analysis)")
  try:
    import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    print("plot: skipped (matplotlib is not installed: pip install 'memeff-jax[plot]')")
  else:
    run.plot(results, args.plot, f"memeff-jax demo ({device.platform}): {cfg.n_layers} "
             f"layers, {batch}×{seq_len} tokens")
    print(f"plot: {args.plot}")
  return 0 if worst < 1e-3 else 1


def _train(args) -> int:
  from memeff_jax.models import LlamaConfig  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import run  # pylint: disable=import-outside-toplevel

  cfg, train_cfg = LlamaConfig.from_toml(_config_path(args.config))
  steps = args.steps or train_cfg.get("steps", 20)
  batch = args.batch or train_cfg.get("batch", 1)
  seq_len = args.seq_len or train_cfg.get("seq_len", 1024)
  mesh = None
  if args.distributed:
    import jax  # pylint: disable=import-outside-toplevel
    jax.distributed.initialize()
  if args.mesh:
    from memeff_jax.models import sharding  # pylint: disable=import-outside-toplevel
    mesh = sharding.make_mesh(sharding.parse_mesh(args.mesh))
    print(f"mesh {dict(mesh.shape)} over {mesh.size} devices")
  r = run.train(cfg, train_cfg, kernels=args.kernels, steps=steps, batch=batch,
                seq_len=seq_len, mesh=mesh, context_order=args.context_order,
                context_strategy=args.context_strategy,
                sequence_parallel=args.sequence_parallel)
  mem = "n/a" if r.temp_bytes is None else f"{r.temp_bytes / 2**30:.3f} GiB"
  peak = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 2**30:.3f} GiB"
  print(f"{args.kernels} layers: loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f} in {steps} steps; "
        f"{r.tokens_per_s:.0f} tokens/s; train-step temporaries {mem}; device peak {peak}")
  return 0


def _report(args) -> int:
  import dataclasses  # pylint: disable=import-outside-toplevel

  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from memeff_jax import remat  # pylint: disable=import-outside-toplevel
  from memeff_jax.memory import analyze  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama, LlamaConfig, policy_steps  # pylint: disable=import-outside-toplevel

  cfg, train_cfg = LlamaConfig.from_toml(_config_path(args.config))
  batch = args.batch or train_cfg.get("batch", 1)
  seq_len = args.seq_len or train_cfg.get("seq_len", 1024)
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  batch_spec = dict(tokens=tokens, labels=tokens)
  make_step, state = policy_steps(lambda policy: Llama(
      dataclasses.replace(cfg, remat_policy=policy), kernels=args.kernels, rngs=nnx.Rngs(0)))

  print(f"train step of {args.config} ({args.kernels} layers, batch {batch} × {seq_len}, "
        f"remat policy {cfg.remat_policy!r}):")
  print(analyze(make_step(cfg.remat_policy), state, batch_spec))
  print("\nremat policies (compiled, not run):")
  if args.budget_gib is None:
    print(remat.table(remat.candidates(make_step, state, batch_spec)))
    return 0
  name, _ = remat.fit(make_step, state, batch_spec, budget_bytes=args.budget_gib * 2**30)
  print(f"within {args.budget_gib} GiB, the least recomputation: {name!r}")
  return 0


def _compare_loss(args) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import memeff_jax  # pylint: disable=import-outside-toplevel

  n, d, v = args.tokens, args.hidden, args.vocab
  dtype = jnp.dtype(args.dtype)
  device = jax.devices()[0]
  print(f"memeff-jax compare-loss on {device.platform} ({device.device_kind}): LM-head loss of "
        f"{n:,} tokens, hidden {d}, vocab {v:,}, {dtype.name}")
  logits_gib = n * v * 4 / 2**30
  print(f"The float32 logits alone would take {logits_gib:.2f} GiB.\n")
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (n, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)).astype(dtype)
  y = jax.random.randint(ky, (n,), 0, v)

  def naive(x, w):
    return optax.softmax_cross_entropy_with_integer_labels((x @ w).astype(jnp.float32), y).mean()

  def fused(x, w):
    return memeff_jax.linear_cross_entropy(x, w, y)

  rows = []
  ref_grads = None
  for name, fn in (("naive: x @ W + optax", naive), ("memeff_jax.linear_cross_entropy", fused)):
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    compiled = step.lower(x, w).compile()
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else analysis.temp_size_in_bytes
    loss, grads = jax.block_until_ready(compiled(x, w))
    t0 = time.perf_counter()
    for _ in range(args.reps):
      loss, grads = compiled(x, w)
    jax.block_until_ready(grads)
    ms = (time.perf_counter() - t0) * 1e3 / args.reps
    if ref_grads is None:
      ref_grads, err = grads, 0.0
    else:
      err = max(float(jnp.linalg.norm((g - r).astype(jnp.float32)) /
                      jnp.linalg.norm(r.astype(jnp.float32)))
                for g, r in zip(grads, ref_grads))
    rows.append((name, float(loss), err, temp, ms))

  print(f"{'':34s} {'loss':>10s} {'grad rel. err':>14s} {'temporaries':>12s} {'time':>10s}")
  for name, loss, err, temp, ms in rows:
    mem = "n/a" if temp is None else f"{temp / 2**20:9.1f} MiB"
    print(f"{name:34s} {loss:10.6f} {err:14.2e} {mem:>12s} {ms:7.1f} ms")
  naive_temp, ours_temp = rows[0][3], rows[1][3]
  if naive_temp and ours_temp:
    print(f"\nSame loss and gradients with {naive_temp / ours_temp:.0f}x less temporary memory "
          "(XLA's compiled memory analysis of jit(value_and_grad)).")
  ok = abs(rows[0][1] - rows[1][1]) <= 1e-3 * abs(rows[0][1]) and rows[1][2] < 2e-2
  if not ok:
    print("MISMATCH between the naive and the fused loss", file=sys.stderr)
  return 0 if ok else 1


def _bench(args) -> int:
  script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{args.op}.py"
  if not script.exists():
    print(f"no benchmark script {script}; `memeff-jax bench` runs from a source checkout",
          file=sys.stderr)
    return 2
  sys.argv = [str(script)] + args.rest
  runpy.run_path(str(script), run_name="__main__")
  return 0


def parser() -> argparse.ArgumentParser:
  """The command line: every subcommand and option, with its help."""
  parser = argparse.ArgumentParser(
      prog="memeff-jax", description=__doc__.split("\n")[0].split(": ", 1)[1],
      epilog="`memeff-jax COMMAND --help` describes each command's options.")
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="train a tiny model twice: plain vs memeff layers")
  demo.add_argument("--steps", type=int, default=None,
                    help="train steps of each run (default: the tiny config's, 30)")
  demo.add_argument("--plot", default="memeff_demo.png",
                    help="where to write the PNG of the loss curves, if matplotlib is "
                         "installed (default: memeff_demo.png)")
  demo.set_defaults(func=_demo)
  model = argparse.ArgumentParser(add_help=False)  # what train and report share
  model.add_argument("--config", required=True,
                     help="a model: tiny, 125m, 1b, or the path of a TOML file like theirs")
  model.add_argument("--kernels", choices=["memeff", "plain", "plain_xla"], default="memeff",
                     help="memeff layers; or the same model on plain Flax/optax layers with "
                          "jax.nn.dot_product_attention on cuDNN (on a GPU; XLA elsewhere), "
                          "or with XLA's attention (plain_xla) (default: memeff)")
  model.add_argument("--batch", type=int, default=None,
                     help="sequences per step (default: the config's)")
  model.add_argument("--seq-len", type=int, default=None,
                     help="tokens per sequence (default: the config's)")
  train = sub.add_parser("train", parents=[model],
                         help="train a configured model (tiny, 125m, 1b or a TOML file)")
  train.add_argument("--steps", type=int, default=None,
                     help="train steps (default: the config's)")
  train.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                     help="train on a mesh of data, fsdp, tensor and context axes, e.g. "
                          "data=2,fsdp=2,tensor=2 or data=2,context=4 (default: one device)")
  train.add_argument("--context-strategy", choices=("all_gather", "ring"),
                     default="all_gather",
                     help="with a context axis: gather K/V in every layer, or pass them round "
                          "the shards, holding two shards' at a time (default: all_gather)")
  train.add_argument("--context-order", choices=("contiguous", "zigzag"), default="contiguous",
                     help="with a context axis: each shard holds one run of the sequence, or "
                          "runs i and 2n−1−i of 2n, equal causal work (default: contiguous)")
  train.add_argument("--sequence-parallel", action="store_true",
                     help="with a tensor axis (and no context axis): shard the residual "
                          "stream on the sequence over it, each block gathering its "
                          "branches' inputs and reduce-scattering their outputs: less "
                          "memory per GPU, slower steps (default: off)")
  train.add_argument("--distributed", action="store_true",
                     help="call jax.distributed.initialize() first: run the same command on "
                          "every host of a multi-host job (default: off)")
  train.set_defaults(func=_train)
  report = sub.add_parser("report", parents=[model],
                          help="memory report of a model's train step and policies")
  report.add_argument("--budget-gib", type=float, default=None,
                      help="also pick the policy with the least recomputation that fits "
                           "this many GiB (memeff_jax.remat.fit); default: only the table")
  report.set_defaults(func=_report)
  compare = sub.add_parser("compare-loss",
                           help="fused vs naive LM-head loss: values, gradients, memory")
  compare.add_argument("--tokens", type=int, default=8192, help="N (default: 8192)")
  compare.add_argument("--hidden", type=int, default=256, help="D (default: 256)")
  compare.add_argument("--vocab", type=int, default=50257, help="V (default: 50257)")
  compare.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="x and W's dtype (default: float32)")
  compare.add_argument("--reps", type=int, default=3, help="timed calls each (default: 3)")
  compare.set_defaults(func=_compare_loss)
  bench = sub.add_parser("bench", help="run benchmarks/<op>.py (source checkout)")
  bench.add_argument("op", choices=["linear_cross_entropy", "flash_attention"],
                     help="which benchmark script")
  bench.add_argument("rest", nargs=argparse.REMAINDER, help="its arguments (see its --help)")
  bench.set_defaults(func=_bench)
  return parser


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
