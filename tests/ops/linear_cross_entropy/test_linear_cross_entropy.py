"""linear_cross_entropy against the float32 reference, for every implementation.

One parameterized base (`_LinearCrossEntropyTest`) takes the implementation; subclasses run
it as chunked_xla, as pallas_mosaic_gpu in the Pallas interpreter (CPU), and on the GPU.
"""

import dataclasses
import re
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import memeff_jax
from memeff_jax.kernels import hopper
from memeff_jax.kernels import mosaic_gemm
from memeff_jax.ops.linear_cross_entropy import ChunkedXla
from memeff_jax.ops.linear_cross_entropy import Int64Labels
from memeff_jax.ops.linear_cross_entropy import SoftmaxKernelConfig
from memeff_jax.ops.linear_cross_entropy import PallasMosaicGpu
from memeff_jax.ops.linear_cross_entropy import _chunked
from memeff_jax.ops.linear_cross_entropy import _common
from memeff_jax.ops.linear_cross_entropy import chunked_xla
from memeff_jax.ops.linear_cross_entropy import pallas_mosaic_gpu
from memeff_jax.ops.linear_cross_entropy import triton_softmax
from memeff_jax.ops.linear_cross_entropy import xla_softmax

jax.config.update("jax_default_matmul_precision", "highest")

# Relative-norm tolerances: ‖got - ref‖ / ‖ref‖.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

OPTION_SETS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-3),
    "softcap": dict(logit_softcap=5.0),
    "bias": dict(bias=True),
    "where": dict(where=True),
    "vd": dict(weight_layout="vd"),
    "softcap_vd": dict(logit_softcap=3.0, z_loss=1e-2, where=True, weight_layout="vd"),
    "smoothing_vd": dict(label_smoothing=0.2, z_loss=1e-2, where=True, weight_layout="vd"),
    "all": dict(label_smoothing=0.2, z_loss=1e-2, logit_softcap=3.0, bias=True, where=True),
    "all_vd": dict(label_smoothing=0.2, z_loss=1e-2, logit_softcap=3.0, bias=True, where=True,
                   weight_layout="vd"),
}


def make_problem(key, lead, d, vocab, dtype, *, bias=False, where=False,
                 weight_layout="dv", ignore_frac=0.2, **_):
  kx, kw, kb, ky, ki, kwh = jax.random.split(key, 6)
  x = jax.random.normal(kx, (*lead, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (d, vocab), jnp.float32) * (2.0 / np.sqrt(d))).astype(dtype)
  if weight_layout == "vd":
    w = w.T
  labels = jax.random.randint(ky, lead, 0, vocab)
  labels = jnp.where(jax.random.uniform(ki, lead) < ignore_frac, -100, labels)
  b = (jax.random.normal(kb, (vocab,)) * 0.5).astype(dtype) if bias else None
  wh = jax.random.uniform(kwh, lead) < 0.8 if where else None
  return x, w, labels, b, wh


def _ppo_clip(log_p, advantages, old_log_p):
  """PPO's clipped surrogate, a token_loss: −min(ρA, clip(ρ, 0.8, 1.2)A), ρ = p / p_old."""
  ratio = jnp.exp(log_p - old_log_p)
  return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1.2) * advantages)


def _ppo_clip_entropy(log_p, entropy, advantages, old_log_p):
  """_ppo_clip less an entropy bonus, nonlinear in the entropy: a token_loss of both."""
  return _ppo_clip(log_p, advantages, old_log_p) - 0.1 * entropy + 0.02 * entropy ** 2


