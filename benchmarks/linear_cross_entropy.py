"""Linear cross-entropy forward+backward: every provider side by side in one run.

    python benchmarks/linear_cross_entropy.py --set llama3-8b [--providers a,b,...]

Providers (those whose packages are missing are skipped, with a note):
  floor              the three bf16 matmuls x@W, G@Wᵀ, xᵀ@G (XLA/cuBLAS) with a given G, the
                     vocabulary padded to a multiple of 128 (gpt2's 50,257 to 50,304: cuBLAS
                     is faster on the padded one, so the floor is what a padded head costs)
  jax_naive          x@W then optax.softmax_cross_entropy_with_integer_labels, jax.grad
  jax_scan_remat     jax.checkpoint of the naive loss over token chunks in a lax.scan
  memeff             memeff_jax.linear_cross_entropy, default implementation
  memeff:NAME[:k=v]  one implementation with options, e.g. memeff:pallas_mosaic_gpu:budget_mib=128;
                     per_token=1 asks for reduction="none" and reduces (weights) the losses
                     after it, as a caller without token_weights would
  tokamax            tokamax.linear_softmax_cross_entropy_loss (default implementation)
  torch_naive, torch_compile, liger, cce    PyTorch peers (CUDA only)

A set's `logit_softcap`, `label_smoothing` and `reduction` (default "mean"; "none" sums the
per-token losses to differentiate them) apply to every provider (the floor's matmuls are the
same). A set with `token_weights = true` weights each token's loss by a fixed normal weight
(an on-policy policy gradient's advantages): memeff passes them as `token_weights`, every
other provider multiplies its per-token losses. A set with `entropy_bonus = β` subtracts β
times the tokens' mean entropy from the loss (an RL step's entropy bonus, differentiated):
memeff as a `token_loss` of the log-prob and entropy (`memeff:default:aux=1`: the entropy
from `return_aux=True`, then the bonus), plain JAX and torch from the logits; Liger, CCE
and tokamax, which give no entropy, are skipped. A set with
`ppo_sequence = T` takes PPO's clipped surrogate (ε = 0.2, GRPO's without a KL term) as the
loss: each token's −min(ρA, clip(ρ, 0.8, 1.2)A), ρ = exp(log p − log p_old), A one normal
advantage per sequence of T tokens, log p_old the tokens' log-probs plus noise (some ratios
clipped), averaged over the tokens: memeff as a `token_loss`, Liger as its fused GRPO loss
(`dapo` normalization), every other provider from its per-token log-probs. A set with
`backward = false` times the loss alone, without gradients (evaluation, or
an RL step's reference log-probs): the floor is then x@W alone, torch runs under no_grad.

Each row: ms (median), ratio to the floor, TFLOP/s (6·N·D·V per step, 2·N·D·V for the loss
alone), extra memory (XLA temporaries for JAX; peak allocated over the inputs for torch) and
the loss value; on a GPU also its SM clock and board power over the provider's timed calls
(sm_mhz, power_w, averaged over gpu_samples samples: _harness.GpuSampler), which tell a
provider that waits from one that spends more energy where the GPU holds its power limit.
Every provider is built and run once first (memory is measured then); `--rounds R` interleaved
rounds then time each once per round, the order rotated each round, and ms is the median over
rounds (see _harness.interleaved). A JAX provider's calls are queued in batches of about
20 ms, as a loss is queued behind the model in a training step, so that a call of a few
tokens is not charged the host's round trip (_harness.time_jax). Rows are appended to
benchmarks/results/linear_cross_entropy.jsonl (or --out).

    python benchmarks/linear_cross_entropy.py --dw-precision 16384,131072 [--providers ...]

measures instead how far each provider's gradients are from a float32 reference (chunked,
HIGHEST matmul precision) as the tokens per step grow, at the set's first shape's D and V:
relative Frobenius errors of dW and dx, one op="lce_dw_precision" row per (N, provider), in
benchmarks/results/lce_dw_precision.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _harness  # noqa: E402
import memeff_jax  # noqa: E402
from memeff_jax.ops import linear_cross_entropy as lce  # noqa: E402

DEFAULT_PROVIDERS = ("floor,jax_naive,jax_scan_remat,memeff,memeff:chunked_xla,tokamax,"
                     "torch_naive,torch_compile,liger,cce")


def make_inputs(n, d, v, dtype, seed=0):
  kx, kw, ky, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (n, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)).astype(dtype)
  y = jax.random.randint(ky, (n,), 0, v, jnp.int32)
  return x, w, y, kg


def _loss_and_grads(loss_fn, backward: bool = True):
  """The jitted loss and (dx, dW), or with backward=False the loss alone (as a 1-tuple)."""
  if not backward:
    return jax.jit(lambda x, w: (loss_fn(x, w),))
  return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))


def _naive_losses(logits, y, softcap=None, smoothing=0.0):
  """Per-token losses of [C, V] float32 logits, capped and smoothed as the set says."""
  import optax  # pylint: disable=import-outside-toplevel
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  if not smoothing:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
  return -(1.0 - smoothing) * picked - smoothing * jnp.mean(logp, axis=-1)


def _reduced(losses, reduction, weights=None):
  """A scalar to differentiate: the mean, or the sum (of per-token losses, "none"), of the
  losses times `weights` when given."""
  if weights is not None:
    losses = losses * weights
  return losses.mean() if reduction == "mean" else losses.sum()


def _reduced_first(out, reduction, weights=None):
  """_reduced of a loss, or of the loss of a (loss, aux) pair (return_aux), aux kept."""
  if isinstance(out, tuple):
    return _reduced(out[0], reduction, weights), out[1]
  return _reduced(out, reduction, weights)


def _naive_entropy(logits, softcap=None):
  """Each row's entropy −Σ p log p of [C, V] float32 logits, capped as the set says."""
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  return -jnp.sum(jax.nn.softmax(logits, axis=-1) * jax.nn.log_softmax(logits, axis=-1),
                  axis=-1)


def _less_bonus(log_p, entropy, bonus):
  """A token's cross-entropy less `bonus` times its entropy: memeff's token_loss for an
  `entropy_bonus` set."""
  return -log_p - bonus * entropy


def _ppo_clip(log_p, advantages, old_log_p):
  """PPO's clipped surrogate of one token (or elementwise): memeff's token_loss."""
  ratio = jnp.exp(log_p - old_log_p)
  return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1.2) * advantages)


def ppo_inputs(x, w, y, sequence: int, seed=0):
  """(advantages [N], old log-probs [N]) for a `ppo_sequence` set: one normal advantage per
  sequence, and the tokens' log-probs under (x, w) plus normal noise of 0.2."""
  ka, ko = jax.random.split(jax.random.key(seed + 2))
  n = x.shape[0]
  advantages = jnp.repeat(jax.random.normal(ka, (n // sequence,), jnp.float32), sequence)
  log_p = -jax.jit(lambda x, w: memeff_jax.linear_cross_entropy(x, w, y, reduction="none"))(x, w)
  return advantages, log_p + 0.2 * jax.random.normal(ko, (n,), jnp.float32)


def token_weights(n, seed=0):
  """[N] float32 fixed per-token weights, standard normal: a policy gradient's advantages."""
  return jax.random.normal(jax.random.key(seed + 1), (n,), jnp.float32)


def jax_case(provider, x, w, y, kg, softcap=None, smoothing=0.0, reduction="mean",
             backward=True, weights=None, bonus=None, ppo=None):
  """(jitted fn, args) computing the loss and (dx, dW) for a JAX provider, or with
  backward=False the loss alone; `softcap` caps the logits (Gemma-2's
  final_logit_softcapping), `smoothing` smooths the labels, `weights` [N] weight the
  tokens' losses and `reduction` reduces them ("none": per-token losses, summed here),
  `bonus` β subtracts β times the mean entropy, and `ppo` (advantages, old log-probs, T)
  makes each token's loss _ppo_clip of its log-prob, as every provider but the floor does.
  fn(*args)[0] is the loss."""
  if provider == "floor":
    w = jnp.pad(w, ((0, 0), (0, -w.shape[1] % 128)))
    if not backward:
      return jax.jit(lambda x, w: (x @ w,)), (x, w)
    g = jax.random.normal(kg, (x.shape[0], w.shape[1]), jnp.float32).astype(x.dtype) * 1e-3
    fn = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g))
    return fn, (x, w, g)
  grads = functools.partial(_loss_and_grads, backward=backward)
  n = x.shape[0]
  less_bonus = lambda total, entropy_sum: total if bonus is None else total - bonus * (
      entropy_sum / n)
  # Each token's loss from its cross-entropy (−log p): itself, or PPO's surrogate.
  objective = (lambda ce, *_: ce) if ppo is None else (
      lambda ce, adv, old: _ppo_clip(-ce, adv, old))
  ppo_args = (None, None) if ppo is None else ppo[:2]
  if provider == "jax_naive":
    def loss(x, w):
      logits = (x @ w).astype(jnp.float32)
      total = _reduced(objective(_naive_losses(logits, y, softcap, smoothing), *ppo_args),
                       reduction, weights)
      return less_bonus(total, None if bonus is None else
                        jnp.sum(_naive_entropy(logits, softcap)))
    return grads(loss), (x, w)
  if provider == "jax_scan_remat":
    chunk = math.gcd(x.shape[0], 1024)
    def loss(x, w):
      @jax.checkpoint
      def one(xc, yc, wc, ac, oc):  # the chunk's summed losses and entropies
        logits = (xc @ w).astype(jnp.float32)
        total = _reduced(objective(_naive_losses(logits, yc, softcap, smoothing), ac, oc),
                         "sum", wc)
        entropy = 0.0 if bonus is None else jnp.sum(_naive_entropy(logits, softcap))
        return jnp.stack([total, entropy])
      xs, ys = x[:n].reshape(-1, chunk, x.shape[1]), y[:n].reshape(-1, chunk)
      ws, adv, old = (None if t is None else t.reshape(-1, chunk)
                      for t in (weights, *ppo_args))
      total, entropy = jax.lax.scan(lambda acc, xyw: (acc + one(*xyw), None),
                                    jnp.zeros(2), (xs, ys, ws, adv, old))[0]
      return less_bonus(total / n if reduction == "mean" else total, entropy)
    return grads(loss), (x, w)
  if provider == "tokamax":
    if (softcap is not None or smoothing or reduction != "mean" or weights is not None
        or bonus is not None or ppo is not None):
      raise ImportError("tokamax's loss takes no logit softcap, label smoothing, reduction, "
                        "token weights, entropy or per-token objective")
    tokamax = import_tokamax()
    return grads(lambda x, w: tokamax.linear_softmax_cross_entropy_loss(
        x, y, w, reduction="mean")), (x, w)
  if provider.startswith("memeff"):
    impl, layout, per_token, aux = parse_memeff(provider)
    if layout == "vd":
      w = jax.block_until_ready(jnp.copy(w.T))
    options = dict(weight_layout=layout, implementation=impl, logit_softcap=softcap,
                   label_smoothing=smoothing)
    if bonus is not None and not (per_token or aux or smoothing or ppo is not None):
      # The cross-entropy less the bonus as one token_loss of the log-prob and entropy (the
      # bonus is on the mean entropy: per token β, or β / N where the losses are summed).
      per_entropy = bonus if reduction == "mean" else bonus / n
      options.update(entropy=True, token_loss=functools.partial(_less_bonus, bonus=per_entropy))
      return grads(lambda x, w: _reduced_first(memeff_jax.linear_cross_entropy(
          x, w, y, reduction=reduction, token_weights=weights, **options), "sum")), (x, w)
    if bonus is not None:
      options.update(return_aux=True, entropy=True)
    if ppo is not None and per_token:  # the log-probs, then the surrogate by the caller
      return grads(lambda x, w: _reduced(objective(memeff_jax.linear_cross_entropy(
          x, w, y, reduction="none", **options), *ppo_args), reduction)), (x, w)
    if ppo is not None:
      options.update(token_loss=_ppo_clip, token_loss_args=tuple(ppo_args))

    def with_bonus(out):  # the loss, less the bonus where the entropy came with it
      if bonus is None:
        return out
      loss, aux = out
      return less_bonus(loss, jnp.sum(aux.entropy))

    if per_token:
      return grads(lambda x, w: with_bonus(_reduced_first(memeff_jax.linear_cross_entropy(
          x, w, y, reduction="none", **options), reduction, weights))), (x, w)
    return grads(lambda x, w: with_bonus(_reduced_first(memeff_jax.linear_cross_entropy(
        x, w, y, reduction=reduction, token_weights=weights, **options), "sum"))), (x, w)
  raise KeyError(provider)


def import_tokamax():
  """tokamax, whose top-level import pulls in xprof for its own benchmarking helpers only.

  Where xprof is missing (it drags in duckdb and cloud-storage clients), a throwaway stub of
  the one name tokamax imports is put on sys.path; the loss itself never calls it.
  """
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("xprof") is None:
    import tempfile  # pylint: disable=import-outside-toplevel
    stub = pathlib.Path(tempfile.mkdtemp()) / "xprof"
    (stub / "cli").mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "cli" / "__init__.py").write_text("")
    (stub / "cli" / "tools.py").write_text(
        "def get_kernel_stats_tool(*a, **k):\n"
        "  raise NotImplementedError('xprof stub from benchmarks/linear_cross_entropy.py')\n")
    sys.path.append(str(stub.parent))
    print("  note: xprof missing; tokamax imported with a stub of its profiler helper")
  import tokamax  # pylint: disable=import-outside-toplevel
  # tokamax reads its options through absl flags, which parse sys.argv on first use and
  # reject this script's own arguments (--set, --providers): parse the program name only.
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])
  _mosaic_kernel_names()
  return tokamax