def rel_err(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


def loss_fn(impl, labels, options, chunk_size=None):
  """f(x, w, b, where) of implementation `impl` (None: the reference) with `options`."""
  options = {k: v for k, v in options.items() if k not in ("bias", "where")}

  def f(x, w, b, where):
    return memeff_jax.linear_cross_entropy(
        x, w, labels, bias=b, where=where, implementation=impl or "reference",
        chunk_size=None if impl is None else chunk_size, **options)

  return f


def value_and_grads(f, x, w, b, where, reduction):
  def scalar(x, w, b):
    out = f(x, w, b, where)
    if reduction == "none":  # a fixed, non-uniform cotangent
      ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
      return jnp.sum(out * ct), out
    return out, out

  argnums = (0, 1, 2) if b is not None else (0, 1)
  # One compiled program (not op by op); labels and `where` are constants of it.
  (_, out), grads = jax.jit(jax.value_and_grad(scalar, argnums=argnums, has_aux=True))(x, w, b)
  return out, grads


class _LinearCrossEntropyTest:
  """Subclasses set `impl` (what `implementation=` gets) and `dtypes`."""

  impl = None
  dtypes = (jnp.float32, jnp.bfloat16)
  lead = (2, 37)  # 74 tokens: not a multiple of the chunk
  chunk_size = 16
  option_sets = tuple(OPTION_SETS)  # those test_matches_reference runs

  # Every option set with reduction="mean"; "sum" on plain and all_vd, "none" on all,
  # all_vd and softcap_vd (its backward on pallas_mosaic_gpu's exponential path).
  @pytest.mark.parametrize("name, reduction", [(name, "mean") for name in sorted(OPTION_SETS)]
                           + [("plain", "sum"), ("all_vd", "sum"), ("all", "none"),
                              ("all_vd", "none"), ("softcap_vd", "none")])
  def test_matches_reference(self, name, reduction):
    options = dict(OPTION_SETS[name], reduction=reduction)
    if name not in self.option_sets:
      pytest.skip(f"{type(self).__name__} runs {self.option_sets} (see its docstring)")
    for i, dtype in enumerate(self.dtypes):
      x, w, labels, b, where = make_problem(jax.random.key(i + hash(name) % 1000),
                                            self.lead, 24, 1000, dtype, **options)
      got, got_g = value_and_grads(loss_fn(self.impl, labels, options, self.chunk_size),
                                   x, w, b, where, reduction)
      up = lambda t: None if t is None else t.astype(jnp.float32)
      ref, ref_g = value_and_grads(loss_fn("reference", labels, options),
                                   up(x), up(w), up(b), where, reduction)
      tol = TOL[dtype]
      assert got.shape == ref.shape
      assert np.all(np.isfinite(np.asarray(got)))
      assert rel_err(got, ref) < tol, (dtype, rel_err(got, ref))
      for gg, rg, arg in zip(got_g, ref_g, "xwb"):
        assert gg.dtype == dtype, (arg, gg.dtype)
        assert rel_err(gg, rg) < tol, (dtype, arg, rel_err(gg, rg))

  @pytest.mark.parametrize("name", ["plain", "softcap_vd", "smoothing", "all"])
  def test_loss_alone_matches_reference(self, name):
    """The loss without gradients (its primal: statistics alone, chunk by chunk), per token
    and reduced, with a whole-vocabulary aux lse."""
    if name not in self.option_sets:
      pytest.skip(f"{type(self).__name__} runs {self.option_sets} (see its docstring)")
    x, w, labels, b, where = make_problem(jax.random.key(11), self.lead, 24, 1000, jnp.float32,
                                          **OPTION_SETS[name])
    for reduction in ("none", "mean"):
      options = dict(OPTION_SETS[name], reduction=reduction, return_aux=True)
      got, got_aux = jax.jit(loss_fn(self.impl, labels, options, self.chunk_size))(x, w, b,
                                                                                    where)
      ref, ref_aux = loss_fn("reference", labels, options)(x, w, b, where)
      assert rel_err(got, ref) < TOL[jnp.float32], (reduction, rel_err(got, ref))
      assert rel_err(got_aux.lse, ref_aux.lse) < TOL[jnp.float32]

  def test_large_vocab_matches_optax(self):
    """V = 50,257 (GPT-2), [B, T, D] input, against optax on materialized logits."""
    x, w, labels, _, _ = make_problem(jax.random.key(7), self.lead, 32, 50257, jnp.float32,
                                      ignore_frac=0.0)
    f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, labels, implementation=self.impl,
                                                     chunk_size=self.chunk_size)
    ref_f = lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()
    (got, got_g), (ref, ref_g) = (jax.value_and_grad(g, argnums=(0, 1))(x, w)
                                  for g in (f, ref_f))
    assert rel_err(got, ref) < 2e-5
    for a, b in zip(got_g, ref_g):
      assert rel_err(a, b) < 2e-5

  def test_aux_outputs_and_their_gradients(self):
    options = dict(z_loss=1e-2, label_smoothing=0.1, logit_softcap=4.0)
    x, w, labels, _, _ = make_problem(jax.random.key(3), self.lead, 24, 777, jnp.float32)

    def total(impl, x, w):
      loss, aux = memeff_jax.linear_cross_entropy(
          x, w, labels, return_aux=True, implementation=impl, chunk_size=self.chunk_size,
          **options)
      ct = jnp.sin(jnp.arange(aux.lse.size, dtype=jnp.float32)).reshape(aux.lse.shape)
      return loss + jnp.sum(aux.lse * ct) + 3.0 * aux.z_loss, (loss, aux)

    (_, (got, got_aux)), got_g = jax.value_and_grad(
        lambda x, w: total(self.impl, x, w), argnums=(0, 1), has_aux=True)(x, w)
    (_, (ref, ref_aux)), ref_g = jax.value_and_grad(
        lambda x, w: total("reference", x, w), argnums=(0, 1), has_aux=True)(x, w)
    assert got_aux.lse.shape == labels.shape
    assert rel_err(got, ref) < 2e-5
    assert rel_err(got_aux.lse, ref_aux.lse) < 2e-5
    assert rel_err(got_aux.z_loss, ref_aux.z_loss) < 2e-5
    for a, b in zip(got_g, ref_g):
      assert rel_err(a, b) < 2e-5

  @pytest.mark.parametrize("reduction, aux", [("mean", False), ("sum", False),
                                              ("none", False), ("mean", True),
                                              ("none", True)])
  def test_token_weights_match_the_weighted_reference(self, reduction, aux):
    """token_weights ω (either sign, some 0) against the reference's unweighted per-token
    losses weighted by hand: Σ ω·loss, over the number of counted tokens for a mean; the
    z-loss term weighted so, the log-sum-exp not. Values and the gradients of x, W and ω;
    with ω a constant too (a mean or sum then reduced in the chunk loop)."""
    options = dict(z_loss=1e-2, label_smoothing=0.1)
    x, w, labels, _, where = make_problem(jax.random.key(21), self.lead, 24, 555,
                                          jnp.float32, where=True)
    omega = jax.random.normal(jax.random.key(22), labels.shape).at[0, :5].set(0.0)
    counted = jnp.sum((labels != -100) & where)
    ct = 1.5 + jnp.cos(jnp.arange(labels.size, dtype=jnp.float32)).reshape(labels.shape)
    reduce = lambda t: (jnp.sum(t * ct) if reduction == "none" else
                        jnp.sum(t) / jnp.maximum(counted, 1) if reduction == "mean" else
                        jnp.sum(t))

    def ours(x, w, omega):
      out = memeff_jax.linear_cross_entropy(
          x, w, labels, where=where, token_weights=omega, reduction=reduction,
          return_aux=aux, implementation=self.impl, chunk_size=self.chunk_size, **options)
      loss, extra = out if aux else (out, None)
      total = jnp.sum(loss * ct) if reduction == "none" else loss
      if aux:
        z = jnp.sum(extra.z_loss * ct) if reduction == "none" else extra.z_loss
        total = total + 3.0 * z + jnp.sum(extra.lse * ct ** 2)
      return total

    def by_hand(x, w, omega):
      loss, extra = memeff_jax.linear_cross_entropy(
          x, w, labels, where=where, reduction="none", return_aux=True,
          implementation="reference", **options)
      total = reduce(omega * loss)
      if aux:
        total = total + 3.0 * reduce(omega * extra.z_loss) + jnp.sum(extra.lse * ct ** 2)
      return total

    grads = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, omega)
    (got, got_g), (want, want_g) = grads(ours), grads(by_hand)
    assert rel_err(got, want) < 2e-5, rel_err(got, want)
    for g, r, arg in zip(got_g, want_g, ("x", "w", "token_weights")):
      assert rel_err(g, r) < 2e-5, (arg, rel_err(g, r))
    constant = jax.jit(jax.grad(lambda x, w: ours(x, w, omega), argnums=(0, 1)))(x, w)
    for g, r in zip(constant, want_g):
      assert rel_err(g, r) < 2e-5

  @pytest.mark.parametrize("name, reduction, uses, whole", [
      ("plain", "mean", "loss+entropy", False), ("plain", "none", "entropy", True),
      ("all", "mean", "loss+entropy", True), ("all_vd", "none", "loss+entropy", False),
      ("masked", "sum", "entropy", False)])
  def test_entropy_and_its_gradients(self, name, reduction, uses, whole):
    """Aux.entropy against −Σ p log p of the materialized (biased, capped) logits, and the
    gradients of a sum of it (with the loss and lse, or alone) against JAX's autodiff of
    that formula; on tokens in whole chunks or not. "masked": a bias of −inf on some
    entries, which count as p = 0."""
    options = dict(OPTION_SETS.get(name, dict(bias=True)), reduction=reduction)
    layout, cap = options.get("weight_layout", "dv"), options.get("logit_softcap")
    lead = (4, self.chunk_size) if whole else self.lead
    x, w, labels, b, where = make_problem(jax.random.key(31), lead, 24, 300, jnp.float32,
                                          **options)
    keep = np.ones(300, bool)
    if name == "masked":
      keep[::7] = False
      b = jnp.where(jnp.asarray(keep), b, -jnp.inf)
      labels = jnp.where(jnp.isin(labels, jnp.arange(0, 300, 7)), -100, labels)
    ct = 1.5 + jnp.cos(jnp.arange(labels.size, dtype=jnp.float32)).reshape(labels.shape)

    def plain_entropy(x, w, b):
      z = x @ (w if layout == "dv" else w.T)
      z = z if b is None else z + b
      z = _common.cap_logits(z, cap)[..., keep]
      return -jnp.sum(jax.nn.softmax(z) * jax.nn.log_softmax(z), axis=-1)

    def total(impl, x, w, b):
      loss, aux = loss_fn(impl, labels, dict(options, return_aux=True, entropy=True),
                          self.chunk_size)(x, w, b, where)
      entropy = aux.entropy if impl is not None else plain_entropy(x, w, b)
      out = jnp.sum(entropy * ct)
      if uses == "loss+entropy":
        out = out + jnp.sum(loss * ct ** 2) + 0.5 * jnp.sum(aux.lse)
      return out, entropy

    argnums = (0, 1, 2) if b is not None else (0, 1)
    run = lambda impl: jax.jit(jax.value_and_grad(
        lambda *a: total(impl, *a), argnums=argnums, has_aux=True))(x, w, b)
    (_, got), got_g = run(self.impl)
    (_, want), want_g = run(None)  # the loss by the reference, the entropy by the formula
    assert got.shape == labels.shape and got.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, want) < 2e-5, rel_err(got, want)
    for g, r, arg in zip(got_g, want_g, "xwb"):
      assert np.all(np.isfinite(np.asarray(g))), arg
      assert rel_err(g, r) < 2e-5, (arg, rel_err(g, r))

  @pytest.mark.parametrize("reduction, options, weighted, differentiated", [
      ("mean", {}, False, False), ("sum", {"bias": True, "where": True}, True, False),
      ("mean", {"logit_softcap": 3.0, "weight_layout": "vd", "where": True}, True, True),
      ("none", {}, False, True), ("none", {"bias": True, "logit_softcap": 3.0}, True, False),
      ("mean", {"aux": True}, False, True), ("mean", {"entropy": True}, False, False),
      ("sum", {"entropy": True, "where": True, "weight_layout": "vd"}, True, True),
      ("none", {"entropy": True, "aux": True, "bias": True}, False, True)])
  def test_token_loss_matches_plain_jax(self, reduction, options, weighted, differentiated):
    """A PPO-style clipped objective as token_loss against JAX's autodiff of the same f on
    the materialized log-probabilities: values and the gradients of x, W, the bias, the
    token weights and f's arguments (differentiated, or constants: a mean or sum then
    reduced in the chunk loop); "aux" adds the differentiated log-sum-exps (and entropies);
    "entropy" gives f the entropy too, less a bonus for it."""
    options = dict(options)
    aux, entropy = options.pop("aux", False), options.pop("entropy", False)
    token_loss = _ppo_clip_entropy if entropy else _ppo_clip
    layout, cap = options.get("weight_layout", "dv"), options.get("logit_softcap")
    x, w, labels, b, where = make_problem(jax.random.key(41), self.lead, 24, 300,
                                          jnp.float32, **options)
    keys = jax.random.split(jax.random.key(42), 3)
    advantages = jax.random.normal(keys[0], labels.shape)
    omega = jax.random.uniform(keys[1], labels.shape) if weighted else None
    z = x @ (w if layout == "dv" else w.T)
    z = _common.cap_logits(z if b is None else z + b, cap)
    safe = jnp.where(labels < 0, 0, labels)
    # Old log-probs near the current ones: some ratios clipped, some not.
    old = (jnp.take_along_axis(jax.nn.log_softmax(z), safe[..., None], -1)[..., 0]
           + 0.3 * jax.random.normal(keys[2], labels.shape))
    counted = (labels != -100) if where is None else (labels != -100) & where
    ct = 1.5 + jnp.cos(jnp.arange(labels.size, dtype=jnp.float32)).reshape(labels.shape)

    def ours(x, w, b, adv, old, omega):
      out = memeff_jax.linear_cross_entropy(
          x, w, labels, bias=b, where=where, token_weights=omega, token_loss=token_loss,
          token_loss_args=(adv, old), reduction=reduction, return_aux=aux, entropy=entropy,
          weight_layout=layout, logit_softcap=cap, implementation=self.impl,
          chunk_size=self.chunk_size)
      loss, extra = out if aux else (out, None)
      total = jnp.sum(loss * ct) if reduction == "none" else loss
      if aux:
        total = total + jnp.sum(extra.lse * ct)
        total = total + (jnp.sum(extra.entropy * ct ** 2) if entropy else 0.0)
      return total

    def plain(x, w, b, adv, old, omega):
      z = x @ (w if layout == "dv" else w.T)
      z = _common.cap_logits(z if b is None else z + b, cap)
      log_p = jnp.take_along_axis(jax.nn.log_softmax(z), safe[..., None], -1)[..., 0]
      h = -jnp.sum(jax.nn.softmax(z) * jax.nn.log_softmax(z), axis=-1)
      per_token = jnp.where(counted, _ppo_clip_entropy(log_p, h, adv, old) if entropy
                            else _ppo_clip(log_p, adv, old), 0.0)
      per_token = per_token if omega is None else per_token * omega
      total = (jnp.sum(per_token * ct) if reduction == "none" else
               jnp.sum(per_token) / jnp.maximum(jnp.sum(counted), 1) if reduction == "mean"
               else jnp.sum(per_token))
      if aux:
        total = total + jnp.sum(jax.nn.logsumexp(z, axis=-1) * ct)
        total = total + (jnp.sum(h * ct ** 2) if entropy else 0.0)
      return total

    inputs = (x, w, b, advantages, old, omega)
    argnums = tuple(i for i, t in enumerate(inputs)
                    if t is not None and (differentiated or i < 3))
    run = lambda f: jax.jit(jax.value_and_grad(f, argnums=argnums))(*inputs)
    (got, got_g), (want, want_g) = run(ours), run(plain)
    assert rel_err(got, want) < 2e-5, rel_err(got, want)
    for g, r, arg in zip(got_g, want_g, argnums):
      assert np.all(np.isfinite(np.asarray(g))), arg
      assert rel_err(g, r) < 2e-5, (arg, rel_err(g, r))

  def test_all_tokens_ignored_gives_zero_not_nan(self):
    x, w, labels, _, _ = make_problem(jax.random.key(4), self.lead, 16, 300, jnp.float32)
    labels = jnp.full_like(labels, -100)
    for reduction in ("mean", "sum"):
      loss, grads = jax.value_and_grad(
          lambda x, w: memeff_jax.linear_cross_entropy(
              x, w, labels, reduction=reduction, implementation=self.impl,
              chunk_size=self.chunk_size), argnums=(0, 1))(x, w)
      assert float(loss) == 0.0
      for g in grads:
        assert np.all(np.asarray(g) == 0.0)

  def test_out_of_range_label_gives_nan_for_that_token(self):
    x, w, labels, _, _ = make_problem(jax.random.key(5), (9,), 16, 300, jnp.float32,
                                      ignore_frac=0.0)
    labels = labels.at[3].set(300).at[5].set(-7)
    loss = memeff_jax.linear_cross_entropy(x, w, labels, reduction="none",
                                           implementation=self.impl, chunk_size=4)
    nan = np.isnan(np.asarray(loss))
    assert nan.tolist() == [i in (3, 5) for i in range(9)]
    mean = memeff_jax.linear_cross_entropy(x, w, labels, implementation=self.impl)
    assert np.isnan(float(mean))

  def test_int64_label_words(self):
    """Int64Labels (ids as int32 words, as torch's int64 labels arrive): the loss and
    gradients of the same ids as int32, bit for bit; ignore_index is matched on all 64 bits
    (-100 + 2³² is not ignored) and an id past the int32 range is out of range: NaN."""
    x, w, labels, _, _ = make_problem(jax.random.key(11), self.lead, 16, 300, jnp.float32)
    as_words = lambda y: Int64Labels(jnp.asarray(
        np.asarray(y, np.int64).view(np.int32).reshape(*y.shape, 2)))

    def run(y, reduction="mean"):
      f = lambda x, w: memeff_jax.linear_cross_entropy(
          x, w, y, reduction=reduction, implementation=self.impl, chunk_size=self.chunk_size)
      return jax.value_and_grad(f, argnums=(0, 1))(x, w) if reduction == "mean" else f(x, w)

    (got, got_g), (want, want_g) = run(as_words(labels)), run(labels)
    assert float(got) == float(want)
    for a, b in zip(got_g, want_g):
      np.testing.assert_array_equal(a, b)
    wide = np.asarray(labels, np.int64).reshape(-1)
    wide[:3] = (-100 + 2**32, 2**33 + 5, -100)
    per_token = np.asarray(run(as_words(wide.reshape(labels.shape)), "none")).reshape(-1)
    plain = np.asarray(run(labels, "none")).reshape(-1)
    assert np.isnan(per_token[:2]).all() and per_token[2] == 0.0
    np.testing.assert_array_equal(per_token[3:], plain[3:])

  def test_under_jit_with_default_chunking(self):
    x, w, labels, _, _ = make_problem(jax.random.key(6), self.lead, 16, 500, jnp.float32)
    f = jax.jit(lambda x, w: memeff_jax.linear_cross_entropy(x, w, labels,
                                                             implementation=self.impl))
    ref = memeff_jax.linear_cross_entropy(x, w, labels, implementation="reference")
    assert rel_err(f(x, w), ref) < 2e-5


class TestReferenceMatchesOptax:

  def test_plain_and_smoothing(self):
    x, w, labels, _, _ = make_problem(jax.random.key(0), (50,), 16, 97, jnp.float32,
                                      ignore_frac=0.0)
    logits = x @ w
    got = memeff_jax.linear_cross_entropy(x, w, labels, implementation="reference",
                                          reduction="none")
    want = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    eps = 0.1
    got = memeff_jax.linear_cross_entropy(x, w, labels, implementation="reference",
                                          reduction="none", label_smoothing=eps)
    target = optax.smooth_labels(jax.nn.one_hot(labels, 97), eps)
    np.testing.assert_allclose(got, optax.softmax_cross_entropy(logits, target),
                               rtol=1e-5, atol=1e-5)


class TestChunkedXla(_LinearCrossEntropyTest):
  impl = "chunked_xla"

  def test_vocab_chunks(self):
    """(tokens, vocab) chunks: the two-pass online log-sum-exp path, ragged both ways."""
    options = OPTION_SETS["all"]
    x, w, labels, b, where = make_problem(jax.random.key(8), self.lead, 24, 1000,
                                          jnp.float32, **options)
    for reduction in ("mean", "none"):
      opts = dict(options, reduction=reduction)
      got, got_g = value_and_grads(loss_fn("chunked_xla", labels, opts, (16, 300)),
                                   x, w, b, where, reduction)
      ref, ref_g = value_and_grads(loss_fn("reference", labels, opts), x, w, b, where,
                                   reduction)
      assert rel_err(got, ref) < 2e-5
      for a, r in zip(got_g, ref_g):
        assert rel_err(a, r) < 2e-5

  def test_entropy_in_vocab_chunks(self):
    """The entropy's Σ p ẑ merged over ragged vocabulary blocks (online, as the log-sum-exp),
    and its gradient block by block: those of the whole-vocabulary path."""
    options = dict(OPTION_SETS["all"], reduction="none", return_aux=True, entropy=True)
    x, w, labels, b, where = make_problem(jax.random.key(9), self.lead, 24, 1000,
                                          jnp.float32, **options)
    ct = jnp.cos(jnp.arange(labels.size, dtype=jnp.float32)).reshape(labels.shape)
    run = lambda chunk: jax.value_and_grad(
        lambda x, w, b: jnp.sum(loss_fn("chunked_xla", labels, options, chunk)(
            x, w, b, where)[1].entropy * ct), argnums=(0, 1, 2))(x, w, b)
    (got, got_g), (want, want_g) = run((16, 300)), run(16)
    assert rel_err(got, want) < 2e-6
    for a, r in zip(got_g, want_g):
      assert rel_err(a, r) < 2e-5

  def test_budget_picks_vocab_chunks_for_huge_vocab(self):
    impl = ChunkedXla(memory_budget_bytes=1 << 20)
    assert impl.plan(4096, 256000, None) == (16, 5376)
    # 87 tokens fit; 48 chunks are needed either way, so they are balanced at 86.
    assert impl.plan(4096, 1000, None) == (86, 1000)

  def test_balanced_chunk(self):
    from memeff_jax.ops.linear_cross_entropy._chunked import balanced_chunk
    assert balanced_chunk(16384, 1024) == 1024
    assert balanced_chunk(16000, 1024) == 1024  # 16 chunks of ≤ 1,000, rounded to 128
    assert balanced_chunk(9000, 1024) == 1024
    assert balanced_chunk(5000, 4096) == 2560
    assert balanced_chunk(100, 4096) == 100
    assert balanced_chunk(16384, 2560) == 2048  # 8 exact chunks, not 6 and a ragged one
    assert balanced_chunk(12288, 2560) == 2048
    assert balanced_chunk(16896, 2560) == 2432  # no exact 8
    # With min_exact: the largest exact chunk of at least min_exact and half the chunk.
    assert balanced_chunk(16384, 3968, min_exact=1024) == 2048  # 8, not 5 of 3,328
    assert balanced_chunk(16384, 3968) == 3328  # no exact 6
    assert balanced_chunk(16000, 1024, min_exact=1024) == 1024  # 640 divides, but is short
    assert balanced_chunk(16384, 3968, min_exact=3072) == 3328
    assert balanced_chunk(20480, 7936, min_exact=1024) == 5120  # the largest: 4, not 8


@dataclasses.dataclass(frozen=True)
class _TiledTail(ChunkedXla):
  """chunked_xla whose ragged chunk runs on a backend of its own that takes whole tiles of
  `rows` rows, as the Mosaic GEMMs take 128 (recording the rows each of its calls saw)."""

  rows: int = 16
  seen: list = dataclasses.field(default_factory=list, compare=False)

  def __call__(self, x, weight, bias, labels, valid, weights=None, *, opts, chunk_size=None,
               vocab=None):
    tokens, cols = self.plan(x.shape[0], opts.vocab_size, chunk_size)
    seen = self.seen

    @dataclasses.dataclass(frozen=True)
    class Tiled(chunked_xla.XlaChunkBackend):
      row_multiple: int = self.rows

      def stats(self, x_c, *args, **kwargs):
        seen.append(x_c.shape[0])
        return super().stats(x_c, *args, **kwargs)

      def grads(self, x_c, *args, **kwargs):
        seen.append(x_c.shape[0])
        return super().grads(x_c, *args, **kwargs)

    static = _chunked.Static(chunked_xla.XlaChunkBackend(opts=opts, vocab_chunk=cols), opts,
                             tokens, tail_backend=Tiled(opts=opts, vocab_chunk=cols))
    return _chunked.chunked_loss(static, x, weight, bias, labels, valid, weights)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ragged_chunk_padded_to_its_backends_tiles(reduction):
  """74 tokens in chunks of 32: two whole chunks, and the ragged 10 run first by the tail
  backend, padded to 16 rows; no loss, statistic or gradient shows the padding."""
  options = dict(OPTION_SETS["all"], reduction=reduction)
  x, w, labels, b, where = make_problem(jax.random.key(23), (74,), 24, 1000, jnp.float32,
                                        **options)
  impl = _TiledTail()
  got, got_g = value_and_grads(loss_fn(impl, labels, options, 32), x, w, b, where, reduction)
  ref, ref_g = value_and_grads(loss_fn("reference", labels, options), x, w, b, where,
                               reduction)
  assert impl.seen and set(impl.seen) == {16}, impl.seen
  assert got.shape == ref.shape and rel_err(got, ref) < 2e-5
  for a, r in zip(got_g, ref_g):
    assert rel_err(a, r) < 2e-5


class TestPallasGpuInterpret(_LinearCrossEntropyTest):
  impl = PallasMosaicGpu(interpret=True)
  dtypes = (jnp.float32, jnp.bfloat16)


  def test_vocab_padding_is_invisible(self):
    """W padded to a multiple of 64 columns (V = 1,000 → 1,024) gives the unpadded result."""
    for layout in ("dv", "vd"):
      options = dict(bias=True, weight_layout=layout, logit_softcap=3.0)
      x, w, labels, b, _ = make_problem(jax.random.key(9), (40,), 16, 1000, jnp.float32,
                                        **options)
      results = [value_and_grads(loss_fn(PallasMosaicGpu(interpret=True, vocab_multiple=m), labels,
                                         options, 16), x, w, b, None, "mean")
                 for m in (1, 64)]
      (l1, g1), (l2, g2) = results
      assert g2[1].shape == w.shape and g2[2].shape == b.shape
      assert rel_err(l1, l2) < 1e-6
      for a, c in zip(g1, g2):
        assert rel_err(a, c) < 1e-6

  def test_one_chunk_padded_to_whole_tiles(self):
    """200 tokens where a chunk holds more: one chunk, planned at 256 rows for the Mosaic
    GEMMs (which pad it to them), and neither the losses, the log-sum-exps nor the
    gradients show the rows it does not have."""
    assert self.impl.plan(200, 1024, 4, None) == 256
    assert self.impl.plan(256, 1024, 4, None) == 256
    options = dict(z_loss=1e-2, label_smoothing=0.1)
    x, w, labels, _, where = make_problem(jax.random.key(21), (200,), 16, 1000, jnp.float32,
                                          where=True)
    for reduction in ("mean", "none"):

      def total(impl, x, w):
        loss, aux = memeff_jax.linear_cross_entropy(
            x, w, labels, where=where, return_aux=True, implementation=impl,
            reduction=reduction, **options)
        ct = jnp.sin(jnp.arange(aux.lse.size, dtype=jnp.float32))
        return jnp.sum(loss * jnp.cos(jnp.arange(loss.size))) + jnp.sum(aux.lse * ct), (
            loss, aux.lse)

      (_, got), got_g = jax.value_and_grad(lambda x, w: total(self.impl, x, w),
                                           argnums=(0, 1), has_aux=True)(x, w)
      (_, ref), ref_g = jax.value_and_grad(lambda x, w: total("reference", x, w),
                                           argnums=(0, 1), has_aux=True)(x, w)
      for a, b in zip((*got, *got_g), (*ref, *ref_g)):
        assert a.shape == b.shape, (reduction, a.shape, b.shape)
        assert rel_err(a, b) < 2e-5, reduction

  def test_many_vocab_blocks(self):
    """Kernel blocks of 128 columns over V = 1,000: seven whole blocks, of which those holding
    a label take the kernel's label branch, and a masked ragged eighth; every option that
    changes G, and `none` (whose gradients come from a second pass with a known lse)."""
    impl = PallasMosaicGpu(interpret=True, vocab_multiple=1,
                           kernel=SoftmaxKernelConfig(block_v=128))
    for options, reduction in ((dict(), "mean"),
                               (dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0,
                                     bias=True), "mean"),
                               (dict(label_smoothing=0.2, reduction="none"), "none")):
      x, w, labels, b, _ = make_problem(jax.random.key(3), (40,), 16, 1000, jnp.float32,
                                        **options)
      out, grads = value_and_grads(loss_fn(impl, labels, options, 16), x, w, b, None, reduction)
      ref_out, ref_grads = value_and_grads(loss_fn("reference", labels, options), x, w, b, None,
                                           reduction)
      assert rel_err(out, ref_out) < 1e-5, options
      for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-5, options


def _softmax_pass_problem(key, vocab):
  """(logits [37, 1,000] bf16 with zeros past `vocab`, labels with one ignored, a, e)."""
  k = jax.random.split(key, 4)
  z = (4 * jax.random.normal(k[0], (37, 1000), jnp.float32)).astype(jnp.bfloat16)
  z = z.at[:, vocab:].set(0)  # padding columns hold zero logits
  labels = jax.random.randint(k[1], (37,), 0, vocab).at[3].set(-100)
  return (z, labels, jax.random.uniform(k[2], (37,), jnp.float32),
          jax.random.uniform(k[3], (37,), jnp.float32))


_PASS_OUTPUTS = ("G", "lse", "label logit", "logit sum", "mean logit")


@pytest.mark.parametrize("smoothing,vocab,entropy", [(0.0, 1000, False), (0.1, 1000, False),
                                                     (0.0, 936, False), (0.1, 936, True)])