def _mosaic_kernel_names():
  """tokamax 0.0.11-0.0.12 call plgpu.kernel(out_shape=..., scratch_shapes=...), names that
  jax 0.11 dropped for out_type / scratch_types (0.10 takes both): where they are gone, pass
  them on under the new names, so the peer runs on the device image's jax."""
  import inspect  # pylint: disable=import-outside-toplevel
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  params = inspect.signature(plgpu.kernel).parameters
  renames = {old: new for old, new in (("out_shape", "out_type"),
                                       ("scratch_shapes", "scratch_types"))
             if old not in params and new in params}
  if not renames or getattr(plgpu.kernel, "_renamed", False):
    return
  kernel = plgpu.kernel

  def renamed(*args, **kwargs):
    for old, new in renames.items():
      if old in kwargs:
        kwargs[new] = kwargs.pop(old)
    return kernel(*args, **kwargs)

  renamed._renamed = True
  plgpu.kernel = renamed
  print(f"  note: tokamax's plgpu.kernel arguments renamed for this jax: {renames}")


def parse_memeff(provider: str):
  """memeff[:name[:key=value...]] -> (implementation argument, weight layout, per_token,
  aux): per_token=1 reduces reduction="none"'s losses after the call; aux=1 takes an
  entropy bonus's entropies from return_aux rather than a token_loss."""
  parts = provider.split(":")
  if len(parts) == 1:
    return None, "dv", False, False
  name, opts = parts[1], dict(p.split("=", 1) for p in parts[2:])
  layout = opts.pop("layout", "dv")
  per_token = bool(int(opts.pop("per_token", 0)))
  aux = bool(int(opts.pop("aux", 0)))
  if name == "default":
    impl = None
  elif name == "chunked_xla":
    kw = {}
    if "budget_mib" in opts:
      kw["memory_budget_bytes"] = int(opts.pop("budget_mib")) * 2**20
    impl = lce.ChunkedXla(**kw)
  elif name == "pallas_mosaic_gpu":
    kw, kernel = {}, {}
    if "budget_mib" in opts:
      kw["memory_budget_bytes"] = int(opts.pop("budget_mib")) * 2**20
    if "dw" in opts:
      kw["dw_accumulation"] = opts.pop("dw")
    if "gemms" in opts:  # e.g. gemms=dw or gemms=logits+dx+dw: those on kernels.mosaic_gemm
      kw["mosaic_gemms"] = tuple(opts.pop("gemms").split("+"))
    if "fused_lse" in opts:  # fused_lse=1: partial log-sum-exps from the logits GEMM
      kw["fused_lse"] = bool(int(opts.pop("fused_lse")))
    if "exp_logits" in opts:  # exp_logits=1: no softmax pass (PallasMosaicGpu.exp_logits)
      kw["exp_logits"] = bool(int(opts.pop("exp_logits")))
    for key in ("block_rows", "block_v", "num_warps", "num_stages"):
      if key in opts:
        kernel[key] = int(opts.pop(key))
    if kernel:
      kw["kernel"] = lce.KernelConfig(**kernel)
    impl = lce.PallasMosaicGpu(**kw)
  else:
    impl = name
  if opts:
    raise ValueError(f"unknown options {opts} in provider {provider!r}")
  return impl, layout, per_token, aux