def test_softmax_pass_from_partial_log_sum_exps(smoothing, vocab, entropy):
  """Given partial log-sum-exps over disjoint column sets (as the Mosaic logits GEMM's
  epilogue makes them), the kernel skips its first sweep: G, the log-sum-exp, the label
  logit and Σ ẑ (and with the entropy μ = Σ p ẑ, and G with its cotangent) are those of
  the two-sweep kernel, μ that of its formula. 1,000 columns, of which the last 64 are
  padding in the 936 case; 37 rows; five uneven column sets, one of them empty (-inf)."""
  opts = _common.LossOptions(vocab_size=vocab, label_smoothing=smoothing, z_loss=1e-3,
                             entropy=entropy)
  z, labels, a, e = _softmax_pass_problem(jax.random.key(21), vocab)
  bounds = [0, 120, 500, 500, 730, vocab]
  zf = z.astype(jnp.float32)
  partials = jnp.stack([jax.nn.logsumexp(zf[:, lo:hi], axis=1) if hi > lo
                        else jnp.full((37,), -jnp.inf) for lo, hi in zip(bounds, bounds[1:])])
  config = SoftmaxKernelConfig(block_v=256)
  kw = {}
  if entropy:
    mu = jnp.sum(jax.nn.softmax(zf[:, :vocab]) * zf[:, :vocab], axis=1)
    kw = dict(entropy=(jnp.sin(jnp.arange(37.0)), mu))
  want = triton_softmax.softmax_pass(z, labels, a, e, opts=opts, config=config, interpret=True,
                                     **kw)
  got = triton_softmax.softmax_pass(z, labels, a, e, opts=opts, config=config, interpret=True,
                                partials=partials, **kw)
  assert len(got) == len(want) == 4 + entropy
  if entropy:
    np.testing.assert_allclose(want[-1], mu, rtol=2e-6, atol=1e-5)
  for name, g, w in zip(_PASS_OUTPUTS, got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=2e-6, atol=1e-5, err_msg=name)
  with pytest.raises(ValueError, match="partials serve the gradient pass"):
    triton_softmax.softmax_pass(z, labels, opts=opts, config=config, partials=partials)

  # The same partials as three bfloat16 words each (mosaic_gemm.StatsWords, what the
  # logits GEMM stores in dx's rows), rows 7 on of a larger array: the same bits.
  words = _split_words(partials)
  assert (sum(w.astype(jnp.float32) for w in words) == partials).all()
  rows = jnp.concatenate([jnp.full((7, 37), 3.0, jnp.bfloat16), *words,
                          jnp.full((5, 37), 3.0, jnp.bfloat16)])
  stored = mosaic_gemm.StatsWords(rows, jnp.int32(7), partials.shape[0])
  from_words = triton_softmax.softmax_pass(z, labels, a, e, opts=opts, config=config,
                                       interpret=True, partials=stored, **kw)
  for name, g, w in zip(_PASS_OUTPUTS, from_words, got):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                  err_msg=name)


def _split_words(x):
  """float32 -> three bfloat16 arrays summing to it exactly (as mosaic_gemm's epilogue
  splits row_stats_into's partials; -inf stays in the first)."""
  hi = x.astype(jnp.bfloat16)
  rest = jnp.where(x == -jnp.inf, 0.0, x - hi.astype(jnp.float32))
  mid = rest.astype(jnp.bfloat16)
  return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def test_pallas_gpu_kernel_lowers_for_cuda():
  """The softmax kernel lowers to Triton on a CPU host (what the GPU would compile): catches
  operations Pallas Triton has no lowering for, which interpret mode runs happily."""
  for vocab, smoothing, entropy in ((128_256, 0.0, False), (50_257, 0.1, False),
                                   (50_257, 0.1, True)):
    opts = _common.LossOptions(vocab_size=vocab, label_smoothing=smoothing, entropy=entropy)
    logits = jax.ShapeDtypeStruct((64, vocab + (-vocab % 64)), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((64,), jnp.int32)
    coef = jax.ShapeDtypeStruct((64,), jnp.float32)
    parts = jnp.zeros((33, 64), jnp.float32)
    words = jnp.zeros((4 * 33 + 5, 64), jnp.bfloat16)
    backward = [lambda z, y, a, e: triton_softmax.softmax_pass(
        z, y, a, e, a, opts=opts, config=SoftmaxKernelConfig(), entropy=(a, e))]
    for fn in (*(backward if entropy else ()),
               lambda z, y, a, e: triton_softmax.softmax_pass(z, y, opts=opts,
                                                          config=SoftmaxKernelConfig()),
               lambda z, y, a, e: triton_softmax.softmax_pass(z, y, a, e, opts=opts,
                                                          config=SoftmaxKernelConfig()),
               lambda z, y, a, e: triton_softmax.softmax_pass(z, y, a, e, opts=opts,
                                                          config=SoftmaxKernelConfig(),
                                                          partials=parts),
               lambda z, y, a, e: triton_softmax.softmax_pass(
                   z, y, a, e, opts=opts, config=SoftmaxKernelConfig(),
                   partials=mosaic_gemm.StatsWords(words, jnp.int32(5), 33))):
      text = jax.jit(fn).trace(logits, labels, coef, coef).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "triton" in text.lower()


class TestPallasGpuExpLogitsInterpret(_LinearCrossEntropyTest):
  """exp_logits with the logits GEMM's XLA equivalent, a logit softcap and label smoothing
  included (each alone). What it does not take (a bias, smoothing under a cap) sends a call
  through the softmax pass, which TestPallasGpuInterpret tests option by option: here only
  together ("all", "all_vd")."""

  impl = PallasMosaicGpu(interpret=True, exp_logits=True)
  option_sets = ("plain", "z_loss", "where", "vd", "softcap", "softcap_vd", "smoothing",
                 "smoothing_vd", "all", "all_vd")


@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("reduction", ["sum", "none", "aux"])
def test_smoothing_apart_matches_reference(layout, reduction, monkeypatch):
  """Label smoothing on the exponential path (interpret mode): the chunks leave G's uniform
  share out and _chunked.smoothing_terms adds it to dx and dW in each pass that makes
  gradients: the forward's for a sum, the backward's for reduction="none", and the
  backward's second pass where return_aux's log-sum-exp is differentiated. 74 tokens in
  chunks of 16 (a ragged one), `where` and a z-loss."""
  passes = []
  add = _chunked.smoothing_terms
  monkeypatch.setattr(_chunked, "smoothing_terms", lambda *a: passes.append(1) or add(*a))
  options = dict(label_smoothing=0.2, z_loss=1e-2, weight_layout=layout)
  x, w, labels, _, where = make_problem(jax.random.key(25), (2, 37), 24, 1000, jnp.float32,
                                        where=True, **options)
  impl = PallasMosaicGpu(interpret=True, exp_logits=True)
  if reduction != "aux":
    options["reduction"] = reduction
    got, got_g = value_and_grads(loss_fn(impl, labels, options, 16), x, w, None, where,
                                 reduction)
    ref, ref_g = value_and_grads(loss_fn("reference", labels, options), x, w, None, where,
                                 reduction)
  else:
    def total(impl, x, w):
      loss, aux = memeff_jax.linear_cross_entropy(x, w, labels, where=where, return_aux=True,
                                                  implementation=impl, chunk_size=16, **options)
      ct = jnp.sin(jnp.arange(aux.lse.size, dtype=jnp.float32)).reshape(aux.lse.shape)
      return loss + jnp.sum(aux.lse * ct), loss

    (_, got), got_g = jax.value_and_grad(lambda x, w: total(impl, x, w), argnums=(0, 1),
                                         has_aux=True)(x, w)
    (_, ref), ref_g = jax.value_and_grad(lambda x, w: total("reference", x, w),
                                         argnums=(0, 1), has_aux=True)(x, w)
  assert passes
  assert rel_err(got, ref) < TOL[jnp.float32]
  for gg, rg in zip(got_g, ref_g):
    assert rel_err(gg, rg) < TOL[jnp.float32]


def test_exp_logits_refuses_float16():
  """E = exp(z) is stored in x's dtype up to e^64: float16 (largest 65,504) cannot hold it,
  so exp_logits=True refuses float16 instead of overflowing (the default leaves it off)."""
  x, w, labels, _, _ = make_problem(jax.random.key(23), (64,), 32, 300, jnp.float16)
  with pytest.raises(NotImplementedError, match="exp_logits.*float16"):
    jax.grad(loss_fn(PallasMosaicGpu(interpret=True, exp_logits=True), labels, {}, 32))(
        x, w, None, None)


def _exp_backend(opts):
  return pallas_mosaic_gpu.ChunkBackend(opts=opts, kernel=SoftmaxKernelConfig(), interpret=True,
                                        dw_accumulation="weight", exp_logits=True)


def _exp_chunk(x, w, labels, a, e, opts, lse=None):
  return jax.jit(_exp_backend(opts)._exp_chunk)(x, w, labels, a, e, None, lse)


@pytest.mark.parametrize("shift,softcap,fast", [
    (0.0, None, True), (30.0, None, True), (-15.0, None, True), (80.0, None, False),
    (-60.0, None, False), (0.0, 20.0, True), (80.0, 20.0, True), (-60.0, 20.0, True),
    (100.0, 70.0, False), (0.0, "smoothing", True), (80.0, "smoothing", False)])
def test_exp_chunk_against_softmax_pass(shift, softcap, fast):
  """One chunk's G as exp_logits makes it (diag(scale) buffer) against the softmax pass's,
  with logits shifted by `shift` (x's last feature is 1, w's last row the shift): inside
  the safe range the buffer holds exponentials (scale ≠ 1), outside it the chunk falls back
  to the softmax pass (scale = 1). A softcap of 20 keeps every shift inside the range (the
  buffer then holds the cap's slope too); one of 70 does not. With label smoothing (no cap)
  both leave its uniform share out (smoothing_apart). Rows with ignored and out-of-range
  labels, a z-loss, and coefficients e as a differentiated log-sum-exp gives them."""
  smoothing = dict(label_smoothing=0.1, smoothing_apart=True) if softcap == "smoothing" else {}
  softcap = None if smoothing else softcap
  opts = _common.LossOptions(vocab_size=1000, z_loss=1e-3, logit_softcap=softcap, **smoothing)
  x, w, labels, _, _ = make_problem(jax.random.key(21), (48,), 32, 1000, jnp.float32)
  x = x.at[:, -1].set(1.0)
  w = w.at[-1].set(shift)
  labels = labels.at[5].set(1000).at[6].set(-7)
  a = jnp.where(labels == -100, 0.0, 1.0 / 48) * (1.0 + jnp.sin(jnp.arange(48.0)))
  e = 0.01 * jnp.cos(jnp.arange(48.0))
  buf, scale, stats = _exp_chunk(x, w, labels, a, e, opts)
  assert bool(jnp.any(scale != 1.0)) == fast
  g = scale[:, None] * buf
  z = x @ w
  want_g, *want = triton_softmax.softmax_pass(z, labels, a, e, opts=opts,
                                              config=SoftmaxKernelConfig(), interpret=True)
  # Near the cap's saturation its slope 1 − tanh² (1.3e-3 at z / c = 4, the shift of 80)
  # holds float32's rounding of tanh relative to its own size: ~1e-4 there, in either form.
  tol = 1e-5 if softcap is None or not shift else 2e-4
  assert rel_err(g, want_g) < tol
  in_range = (labels >= 0) & (labels < 1000)
  for got, ref in zip(stats[:2], want[:2]):  # lse, label logit (logit_sum: smoothing only)
    assert rel_err(jnp.where(in_range, got, 0), jnp.where(in_range, ref, 0)) < 1e-6
  # A backward pass's: G from the forward's log-sum-exps.
  buf, scale, _ = _exp_chunk(x, w, labels, a, e, opts, lse=want[0])
  assert bool(jnp.any(scale != 1.0)) == fast
  assert rel_err(scale[:, None] * buf, want_g) < tol
  # Statistics alone (no gradients): from the row sums, or the pass where out of range.
  got = jax.jit(_exp_backend(opts).stats)(x, w, None, labels)
  for got, ref in zip(got[:2], want[:2]):
    assert rel_err(jnp.where(in_range, got, 0), jnp.where(in_range, ref, 0)) < 1e-6


@pytest.mark.parametrize("shift,fast", [(0.0, True), (80.0, False), (-60.0, False)])
def test_exp_chunk_token_loss_coefficients(shift, fast):
  """A token_loss's coefficients (TokenCoefficients) made from the chunk's statistics: G of
  exp_logits, on the fast path and the fallback, equals the softmax pass's G for the
  coefficients r·(−f'(ℓ)) computed from the reference's statistics."""
  opts = _common.LossOptions(vocab_size=1000, token_loss=_ppo_clip)
  x, w, labels, _, _ = make_problem(jax.random.key(23), (48,), 32, 1000, jnp.float32)
  x, w = x.at[:, -1].set(1.0), w.at[-1].set(shift)
  r = jnp.where(labels == -100, 0.0, 1.0 / 48)
  args = jnp.stack([jnp.sin(jnp.arange(48.0)), jnp.full((48,), -6.9)], axis=1)
  buf, scale, stats = _exp_chunk(x, w, labels, _common.TokenCoefficients(r, args),
                                 jnp.zeros(48), opts)
  assert bool(jnp.any(scale != 1.0)) == fast
  z = x @ w
  lse, label_logit, _ = triton_softmax.softmax_pass(z, labels, opts=opts,
                                                    config=SoftmaxKernelConfig(), interpret=True)
  a, _ = _common.resolve(_common.TokenCoefficients(r, args), label_logit - lse, None, opts)
  assert float(jnp.max(jnp.abs(a))) > 0 and bool(jnp.any((a == 0) & (r != 0)))  # some clipped
  want_g, *_ = triton_softmax.softmax_pass(z, labels, a, jnp.zeros(48), lse, opts=opts,
                                           config=SoftmaxKernelConfig(), interpret=True)
  assert rel_err(scale[:, None] * buf, want_g) < 1e-5
  assert rel_err(stats.lse, lse) < 1e-6


def test_exp_chunk_rows_that_do_not_count_may_leave_the_range():
  """A row with a = e = 0 (an ignored token) whose logits would overflow exp is clamped
  and scaled by 0: the chunk stays on the fast path and that row's G is exactly 0."""
  opts = _common.LossOptions(vocab_size=1000)
  x, w, labels, _, _ = make_problem(jax.random.key(22), (48,), 32, 1000, jnp.float32,
                                    ignore_frac=0.0)
  x = x.at[3].multiply(400.0)  # logits in the hundreds
  a = jnp.full((48,), 1.0 / 47).at[3].set(0.0)
  buf, scale, _ = _exp_chunk(x, w, labels, a, jnp.zeros(48), opts)
  assert bool(jnp.all(jnp.isfinite(buf))) and float(scale[3]) == 0.0
  assert bool(jnp.any(scale != 1.0))
  want_g, *_ = triton_softmax.softmax_pass(x @ w, labels, a, jnp.zeros(48), opts=opts,
                                       config=SoftmaxKernelConfig(), interpret=True)
  assert rel_err(scale[:, None] * buf, want_g) < 1e-5


def test_exp_logits_keeps_the_statistics_of_tokens_of_weight_0():
  """A counted token of weight 0 has coefficients 0, like an ignored one, but its
  log-sum-exp and loss are outputs (Aux.lse, the weights' gradient): where its logits
  leave exp's safe range the chunk takes the softmax pass, so both stay exact."""
  impl = PallasMosaicGpu(interpret=True, exp_logits=True)
  x, w, labels, _, _ = make_problem(jax.random.key(23), (48,), 32, 1000, jnp.float32,
                                    ignore_frac=0.0)
  x = x.at[3].multiply(400.0)  # logits in the hundreds: lse past the safe range
  omega = jnp.linspace(0.5, 2.0, 48).at[3].set(0.0)

  def f(impl, x, w, omega):
    loss, aux = memeff_jax.linear_cross_entropy(x, w, labels, token_weights=omega,
                                                return_aux=True, implementation=impl)
    return loss, aux.lse

  run = lambda impl: jax.value_and_grad(lambda *a: f(impl, *a), argnums=(0, 1, 2),
                                        has_aux=True)(x, w, omega)
  (got, got_lse), got_g = run(impl)
  (want, want_lse), want_g = run("reference")
  assert rel_err(got, want) < 1e-5 and rel_err(got_lse, want_lse) < 1e-5
  for g, r in zip(got_g, want_g):
    assert rel_err(g, r) < 1e-5
  assert float(got_g[2][3]) > 1.0  # the token's loss over 48 tokens: in the hundreds


@pytest.fixture
def without_pallas_triton(monkeypatch):
  """A JAX without Pallas Triton (deprecated there): triton_softmax finds no module."""
  monkeypatch.setattr(triton_softmax, "plgpu", None)


@pytest.mark.usefixtures("without_pallas_triton")
class TestPallasGpuWithoutTritonInterpret(_LinearCrossEntropyTest):
  """pallas_mosaic_gpu where JAX has no Pallas Triton: its softmax pass runs in XLA
  (xla_softmax), every option through it."""

  impl = PallasMosaicGpu(interpret=True)


@pytest.mark.usefixtures("without_pallas_triton")
class TestPallasGpuExpLogitsWithoutTritonInterpret(TestPallasGpuExpLogitsInterpret):
  """exp_logits where JAX has no Pallas Triton: the fallback and the options it does not
  take run XLA's softmax pass (the fallback's in a loop run once or not at all)."""


@pytest.mark.parametrize("block_v", [256, xla_softmax.BLOCK_V])
@pytest.mark.parametrize("smoothing,softcap,vocab,entropy", [
    (0.0, None, 1000, False), (0.1, 5.0, 1000, False), (0.1, None, 936, False),
    (0.0, None, 1000, True), (0.1, 5.0, 936, True)])
def test_xla_softmax_pass_matches_the_kernel(smoothing, softcap, vocab, entropy, block_v,
                                             monkeypatch):
  """xla_softmax.softmax_pass against triton_softmax's kernel (interpret mode) in every form
  the chunks call it: statistics only, G with them, G from a known log-sum-exp (with the
  entropy's cotangent, where wanted), G from partial log-sum-exps (float32 and as bfloat16
  words), and under `enabled` both ways. 1,000 columns, the last 64 padding in the 936
  case; 37 rows, some labels ignored; the sweeps in one block, or in three of 256 and a
  ragged one."""
  monkeypatch.setattr(xla_softmax, "BLOCK_V", block_v)
  opts = _common.LossOptions(vocab_size=vocab, label_smoothing=smoothing, z_loss=1e-3,
                             logit_softcap=softcap, entropy=entropy)
  z, labels, a, e = _softmax_pass_problem(jax.random.key(31), vocab)
  lse = jax.nn.logsumexp(_common.cap_logits(z[:, :vocab].astype(jnp.float32), softcap), axis=1)
  config = SoftmaxKernelConfig(block_v=256)
  on = dict(enabled=jnp.bool_(True))
  calls = [((), {}), ((), on), ((a, e), {}), ((a, e), on), ((a, e, lse), {})]
  if entropy:
    calls.append(((a, e, lse), dict(entropy=(jnp.sin(jnp.arange(37.0)), lse - 2.0))))
  if softcap is None:
    bounds = [0, 120, 500, 730, vocab]
    zf = z.astype(jnp.float32)
    partials = jnp.stack([jax.nn.logsumexp(zf[:, lo:hi], axis=1)
                          for lo, hi in zip(bounds, bounds[1:])])
    rows = jnp.concatenate([jnp.zeros((7, 37), jnp.bfloat16), *_split_words(partials)])
    calls += [((a, e), dict(partials=partials)),
              ((a, e), dict(partials=mosaic_gemm.StatsWords(rows, jnp.int32(7), 4)))]
  for args, kw in calls:
    want = triton_softmax.softmax_pass(z, labels, *args, opts=opts, config=config,
                                       interpret=True, **kw)
    got = jax.jit(lambda z: xla_softmax.softmax_pass(z, labels, *args, opts=opts, **kw))(z)
    assert len(got) == len(want) == (4 if args else 3) + entropy
    names = _PASS_OUTPUTS[:len(got)] if args else _PASS_OUTPUTS[1:]
    for name, g, w in zip(names, got, want):
      assert g.shape == w.shape and g.dtype == w.dtype, (name, g.dtype, w.dtype)
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                 rtol=1e-5, atol=2e-5, err_msg=f"{name} {sorted(kw)}")
  off = xla_softmax.softmax_pass(z, labels, a, e, opts=opts, enabled=jnp.bool_(False))
  np.testing.assert_array_equal(np.asarray(off[0], np.float32), np.asarray(z, np.float32))


def test_softmax_kernel_config_without_pallas_triton_is_an_error(without_pallas_triton):
  """Tiles for the Triton softmax pass where JAX has none: Unsupported, naming `kernel`
  (not ignored); without them the same call runs its pass in XLA."""
  x, w, labels, _, _ = make_problem(jax.random.key(4), (40,), 16, 300, jnp.float32)
  impl = PallasMosaicGpu(interpret=True, kernel=SoftmaxKernelConfig(block_v=128))
  with pytest.raises(NotImplementedError, match=r"kernel=.*pallas\.triton is not importable"):
    loss_fn(impl, labels, {})(x, w, None, None)
  got = loss_fn(PallasMosaicGpu(interpret=True), labels, {})(x, w, None, None)
  assert rel_err(got, loss_fn("reference", labels, {})(x, w, None, None)) < 1e-6


class TestPallasGpuFloat32DwInterpret(_LinearCrossEntropyTest):
  """dW accumulated in float32: the options change the coefficients, not how dW adds up, so
  they run together ("all", "all_vd") beside the plain call, a mask and the "vd" layout."""

  impl = PallasMosaicGpu(interpret=True, dw_accumulation="float32")
  dtypes = (jnp.bfloat16,)
  option_sets = ("plain", "where", "vd", "all", "all_vd")

  @pytest.mark.skip(reason="float32 inputs: identical to TestPallasGpuInterpret")
  def test_large_vocab_matches_optax(self):
    pass

  @pytest.mark.skip(reason="labels are decoded before dW is accumulated: as TestPallasGpuInterpret")
  def test_int64_label_words(self):
    pass


def assert_matches(impl, x, w, labels, options, where=None, reduction="mean", ref_impl=None,
                   tol=TOL[jnp.bfloat16], chunk=256):
  """The loss and gradients of `impl` (chunks of `chunk` tokens) within `tol` of the float32
  reference's, or of `ref_impl` on the same bf16 inputs; gradients in x's dtype."""
  got, got_g = value_and_grads(loss_fn(impl, labels, options, chunk), x, w, None, where,
                               reduction)
  if ref_impl is None:
    up = lambda t: t.astype(jnp.float32)
    ref, ref_g = value_and_grads(loss_fn("reference", labels, options), up(x), up(w), None,
                                 where, reduction)
  else:
    ref, ref_g = value_and_grads(loss_fn(ref_impl, labels, options, chunk), x, w, None,
                                 where, reduction)
  assert rel_err(got, ref) < tol
  for gg, rg, arg in zip(got_g, ref_g, "xw"):
    assert gg.dtype == x.dtype, (arg, gg.dtype)
    assert rel_err(gg, rg) < tol, (arg, rel_err(gg, rg))