def torch_loss_fn(provider, softcap=None, smoothing=0.0, reduction="mean", weights=None,
                  bonus=None, ppo=None):
  """loss_fn(x [N, D], w [V, D], y [N] int64) for a PyTorch provider; with `weights` [N]
  (a tensor), the peer's per-token losses times the weights, then reduced; with `bonus` β,
  less β times the mean entropy of the logits (torch_naive and torch_compile only); with
  `ppo` (advantages, old log-probs, T; tensors), PPO's surrogate of the per-token log-probs
  (Liger: its fused GRPO loss)."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  peer_reduction = reduction if weights is None and ppo is None else "none"
  if bonus is not None and provider not in ("torch_naive", "torch_compile"):
    raise ImportError(f"{provider}'s loss gives no entropy")

  def reduced(losses):
    if ppo is not None:
      adv, old, _ = ppo
      ratio = torch.exp(-losses - old)
      losses = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
      return losses.mean() if reduction == "mean" else losses.sum()
    if weights is None:
      return losses.sum()
    return _reduced(losses, reduction, weights)

  def naive(x, w, y):
    logits = F.linear(x, w).float()
    if softcap is not None:
      logits = softcap * torch.tanh(logits / softcap)
    loss = reduced(F.cross_entropy(logits, y, label_smoothing=smoothing,
                                   reduction=peer_reduction))
    if bonus is None:
      return loss
    entropy = -(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1)
    return loss - bonus * entropy.mean()

  if provider == "torch_naive":
    return naive
  if provider == "torch_compile":
    return torch.compile(naive)
  if provider == "liger" and ppo is not None:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # pylint: disable=import-outside-toplevel
    if softcap is not None or smoothing or reduction != "mean":
      raise ImportError("Liger's GRPO loss takes no logit softcap, smoothing or reduction")
    adv, old, seq = ppo
    module = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo",
                                      epsilon_low=0.2, epsilon_high=0.2)
    seq_adv, old = adv.view(-1, seq)[:, 0].contiguous(), old.view(-1, seq)

    def grpo(x, w, y):
      mask = torch.ones_like(old)
      out = module(x.view(-1, seq, x.shape[-1]), w, y.view(-1, seq), mask, seq_adv,
                   old_per_token_logps=old)
      return out[0] if isinstance(out, tuple) else out
    return grpo
  if provider == "liger":
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # pylint: disable=import-outside-toplevel
    module = LigerFusedLinearCrossEntropyLoss(softcap=softcap, label_smoothing=smoothing,
                                              reduction=peer_reduction)
    return lambda x, w, y: reduced(module(w, x, y))
  if provider == "cce":
    from cut_cross_entropy import linear_cross_entropy as cce_loss  # pylint: disable=import-outside-toplevel
    if smoothing:
      raise ImportError("Cut Cross-Entropy takes no label smoothing")
    return lambda x, w, y: reduced(cce_loss(x, w, y, softcap=softcap, reduction=peer_reduction))
  raise KeyError(provider)


def torch_case(provider, x, w, y, softcap=None, smoothing=0.0, reduction="mean",
               backward=True, weights=None, bonus=None, ppo=None):
  """A closure running forward+backward in torch (the forward alone, under no_grad, with
  backward=False), and a loss getter."""
  import torch  # pylint: disable=import-outside-toplevel
  dev = "cuda"
  tdtype = {jnp.bfloat16: torch.bfloat16, jnp.float32: torch.float32,
            jnp.float16: torch.float16}[jnp.dtype(x.dtype).type]
  xt = torch.from_numpy(np.array(x, np.float32)).to(dev, tdtype).requires_grad_(backward)
  wt = torch.from_numpy(np.array(w, np.float32).T).to(dev, tdtype).contiguous()
  wt.requires_grad_(backward)
  yt = torch.from_numpy(np.asarray(y).astype(np.int64)).to(dev)
  if weights is not None:
    weights = torch.from_numpy(np.asarray(weights)).to(dev)
  if ppo is not None:
    ppo = tuple(torch.from_numpy(np.asarray(t)).to(dev) for t in ppo[:2]) + (ppo[2],)
  step, state = torch_step(torch_loss_fn(provider, softcap, smoothing, reduction, weights,
                                         bonus, ppo), xt, wt, yt, backward)
  return step, state, (xt, wt, yt)


def torch_step(loss_fn, xt, wt, yt, backward=True):
  """(step, state): step() runs loss_fn forward+backward from cleared gradients (the
  forward alone under no_grad with backward=False) and keeps the loss in state["loss"]."""
  import torch  # pylint: disable=import-outside-toplevel
  state = {}

  def step():
    if not backward:
      with torch.no_grad():
        state["loss"] = loss_fn(xt, wt, yt)
      return
    xt.grad = wt.grad = None
    loss = loss_fn(xt, wt, yt)
    loss.backward()
    state["loss"] = loss

  return step, state


def run(set_name: str, providers: list[str], out, reps: int, rounds: int = 1) -> list[dict]:
  sets = _harness.shape_sets("linear_cross_entropy")
  spec = sets[set_name]
  dtype = jnp.dtype(spec.get("dtype", "bfloat16"))
  softcap, smoothing = spec.get("logit_softcap"), spec.get("label_smoothing", 0.0)
  reduction = spec.get("reduction", "mean")
  backward = spec.get("backward", True)
  weighted = spec.get("token_weights", False)
  bonus = spec.get("entropy_bonus")
  sequence = spec.get("ppo_sequence")
  env = _harness.environment()
  rows = []
  for shape in spec["shapes"]:
    n, d, v = shape["n"], shape["d"], shape["v"]
    x, w, y, kg = make_inputs(n, d, v, dtype)
    ppo = None if sequence is None else (*ppo_inputs(x, w, y, sequence), sequence)
    options = (softcap, smoothing, reduction, backward, token_weights(n) if weighted else None,
               bonus, ppo)
    flops = (6.0 if backward else 2.0) * n * d * v
    cases = {}  # provider -> (row, timer, loss getter): built and run once before any timing
    for provider in providers:
      row = dict(op="linear_cross_entropy", set=set_name, n=n, d=d, v=v,
                 dtype=dtype.name, provider=provider, rounds=rounds, **env)
      if softcap is not None:
        row["logit_softcap"] = softcap
      if smoothing:
        row["label_smoothing"] = smoothing
      if reduction != "mean":
        row["reduction"] = reduction
      if weighted:
        row["token_weights"] = True
      if bonus is not None:
        row["entropy_bonus"] = bonus
      if sequence is not None:
        row["ppo_sequence"] = sequence
      if not backward:
        row["backward"] = False
      try:
        if provider.startswith("torch") or provider in ("liger", "cce"):
          if env["platform"] != "gpu":
            print(f"  skip {provider}: torch peers run on CUDA only")
            continue
          step, state, tensors = torch_case(provider, x, w, y, *options)
          row["extra_bytes"] = _harness.torch_extra_bytes(step, tensors[:2])
          cases[provider] = (row, lambda step=step: _harness.time_torch(step, reps=reps),
                             lambda state=state: float(state["loss"].detach()))
        else:
          fn, args = jax_case(provider, x, w, y, kg, *options)
          row["extra_bytes"] = _harness.jax_temp_bytes(fn, *args)
          loss = float(fn(*args)[0]) if provider != "floor" else None
          timer = functools.partial(_harness.time_jax, fn, *args, reps=reps, inner=None)
          cases[provider] = (row, timer, lambda loss=loss: loss)
      except ImportError as err:
        print(f"  skip {provider}: {err}")
      except Exception as err:  # pylint: disable=broad-except
        traceback.print_exc()
        row["error"] = f"{type(err).__name__}: {err}"[:500]
        rows.append(row)
        _harness.append(out, [row])
        print(f"  {provider:32s} ERROR {row['error'][:200]}")
    times, clocks = _harness.sampled_rounds(
        {p: timer for p, (_, timer, _) in cases.items()}, rounds, env["platform"] == "gpu")
    medians = {p: float(np.median(t)) for p, t in times.items()}
    floor_ms = medians.get("floor")
    for provider, ms in medians.items():
      row, _, loss = cases[provider]
      if (value := loss()) is not None:
        row["loss"] = value
      if rounds > 1:
        row["ms_rounds"] = [round(t, 3) for t in times[provider]]
      row.update(ms=ms, tflops=flops / ms / 1e9,
                 ratio_to_floor=None if floor_ms is None else ms / floor_ms,
                 **clocks.get(provider, {}))
      rows.append(row)
      _harness.append(out, [row])
      extra = row.get("extra_bytes")
      print(f"  {provider:32s} {ms:9.2f} ms  x{row['ratio_to_floor'] or float('nan'):.3f}  "
            f"{row['tflops']:7.1f} TFLOP/s  extra "
            f"{'n/a' if extra is None else f'{extra / 2**30:.3f} GiB'}  "
            f"loss {row.get('loss', float('nan')):.5f}{_harness.clock_text(row)}",
            flush=True)
    del cases, times
  return rows


def reference_grads(x, w, y, chunk: int = 2048):
  """(dx, dW) of the mean loss in float32 at HIGHEST precision, over token chunks (the
  float32 logits of every token at once would not fit)."""
  n = x.shape[0]
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)

  @jax.jit
  def grads(x32, w32, y):
    def one(dw, xy):
      xc, yc = xy
      with jax.default_matmul_precision("highest"):
        p = jax.nn.softmax(xc @ w32, axis=-1)
        g = (p - jax.nn.one_hot(yc, w32.shape[1], dtype=jnp.float32)) / n
        return dw + xc.T @ g, g @ w32.T
    dw, dx = jax.lax.scan(one, jnp.zeros_like(w32),
                          (x32.reshape(-1, chunk, x.shape[1]), y.reshape(-1, chunk)))
    return dx.reshape(n, -1), dw

  return grads(x32, w32, y)


def dw_precision(set_name: str, tokens: list[int], providers: list[str], out) -> list[dict]:
  """Relative errors of each provider's dx and dW against reference_grads, per N."""
  spec = _harness.shape_sets("linear_cross_entropy")[set_name]
  d, v = spec["shapes"][0]["d"], spec["shapes"][0]["v"]
  dtype = jnp.dtype(spec.get("dtype", "bfloat16"))
  env, rows = _harness.environment(), []
  rel = jax.jit(lambda a, b: jnp.linalg.norm((a.astype(jnp.float32) - b).ravel())
                / jnp.linalg.norm(b.ravel()))
  for n in tokens:
    x, w, y, kg = make_inputs(n, d, v, dtype)
    dx_ref, dw_ref = reference_grads(x, w, y)
    for provider in providers:
      row = dict(op="lce_dw_precision", set=set_name, n=n, d=d, v=v, dtype=dtype.name,
                 provider=provider, **env)
      try:
        fn, args = jax_case(provider, x, w, y, kg)
        _, (dx, dw) = fn(*args)
        if provider.startswith("memeff") and parse_memeff(provider)[1] == "vd":
          dw = dw.T
        row.update(dw_rel_err=float(rel(dw, dw_ref)), dx_rel_err=float(rel(dx, dx_ref)))
        del dx, dw
      except Exception as err:  # pylint: disable=broad-except
        oom = "RESOURCE_EXHAUSTED" in str(err) or "Out of memory" in str(err)
        row["error"] = "out of memory" if oom else f"{type(err).__name__}: {err}"[:300]
      rows.append(row)
      _harness.append(out, [row])
      print(f"  N={n:7d} {provider:40s} " + (
          f"dW {row['dw_rel_err']:.2e}  dx {row['dx_rel_err']:.2e}" if "error" not in row
          else row["error"][:120]), flush=True)
    del x, w, y, dx_ref, dw_ref
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--set", default="small", help="shape set from configs/benchmarks")
  parser.add_argument("--providers", default=DEFAULT_PROVIDERS)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=1,
                      help="interleaved rounds per shape; each figure is the median over them")
  parser.add_argument("--dw-precision", default=None, metavar="N,N,...",
                      help="measure gradient errors against float32 at these token counts "
                           "(the set's first D and V) instead of times")
  parser.add_argument("--out", default=None,
                      help="JSON-lines file (default: results/linear_cross_entropy.jsonl, "
                           "with --dw-precision results/lce_dw_precision.jsonl)")
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = str(_harness.RESULTS / ("lce_dw_precision.jsonl" if args.dw_precision
                                       else "linear_cross_entropy.jsonl"))
  providers = [p for p in args.providers.split(",") if p]
  print(f"linear_cross_entropy [{args.set}] on {jax.devices()[0].device_kind}")
  if args.dw_precision:
    tokens = [int(n) for n in args.dw_precision.split(",")]
    dw_precision(args.set, tokens, [p for p in providers if not p.startswith(("torch", "floor"))
                                    and p not in ("liger", "cce")], args.out)
    return
  run(args.set, providers, args.out, args.reps, args.rounds)


if __name__ == "__main__":
  main()