@pytest.mark.gpu
class TestChunkedXlaGpu(TestChunkedXla):
  lead = (4, 250)
  chunk_size = 128


@pytest.mark.gpu
class TestPallasGpuOnGpu(_LinearCrossEntropyTest):
  impl = "pallas_mosaic_gpu"
  lead = (4, 250)
  chunk_size = 128


@pytest.mark.gpu
@pytest.mark.usefixtures("without_pallas_triton")
class TestPallasGpuWithoutTritonOnGpu(TestPallasGpuOnGpu):
  """The GPU kernels where JAX has no Pallas Triton: Mosaic GEMMs, XLA's softmax pass."""


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("gemms,dw_accumulation", [(("dw",), "weight"),
                                                   (pallas_mosaic_gpu.GEMMS, "weight"),
                                                   (pallas_mosaic_gpu.GEMMS, "tma_add")])
def test_mosaic_gemms_match_reference(layout, reduction, gemms, dw_accumulation):
  """GEMMs on kernels.mosaic_gemm: three chunks of 256 tokens (the first writes dW, the others
  add into it in place, or by TMA reduce-adds), V = 2,000 padded to 2,048, bf16."""
  options = dict(weight_layout=layout, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
  x, w, labels, _, _ = make_problem(jax.random.key(11), (3, 256), 256, 2000, jnp.bfloat16,
                                    **options)
  impl = PallasMosaicGpu(mosaic_gemms=gemms, dw_accumulation=dw_accumulation)
  assert_matches(impl, x, w, labels, options, reduction=reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(33, 128), (70, 128), (2, 4481)])
@pytest.mark.parametrize("gemms", [None, ("logits", "dx"), pallas_mosaic_gpu.GEMMS])
def test_groups_past_the_rounding_limit_match_reference(gemms, lead):
  """Past max_rounded_chunks (chunks of 128 tokens: 33, 70, and 70 with a ragged one) the
  default adds up dW in groups of 32 chunks (cuBLAS, or Mosaic GEMMs with dW by TMA adds),
  the groups' sums in float32: the loss and gradients match the float32 reference."""
  options = dict(label_smoothing=0.1, z_loss=1e-3)
  x, w, labels, _, _ = make_problem(jax.random.key(17), lead, 256, 2000, jnp.bfloat16,
                                    **options)
  impl = PallasMosaicGpu(mosaic_gemms=gemms)
  assert impl.dw_group(x.size // 256, 128, 2) == 32
  assert_matches(impl, x, w, labels, options, chunk=128, tol=1e-2)


@pytest.mark.parametrize("lead", [(70, 4), (2, 141)])
def test_dw_groups_match_reference(lead):
  """The chunk loop in groups (interpreted kernels: 4-token chunks, 70 of them, and 70 with a
  ragged one; 32 a group): dW's groups summed in float32 land closer to the float32
  reference's dW than one bf16 sum over every chunk, and the loss and dx match."""
  options = dict(label_smoothing=0.1)
  x, w, labels, _, _ = make_problem(jax.random.key(3), lead, 64, 500, jnp.bfloat16, **options)
  grouped = PallasMosaicGpu(interpret=True)
  assert grouped.dw_group(x.size // 64, 4, 2) == 32
  assert_matches(grouped, x, w, labels, options, chunk=4)
  f32 = lambda t: t.astype(jnp.float32)
  _, (_, ref) = value_and_grads(loss_fn(None, labels, options), f32(x), f32(w), None, None,
                                "mean")
  errors = [rel_err(value_and_grads(loss_fn(impl, labels, options, 4), x, w, None, None,
                                    "mean")[1][1], ref)
            for impl in (grouped, PallasMosaicGpu(interpret=True, dw_accumulation="weight"))]
  assert errors[0] < 0.85 * errors[1], errors


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("d", [256, 512])
def test_fused_lse_matches_reference(layout, smoothing, d):
  """fused_lse: the logits GEMM's epilogue gives the log-sum-exp (its 48 padding columns of
  V = 2,000 left out), the softmax pass reads the logits once; mean over three chunks. At
  D = 512 the partials go into dx's rows of the chunk as words (132 SMs: 3 · 132 · 256
  words fit in 256 × 512), at 256 they do not fit and are an array of their own."""
  options = dict(weight_layout=layout, label_smoothing=smoothing, z_loss=1e-3)
  x, w, labels, _, _ = make_problem(jax.random.key(13), (3, 256), d, 2000, jnp.bfloat16,
                                    **options)
  impl = PallasMosaicGpu(mosaic_gemms=pallas_mosaic_gpu.GEMMS, dw_accumulation="tma_add",
                         fused_lse=True)
  assert_matches(impl, x, w, labels, options)
  with pytest.raises(NotImplementedError, match="fused_lse.*no bias and applies no logit_softcap"):
    memeff_jax.linear_cross_entropy(x, w, labels, weight_layout=layout, logit_softcap=30.0,
                                    implementation=impl, chunk_size=256)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("gemms,dw_accumulation", [((), "weight"),
                                                   (("dw",), "tma_add"),
                                                   (("dx",), "weight"),
                                                   (pallas_mosaic_gpu.GEMMS, "tma_add")])
@pytest.mark.parametrize("shift", [0.0, 70.0])
def test_exp_logits_matches_reference(layout, gemms, dw_accumulation, shift):
  """exp_logits on the GPU: the Mosaic logits GEMM stores exp(z) and its rows' sums (V =
  2,000 padded to 2,048), three chunks of 256 tokens, a z-loss and `where`. With every
  logit shifted by 70 (x's last feature 1, w's last row 70) every chunk falls back to the
  softmax pass, through the same buffer. A Mosaic dW GEMM reads x's scaled rows from dx's
  rows, which a Mosaic dx GEMM then writes in place and scales there."""
  options = dict(weight_layout=layout, z_loss=1e-3, where=True)
  x, w, labels, _, where = make_problem(jax.random.key(14), (3, 256), 256, 2000, jnp.bfloat16,
                                        **options)
  x = x.at[:, -1].set(1.0)
  w = w.at[-1].set(shift) if layout == "dv" else w.at[:, -1].set(shift)
  impl = PallasMosaicGpu(mosaic_gemms=gemms, dw_accumulation=dw_accumulation, exp_logits=True)
  if shift:  # bf16 logits near 70 are 0.5 apart: against the same kernels' softmax pass
    same = PallasMosaicGpu(mosaic_gemms=tuple(sorted(set(gemms) | {"logits"})),
                     dw_accumulation=dw_accumulation, exp_logits=False)
    assert_matches(impl, x, w, labels, options, where, ref_impl=same, tol=1e-3)
  else:
    assert_matches(impl, x, w, labels, options, where)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("reduction, shift", [("mean", 0.0), ("none", 0.0), ("mean", 70.0)])
def test_token_loss_on_the_default_gemms_matches_reference(layout, reduction, shift):
  """A token_loss (PPO's clipped surrogate) through the default implementation in bf16:
  its coefficients made from the exp GEMM's row sums, or, every logit shifted by 70, from
  the softmax pass it falls back to (against the same kernels' softmax pass there)."""
  x, w, labels, _, where = make_problem(jax.random.key(16), (3, 256), 256, 2000, jnp.bfloat16,
                                        weight_layout=layout, where=True)
  x = x.at[:, -1].set(1.0)
  w = w.at[-1].set(shift) if layout == "dv" else w.at[:, -1].set(shift)
  ks = jax.random.split(jax.random.key(17))
  old = jnp.log(1 / 2000.0) + 0.3 * jax.random.normal(ks[0], labels.shape)
  options = dict(weight_layout=layout, where=True, reduction=reduction, token_loss=_ppo_clip,
                 token_loss_args=(jax.random.normal(ks[1], labels.shape), old))
  if shift:
    assert_matches("pallas_mosaic_gpu", x, w, labels, options, where, reduction, tol=1e-3,
                   ref_impl=PallasMosaicGpu(exp_logits=False))
  else:
    assert_matches("pallas_mosaic_gpu", x, w, labels, options, where, reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["softcap", "smoothing"])
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("n, reduction", [(712, "mean"), (712, "none"), (4096, "mean")])
def test_capped_or_smoothed_exp_logits_match_reference(option, layout, n, reduction):
  """Gemma-2's logit softcap (30), or label smoothing (0.1), on the exp path with the default
  GEMMs in both layouts: the exp GEMM stores exp(ẑ) times the cap's slope (logits up to
  about ±90, which the cap bends), or smoothing's uniform share goes to dx and dW after the
  chunks. 712 tokens in chunks of 256 (a ragged one first) and 4,096 in the default's
  chunks, a z-loss and `where`; reduction="none", whose backward pass takes the exp path
  with the forward's log-sum-exps."""
  extra = dict(logit_softcap=30.0) if option == "softcap" else dict(label_smoothing=0.1)
  options = dict(weight_layout=layout, z_loss=1e-3, where=True, reduction=reduction, **extra)
  x, w, labels, _, where = make_problem(jax.random.key(24), (n,), 256, 2000, jnp.bfloat16,
                                        **options)
  w = w * (12 if option == "softcap" else 3)
  f = lambda x, w: jnp.sum(memeff_jax.linear_cross_entropy(
      x, w, labels, where=where, implementation="pallas_mosaic_gpu",
      **{k: v for k, v in options.items() if k != "where"}))
  # (reduction="none": the forward's statistics from its row sums, the backward's G.)
  assert "lce_exp_logits_gemm" in str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
  assert_matches(PallasMosaicGpu(), x, w, labels, options, where, reduction=reduction,
                 chunk=256 if n == 712 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("option", ["plain", "softcap", "shifted"])
def test_loss_alone_from_the_exp_gemms_row_sums(layout, option):
  """The loss without gradients on the GPU's exp path: the exp GEMM stores its row sums
  alone (store=False) and the label logits are dots of x's rows with W's label columns; a
  logit softcap of 30 on logits up to about ±90. With every logit shifted by 70 each
  chunk's lse leaves the safe range, and the chunk takes the logits GEMM and the softmax
  pass instead (against the same pass on the same kernels' logits: bf16 logits near 70 are
  0.5 apart). 712 tokens in chunks of 256 (a ragged one first), per token and mean, with
  the aux lse."""
  options = dict(weight_layout=layout, z_loss=1e-3, where=True)
  if option == "softcap":
    options["logit_softcap"] = 30.0
  x, w, labels, _, where = make_problem(jax.random.key(26), (712,), 256, 2000, jnp.bfloat16,
                                        **options)
  if option == "softcap":
    w = w * 12
  if option == "shifted":
    x = x.at[:, -1].set(1.0)
    w = w.at[-1].set(70.0) if layout == "dv" else w.at[:, -1].set(70.0)
  up = lambda t: t.astype(jnp.float32)
  for reduction in ("none", "mean"):
    opts = dict(options, reduction=reduction, return_aux=True)
    f = jax.jit(loss_fn(PallasMosaicGpu(), labels, opts, 256))
    assert "lce_exp_logits_gemm" in str(jax.make_jaxpr(f)(x, w, None, where))
    got, got_aux = f(x, w, None, where)
    if option == "shifted":
      same = PallasMosaicGpu(mosaic_gemms=("logits",), dw_accumulation="weight",
                             exp_logits=False)
      ref, ref_aux = jax.jit(loss_fn(same, labels, opts, 256))(x, w, None, where)
      tol = 1e-3
    else:
      ref, ref_aux = loss_fn("reference", labels, opts)(up(x), up(w), None, where)
      tol = 1e-4
    assert rel_err(got, ref) < tol, (reduction, rel_err(got, ref))
    assert rel_err(got_aux.lse, ref_aux.lse) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("gemms, d, layout", [(pallas_mosaic_gpu.GEMMS, 512, "dv"),
                                              (("logits", "dw"), 512, "dv"),
                                              (("logits", "dw"), 768, "dv"),
                                              ((), 512, "vd"), ((), 768, "vd")])
@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_own_slot_ping_pong_gemms_match_reference(gemms, d, layout, kind, tuned_as):
  """Two chunks of 512 tokens on the tuned ping-pong tiles: at D = 512 the exp GEMM's 8 K
  steps and the dW GEMM's 8, as at Llama-3-8B's shape (the other tests' 256-token chunks
  take the dW GEMM's ring fallback); at D = 768 (GPT-2's) the exp GEMM's 12 steps on the
  H100's 128 × 192 tiles, which they fill unevenly, and on the H200's 6-slot fallback. The
  second chunk adds into dW by TMA. With ("logits", "dw") dx is cuBLAS's, as the default at
  Gemma-2's shape; in the "vd" layout dx and dW are cuBLAS's beside the same exp GEMM
  tiles, as its default."""
  tuned_as(kind)
  keys = ("logits", "dw_tma") if "dw" in gemms else ("logits",)
  for key, k in zip(keys, (d, 512)):  # K: D for the logits, a chunk's 512 tokens for dW
    assert pallas_mosaic_gpu.tuned_gemm_config(key, layout, k).schedule == "pingpong"
  options = dict(weight_layout=layout, z_loss=1e-3)
  x, w, labels, _, _ = make_problem(jax.random.key(17), (2, 512), d, 2000, jnp.bfloat16,
                                    **options)
  impl = PallasMosaicGpu(mosaic_gemms=gemms, dw_accumulation="tma_add" if gemms else None,
                         exp_logits=True)
  assert_matches(impl, x, w, labels, options, chunk=512)


@pytest.mark.gpu
def test_cublas_dx_beside_the_mosaic_dw_gemm_copies_no_dx():
  """GPT-2's head in two chunks of 2,048 with dx on cuBLAS and dW on kernels.mosaic_gemm
  (the default on an H200; an H100's puts dW on cuBLAS too): dx's rows are written in place
  and the compiled program copies no [N, D] buffer (x's scaled rows waiting in dx's rows
  for the dW GEMM made XLA copy all of dx twice a chunk)."""
  x, w, labels, _, _ = make_problem(jax.random.key(23), (4096,), 768, 50257, jnp.bfloat16)
  impl = PallasMosaicGpu(mosaic_gemms=("logits", "dw"), dw_accumulation="tma_add",
                         exp_logits=True)
  f = jax.jit(jax.value_and_grad(lambda x, w: memeff_jax.linear_cross_entropy(
      x, w, labels, implementation=impl), argnums=(0, 1)))
  hlo = f.lower(x, w).compile().as_text()
  assert "lce_dw_gemm" in str(jax.make_jaxpr(f)(x, w))
  assert not re.search(r"bf16\[4096,768\]\S* copy\(", hlo)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [712, 700])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("gemms", [pallas_mosaic_gpu.GEMMS, ("logits", "dw")])
def test_mosaic_gemms_on_chunks_that_do_not_divide_the_tokens(gemms, reduction, n):
  """712 tokens in chunks of 256: two whole chunks read x's rows and write dx's in place,
  and the ragged 200 tokens run first, padded to 256 rows, on tiles of their own, writing
  dW (exp GEMM, dW by TMA adds). 700 tokens, no whole number of TMA's 8-row tiles: every
  chunk an array of its own."""
  options = dict(weight_layout="dv", reduction=reduction, z_loss=1e-3)
  x, w, labels, _, _ = make_problem(jax.random.key(18), (n,), 256, 2000, jnp.bfloat16,
                                    **options)
  impl = PallasMosaicGpu(mosaic_gemms=gemms, dw_accumulation="tma_add", exp_logits=True)
  assert_matches(impl, x, w, labels, options, reduction=reduction, chunk=256)


@pytest.mark.gpu
@pytest.mark.parametrize("d,tiles", [(2304, ("m", 64, 144)), (3584, ("n", 128, 112))])
def test_dx_gemm_in_tiles_narrowed_to_fill_the_waves(d, tiles):
  """Gemma-2's and Qwen2.5's hidden sizes at 1,024-token chunks: dx's tiles narrowed from
  128 × 256 (to 128 × 144 split along M, 128 × 224 along N on 132 SMs), with dx's rows
  written and scaled in place."""
  options = dict(weight_layout="dv", reduction="mean")
  x, w, labels, _, _ = make_problem(jax.random.key(19), (2048,), d, 1000, jnp.bfloat16,
                                    **options)
  impl = PallasMosaicGpu(mosaic_gemms=pallas_mosaic_gpu.GEMMS, dw_accumulation="tma_add",
                         exp_logits=True)
  dx = dict(impl.gemm_configs(1024, d, 1024, x.dtype, w.dtype, "dv"))["dx"]
  if hopper.sm_count() == 132:
    assert (dx.wg_split, dx.tile_m, dx.tile_n) == tiles
  assert_matches(impl, x, w, labels, options, chunk=1024)


@pytest.mark.gpu
def test_narrowed_exp_gemm_matches_reference():
  """512 tokens at D = 4,096, V = 32,000 in one chunk (Mistral-7B's head, as the default
  runs it at 512 tokens): the exp GEMM on 128-column tiles and 6 slots, which K's 64 steps
  fill unevenly."""
  options = dict(weight_layout="dv", z_loss=1e-3)
  x, w, labels, _, _ = make_problem(jax.random.key(20), (512,), 4096, 32000, jnp.bfloat16,
                                    **options)
  impl = PallasMosaicGpu(mosaic_gemms=("logits", "dw"), dw_accumulation="tma_add",
                         exp_logits=True)
  if hopper.sm_count() == 132:
    logits = dict(impl.gemm_configs(512, 4096, 32000, x.dtype, w.dtype, "dv"))["logits"]
    assert (logits.tile_n, logits.max_concurrent_steps) == (128, 6)
  assert_matches(impl, x, w, labels, options, chunk=512)


@pytest.mark.gpu
def test_a_call_under_one_chunk_runs_on_whole_tiles():
  """1,000 tokens at Gemma-2's hidden size: the default pads them to one chunk of 1,024 and
  runs the exp GEMM (which takes whole 128-row tiles) rather than cuBLAS and the softmax
  pass."""
  options = dict(weight_layout="dv", z_loss=1e-3)
  x, w, labels, _, _ = make_problem(jax.random.key(22), (1000,), 2304, 4000, jnp.bfloat16,
                                    **options)
  f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, labels,
                                                   implementation="pallas_mosaic_gpu")
  assert "lce_exp_logits_gemm" in str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
  assert_matches(PallasMosaicGpu(), x, w, labels, options, chunk=None)
  assert_matches(PallasMosaicGpu(), x, w, labels, dict(options, reduction="none"),
                 reduction="none", chunk=None)


@pytest.mark.gpu
def test_exp_logits_is_the_default_where_it_serves():
  """The default pallas_mosaic_gpu runs the exp GEMM for a bf16 mean loss, with a softcap or
  label smoothing too, with or without the other GEMMs on kernels.mosaic_gemm, and the
  softmax pass (no exp GEMM) with a bias, smoothing under a cap, float32 or float16 inputs,
  or fused_lse."""
  x, w, labels, b, _ = make_problem(jax.random.key(16), (512,), 256, 2000, jnp.bfloat16,
                                    bias=True)

  def uses_exp(impl="pallas_mosaic_gpu", dtype=jnp.bfloat16, **kw):
    f = lambda x, w: memeff_jax.linear_cross_entropy(x, w, labels, implementation=impl,
                                                     chunk_size=256, **kw)
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x.astype(dtype), w.astype(dtype))
    return "lce_exp_logits_gemm" in str(jaxpr)  # the kernel's name

  assert uses_exp()
  assert not uses_exp(bias=b)
  assert uses_exp(logit_softcap=30.0)
  assert uses_exp(label_smoothing=0.1)
  assert not uses_exp(label_smoothing=0.1, logit_softcap=30.0)
  assert not uses_exp(dtype=jnp.float32)
  assert not uses_exp(dtype=jnp.float16)  # E's range is beyond float16's
  assert uses_exp(PallasMosaicGpu(mosaic_gemms=("logits", "dx", "dw")))
  lowest = PallasMosaicGpu(mosaic_gemms=("logits", "dx", "dw"), dw_accumulation="tma_add",
                     fused_lse=True)
  assert not uses_exp(lowest)
  assert uses_exp(dataclasses.replace(lowest, exp_logits=True))


@pytest.mark.gpu
def test_exp_logits_gemm_against_xla():
  """mosaic_gemm.gemm(exp_out=True): exp(min(x W, 64)) and its rows' sums of it per strip
  (over the first 2,000 of 2,048 columns) against XLA in float32, logits up to ~±90 so that
  some are clamped."""
  kx, kw = jax.random.split(jax.random.key(15))
  x = jax.random.normal(kx, (256, 256), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (256, 2048), jnp.float32) * 1.2).astype(jnp.bfloat16)
  config = mosaic_gemm.GemmConfig(schedule="ring", tile_n=128, epilogue_rows=64)
  e, parts = mosaic_gemm.gemm(x, w, config=config, row_stats=2000, exp_out=True)
  z = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  want = jnp.exp(jnp.minimum(z, mosaic_gemm.EXP_CLAMP))
  assert float(jnp.max(jnp.abs(z))) > mosaic_gemm.EXP_CLAMP
  assert rel_err(e.astype(jnp.float32), want) < 1e-2
  assert rel_err(jnp.log(jnp.sum(parts, axis=0)),
                 jnp.log(jnp.sum(want[:, :2000], axis=1))) < 1e-5


def test_fused_lse_needs_the_mosaic_logits_gemm():
  with pytest.raises(ValueError, match="fused_lse.*needs 'logits' in mosaic_gemms"):
    PallasMosaicGpu(mosaic_gemms=("dx", "dw"), fused_lse=True)


@pytest.mark.gpu
def test_mosaic_gemms_refuse_shapes_off_their_tiles():
  x, w, labels, _, _ = make_problem(jax.random.key(12), (200,), 256, 2000, jnp.bfloat16)
  impl = PallasMosaicGpu(mosaic_gemms=("logits",))
  with pytest.raises(NotImplementedError, match=r"logits GEMM.*\[200, 2048, 256\].*M=200"):
    memeff_jax.linear_cross_entropy(x, w, labels, implementation=impl, chunk_size=200)


def test_tuned_ping_pong_tiles_fall_back_where_k_fills_their_slots_unevenly(tuned_as):
  """Where K's steps of 64 are no multiple of twice the 4 slots of the "dv" dW GEMM's tuned
  ping-pong tiles, their `fallback` section runs: the ring's tiles."""
  tuned_as("NVIDIA H200")
  def tiles(k, layout="dv"):
    config = pallas_mosaic_gpu.tuned_gemm_config("dw_tma", layout, k)
    # pylint: disable-next=protected-access
    assert config.schedule == "ring" or pallas_mosaic_gpu._fills_evenly(config, k), k
    return config.schedule, config.tile_n, config.max_concurrent_steps

  assert tiles(1024) == tiles(512) == ("pingpong", 192, 4)
  assert tiles(256)[:2] == tiles(768)[:2] == ("ring", 128)
  assert tiles(1024, "vd")[1] == 128  # "vd" keeps its own dW tiles


def test_exp_gemm_keeps_its_ping_pong_tiles_at_any_k(tuned_as):
  """The exp GEMM's tiles, both layouts' ("vd" has no section of its own), run at any K on
  every GPU, each warpgroup on its own slots whether or not K's steps fill them evenly
  (GPT-2's 768: 12 steps on 4 slots; Gemma-2's 2,304: 36)."""
  def tiles(kind, k, layout):
    tuned_as(kind)
    config = pallas_mosaic_gpu.tuned_gemm_config("logits", layout, k)
    return config.schedule, config.tile_n, config.max_concurrent_steps

  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H800"):
    for layout in ("dv", "vd"):
      for k in (4096, 2304, 1088, 768, 320):
        assert tiles(kind, k, layout) == ("pingpong", 192, 4), (kind, k, layout)


def test_exp_gemm_narrows_where_its_waves_end_sooner(tuned_as):
  """The "dv" exp GEMM's 128 × 192 tiles give way to its `narrow` ones (128 columns, 6
  slots) where those finish the [tokens, V] output in fewer columns of main loop on 132
  SMs, each tile counted 32 columns more (mosaic_gemm.wave_span)."""
  tuned_as("NVIDIA H200")
  def tiles(tokens, vocab, k=4096):
    config = pallas_mosaic_gpu.tuned_gemm_config("logits", "dv", k, (tokens, vocab), 132)
    return config.tile_n, config.max_concurrent_steps

  # Mistral-7B at 512 tokens: 684 tiles in 6 waves of 224 against 1,024 in 8 of 160.
  assert tiles(512, 32768) == (128, 6)
  assert tiles(256, 32768) == (128, 6)
  # 21 waves of 224 against 31 of 160 (Llama-3-8B), or 10.4 against 15.5 waves.
  assert tiles(512, 128256) == tiles(1024, 32768) == tiles(4096, 32768) == (192, 4)
  assert tiles(512, 32768, k=768) == (128, 6)  # at K's steps no multiple of 8 too
  assert pallas_mosaic_gpu.tuned_gemm_config("logits", "dv", 4096).tile_n == 192  # no output
  assert mosaic_gemm.wave_span(mosaic_gemm.GemmConfig(tile_n=96, wg_split="n"), 256, 2000,
                               sms=4, tile_cost=8) == 6 * 200  # 22 tiles of 192, 6 waves


def test_tuned_fallbacks_that_cycle_are_an_error(monkeypatch):
  ping = lambda fallback: dict(schedule="pingpong", tile_n=128, max_concurrent_steps=4,
                               fallback=fallback)
  monkeypatch.setattr(pallas_mosaic_gpu._tuning, "lookup",  # pylint: disable=protected-access
                      lambda *a, **k: {"logits_dv": ping("a"), "a": ping("logits_dv")})
  with pytest.raises(ValueError, match="fallbacks of logits_dv form a cycle"):
    pallas_mosaic_gpu.tuned_gemm_config("logits", "dv", 768)


def test_default_puts_the_gemms_on_mosaic_where_they_fill_the_gpu(monkeypatch):
  """PallasMosaicGpu()'s choice of GEMMs (auto_gemms), decided on any host as on a Hopper GPU:
  all three on kernels.mosaic_gemm, dW added by TMA, at Llama-3-8B's shape in the "dv" layout
  (the dx GEMM's 128 tiles fill 132 SMs to 97%), and at Qwen2.5's and Gemma-2's, whose dx
  tiles are narrowed to fill them; at Gemma-2's and Llama-3-8B's with 512-token chunks (64
  and 116 dx tiles at most) dx alone on cuBLAS; the same choices with a chunk that does not
  divide the tokens; cuBLAS in the "vd" layout, without the exp GEMM, in interpret mode, and
  wherever either option is set."""
  monkeypatch.setattr(hopper, "unavailable", lambda: None)
  bf16 = jnp.bfloat16

  def auto(impl=PallasMosaicGpu(), tokens=1024, d=4096, v=128256, layout="dv", exp=True):
    return impl.auto_gemms((tokens, d, v, bf16, bf16, layout), exp=exp, sms=132)

  cublas = ((), "weight")
  assert auto() == (pallas_mosaic_gpu.GEMMS, "tma_add")
  assert auto(layout="vd") == cublas
  assert auto(exp=False) == cublas
  # 112 and 72 dx tiles in 128 × 256, 128 in 128 × 224 and 128 × 144
  assert auto(d=3584, v=152064) == auto(d=2304, v=256000) == (pallas_mosaic_gpu.GEMMS,
                                                              "tma_add")
  # Gemma-2's 512-token chunks, 64 dx tiles of 128 × 144 at most: dx on cuBLAS, the dW
  # GEMM's 8 K steps on its ping-pong tiles.
  assert auto(tokens=512, d=2304, v=256000) == (("logits", "dw"), "tma_add")
  # Llama-3-8B's at 512 tokens: 116 dx tiles of 128 × 144, 88% of a wave (128 × 128 tiles,
  # which would fill 97% of it, are slower than cuBLAS: mosaic_gemm.narrowed_to_fill_waves).
  assert auto(tokens=512) == (("logits", "dw"), "tma_add")
  # GPT-2's 2,048-token chunks: 48 dx tiles at most, the dW GEMM's 32 K steps in ping-pong.
  assert auto(tokens=2048, d=768, v=50304) == (("logits", "dw"), "tma_add")
  assert auto(PallasMosaicGpu(interpret=True)) == cublas
  assert auto(PallasMosaicGpu(dw_accumulation="weight")) == cublas
  assert auto(PallasMosaicGpu(dw_accumulation="float32")) == ((), "float32")
  assert auto(PallasMosaicGpu(mosaic_gemms=("dw",))) == (("dw",), "tma_add")
  assert auto(PallasMosaicGpu(mosaic_gemms=("logits", "dx"))) == (("logits", "dx"), "weight")
  assert auto(PallasMosaicGpu(mosaic_gemms=pallas_mosaic_gpu.GEMMS, fused_lse=True)) == (
      pallas_mosaic_gpu.GEMMS, "tma_add")
  # Off the tiles (a chunk of 1,000 tokens): cuBLAS, not an error.
  assert auto(tokens=1000) == cublas


def test_long_calls_add_up_dw_in_groups():
  """A call of more chunks than max_rounded_chunks (32) adds up its bf16 dW in groups of 32
  chunks, the groups' sums in float32 (dw_group); not where the options set the
  accumulation, nor with a float32 weight."""
  impl = PallasMosaicGpu()
  assert impl.dw_group(32768, 1024, 2) is None
  assert impl.dw_group(33792, 1024, 2) == impl.dw_group(131072, 1024, 2) == 32
  assert impl.dw_group(32769, 1024, 2) == 32  # 32 chunks and a ragged one
  assert impl.dw_group(131072, 1024, 4) is None
  for options in (dict(dw_accumulation="weight"), dict(dw_accumulation="float32"),
                  dict(mosaic_gemms=("dw",), dw_accumulation="tma_add")):
    assert PallasMosaicGpu(**options).dw_group(131072, 1024, 2) is None
  assert impl.rounded_tokens(128256, 2, None) == 32 * 1024


def test_h100_puts_dw_on_cublas_where_chunks_are_long_and_the_rows_fit(monkeypatch, tuned_as):
  """On an H100 (the tuning table's cublas_dw_tokens) the default puts dW on cuBLAS where the
  chunks hold 2,048 tokens or more and the memory budget also holds x's scaled rows:
  Mistral-7B's head in 8 chunks of 2,048, and GPT-2's, whose dx is cuBLAS's too. Not at
  1,024-token chunks (Llama-3-8B), nor where the logits fill the budget (Llama-2-13B's
  4,096-token chunks; a larger budget makes room), nor on an H200."""
  monkeypatch.setattr(hopper, "unavailable", lambda: None)
  bf16 = jnp.bfloat16

  def auto(tokens, d, v, impl=PallasMosaicGpu()):
    return impl.auto_gemms((tokens, d, v, bf16, bf16, "dv"), exp=True, sms=132)

  mosaic, cublas_dw = (pallas_mosaic_gpu.GEMMS, "tma_add"), (("logits", "dx"), "weight")
  tuned_as("NVIDIA H100 80GB HBM3")
  assert PallasMosaicGpu().plan(16384, 32768, 2, None) == 2048
  assert auto(2048, 4096, 32768) == cublas_dw
  assert auto(1024, 4096, 128256) == mosaic
  assert auto(4096, 5120, 32000) == mosaic
  assert auto(4096, 5120, 32000, PallasMosaicGpu(memory_budget_bytes=2**30)) == cublas_dw
  assert auto(2048, 4096, 32768, PallasMosaicGpu(mosaic_gemms=pallas_mosaic_gpu.GEMMS)) == mosaic
  # GPT-2's head, whose dx has too few tiles for our GEMM: dW joins it on cuBLAS.
  assert auto(2048, 768, 50304) == (("logits",), "weight")
  tuned_as("NVIDIA H200")
  assert auto(2048, 4096, 32768) == mosaic
  assert auto(2048, 768, 50304) == (("logits", "dw"), "tma_add")


def test_gpu_chunks_hold_the_tuned_tokens():
  """pallas_mosaic_gpu's chunk: 256 MiB of bf16 logits, or min_chunk_tokens' worth where
  that holds fewer tokens; an explicit memory budget is kept."""
  impl = PallasMosaicGpu()
  assert impl.plan(16384, 128256, 2, None) == 1024  # Llama-3: 256 MiB holds 1,030
  assert impl.plan(16384, 256000, 2, None) == 1024  # Gemma-2: 0.5 GiB for 1,024
  assert impl.plan(16384, 152064, 2, None) == 1024  # Qwen2.5: 768 at 256 MiB
  # 4,096 tokens' logits alone take 256 MiB, their partial sums 4 MiB more: 8 exact chunks.
  assert impl.plan(16384, 32768, 2, None) == 2048
  assert impl.plan(16384, 32000, 2, None) == 4096  # Llama-2: 256 MiB holds 4,129
  assert impl.plan(16384, 50304, 2, None) == 2048  # GPT-2: 8 exact chunks, not 7 of 2,432
  assert PallasMosaicGpu(memory_budget_bytes=256 * 2**20).plan(16384, 256000, 2, None) == 512
  # Under one chunk, 128 not dividing the tokens: one chunk of whole 128-row tiles.
  assert impl.plan(1000, 256000, 2, None) == 1024
  assert impl.plan(100, 32768, 2, None) == 128
  assert impl.plan(100, 32768, 2, 100) == 100  # a chunk_size is taken as given
  with pytest.raises(NotImplementedError, match="fewer than 16 tokens per chunk in "
                     "memory_budget_bytes=1048576"):
    PallasMosaicGpu(memory_budget_bytes=2**20).plan(16384, 256000, 2, None)
