"""The PyTorch bridge: torch semantics, autograd, torch.compile, residual lifetime, zero-copy."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memeff_jax

torch = pytest.importorskip("torch")
F = torch.nn.functional
mt = pytest.importorskip("memeff_jax.interop.torch")

N, D, V = 37, 24, 203


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
  """Each test on CPU tensors and, on a GPU machine, CUDA tensors (JAX then runs the GPU
  kernels). JAX matmuls in full float32 there, as torch's are by default."""
  if request.param == "cuda" and not torch.cuda.is_available():
    pytest.skip("torch has no CUDA here")
  # Set globally, not with the thread-local context manager: torch runs a CUDA backward on
  # its autograd device thread, where a context entered here would not apply.
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", "highest")
  try:
    yield torch.device(request.param)
  finally:
    jax.config.update("jax_default_matmul_precision", before)


def _close(a, b, tol=2e-5):
  a, b = a.detach().double(), b.detach().double()
  assert (a - b).norm() <= tol * max(b.norm(), 1e-12), float((a - b).norm() / b.norm())


def _lce_inputs(dtype=torch.float32, bias=False, device="cpu"):
  g = torch.Generator().manual_seed(0)
  x = torch.randn(3, N, D, generator=g).to(device, dtype).requires_grad_()
  w = (torch.randn(V, D, generator=g) * 0.2).to(device, dtype).requires_grad_()
  b = (torch.randn(V, generator=g) * 0.1).to(device, dtype).requires_grad_() if bias else None
  y = torch.randint(0, V, (3, N), generator=g)
  y[0, :5] = -100
  return x, w, b, y.to(device)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing, bias", [(0.0, False), (0.1, True)])
def test_lce_equals_torch(reduction, smoothing, bias, device):
  x, w, b, y = _lce_inputs(bias=bias, device=device)
  ct = torch.cos(torch.arange(3 * N, dtype=torch.float32)).reshape(3, N).to(device)

  def run(fn):
    for t in (x, w, b):
      if t is not None:
        t.grad = None
    loss = fn()
    (loss * ct).sum().backward() if reduction == "none" else loss.backward()
    return loss, [t.grad.clone() for t in (x, w, b) if t is not None]

  ours = run(lambda: mt.linear_cross_entropy(x, w, y, bias=b, reduction=reduction,
                                             label_smoothing=smoothing))
  ref = run(lambda: F.cross_entropy(F.linear(x, w, b).reshape(-1, V), y.reshape(-1),
                                    reduction=reduction, label_smoothing=smoothing
                                    ).reshape(y.shape if reduction == "none" else ()))
  _close(ours[0], ref[0])
  for a, r in zip(ours[1], ref[1]):
    assert a.device == r.device
    _close(a, r)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weights_grad", [False, True])
def test_lce_token_weights_equal_torch(reduction, weights_grad, device):
  """token_weights ω against torch's per-token losses weighted by hand ("mean" over the
  tokens not ignored): the loss, x, W and bias gradients, and ω.grad when ω requires it."""
  x, w, b, y = _lce_inputs(bias=True, device=device)
  g = torch.Generator().manual_seed(2)
  omega = torch.randn(y.shape, generator=g).to(device).requires_grad_(weights_grad)
  ct = torch.cos(torch.arange(3 * N, dtype=torch.float32)).reshape(3, N).to(device)
  inputs = (x, w, b, omega) if weights_grad else (x, w, b)

  def run(fn):
    loss = fn()
    grads = torch.autograd.grad((loss * ct).sum() if reduction == "none" else loss * -1.5,
                                inputs)
    return loss, grads

  def ref():
    per_token = F.cross_entropy(F.linear(x, w, b).reshape(-1, V), y.reshape(-1),
                                reduction="none", label_smoothing=0.1).reshape(y.shape)
    weighted = per_token * omega
    if reduction == "none":
      return weighted
    return weighted.sum() / ((y != -100).sum() if reduction == "mean" else 1)

  ours = run(lambda: mt.linear_cross_entropy(x, w, y, bias=b, token_weights=omega,
                                             reduction=reduction, label_smoothing=0.1))
  want = run(ref)
  _close(ours[0], want[0])
  for a, r in zip(ours[1], want[1]):
    assert a.dtype == r.dtype and a.device == r.device
    _close(a, r)


@pytest.mark.parametrize("reduction, uses", [("mean", "loss"), ("mean", "both"),
                                             ("sum", "entropy"), ("none", "both"),
                                             ("none", "loss")])
def test_lce_entropy_equals_torch(reduction, uses, device):
  """return_entropy: each token's entropy of the logits, torch's; the gradients of x, W, the
  bias and the token weights from the loss, the entropy, or both (mean's unit gradients,
  or the recompute with each token's cotangent), against torch autograd."""
  x, w, b, y = _lce_inputs(bias=True, device=device)
  omega = torch.rand(y.shape, device=device, requires_grad=True)
  ct = torch.cos(torch.arange(3 * N, dtype=torch.float32)).reshape(3, N).to(device)
  inputs = (x, w, b, omega)

  def objective(loss, entropy):
    loss = (loss * ct).sum() if reduction == "none" else loss * 2.0
    return {"loss": loss, "entropy": (entropy * ct).sum(), "both": loss + (entropy * ct).sum()
            }[uses]

  def ref():
    logits = F.linear(x, w, b)
    per_token = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none",
                                label_smoothing=0.1).reshape(y.shape) * omega
    loss = {"none": per_token, "sum": per_token.sum(),
            "mean": per_token.sum() / (y != -100).sum()}[reduction]
    entropy = -(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1)
    return loss, entropy

  got = mt.linear_cross_entropy(x, w, y, bias=b, token_weights=omega, reduction=reduction,
                                label_smoothing=0.1, return_entropy=True)
  want = ref()
  assert got[1].shape == y.shape and got[1].dtype == torch.float32
  for a, r in zip(got, want):
    _close(a, r)
  got_g = torch.autograd.grad(objective(*got), inputs, allow_unused=True)
  want_g = torch.autograd.grad(objective(*want), inputs, allow_unused=True)
  for a, r in zip(got_g, want_g):
    if r is None:  # (ω, for the entropy alone)
      continue
    assert a is not None
    _close(a, r)


def _compiled_matches_eager(objective, args, wrt):
  """torch.compile(fullgraph=True) of objective(*args) against eager: the value and the
  gradients of the tensors `wrt`."""
  eager = objective(*args)
  eager_grads = torch.autograd.grad(eager, wrt)
  got = torch.compile(objective, fullgraph=True, backend="aot_eager")(*args)
  _close(got, eager, 1e-6)
  for a, r in zip(torch.autograd.grad(got, wrt), eager_grads):
    _close(a, r, 1e-6)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_lce_token_weights_through_the_module_and_torch_compile(return_entropy, device):
  """The module's forward takes token_weights (and gives the entropy where asked);
  torch.compile(fullgraph=True) traces the op with them, ω.grad included, and matches
  eager."""
  x, w, _, y = _lce_inputs(device=device)
  omega = torch.rand(y.shape, device=device, requires_grad=True)
  loss_fn = mt.LinearCrossEntropyLoss(w, reduction="sum", return_entropy=return_entropy)

  def objective(*args):
    out = loss_fn(*args)
    return out[0] * 0.5 - 0.1 * out[1].sum() if return_entropy else out * 0.5

  _compiled_matches_eager(objective, (x, y, omega), (x, w, omega))


def _ppo(xp):
  """PPO's clipped surrogate (ε = 0.2) with a 0.01 entropy bonus where it takes the
  entropy, in jax.numpy or torch (xp)."""

  def surrogate(log_p, old_log_p, advantage):
    ratio = xp.exp(log_p - old_log_p)
    return -xp.minimum(ratio * advantage, xp.clip(ratio, 0.8, 1.2) * advantage)

  def with_bonus(log_p, entropy, old_log_p, advantage):
    return surrogate(log_p, old_log_p, advantage) - 0.01 * entropy

  return surrogate, with_bonus


_PPO_JAX, _PPO_TORCH = _ppo(jnp), _ppo(torch)


@pytest.mark.parametrize("reduction, bonus, returned", [
    ("mean", False, False), ("sum", True, False), ("none", False, False),
    ("none", True, True), ("mean", True, True), ("sum", False, True)])
def test_lce_token_loss_equals_torch(reduction, bonus, returned, device):
  """token_loss: PPO's clipped objective (with an entropy bonus where `bonus`, as
  f(log p, H, ...)) against torch autograd of the same objective on the logits: the loss,
  the returned entropy (differentiated too where `returned`), and the gradients of x, W,
  the bias, the token weights and the advantages (the old log-probabilities need none)."""
  x, w, b, y = _lce_inputs(bias=True, device=device)
  g = torch.Generator().manual_seed(3)
  omega = torch.rand(y.shape, generator=g).to(device).requires_grad_()
  advantage = torch.randn(y.shape, generator=g).to(device).requires_grad_()
  ct = torch.cos(torch.arange(3 * N, dtype=torch.float32)).reshape(3, N).to(device)
  with torch.no_grad():  # old log-probabilities near the new ones: ratios on both sides of
    logits = F.linear(x, w, b)  # the clip
    picked = F.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    old = picked + 0.3 * torch.randn(y.shape, generator=g).to(device)
  inputs = (x, w, b, omega, advantage)

  def ref():
    logits = F.linear(x, w, b)
    log_p = F.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    entropy = -(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1)
    per_token = (_PPO_TORCH[1](log_p, entropy, old, advantage) if bonus
                 else _PPO_TORCH[0](log_p, old, advantage))
    per_token = torch.where(y == -100, 0.0, per_token) * omega
    loss = {"none": per_token, "sum": per_token.sum(),
            "mean": per_token.sum() / (y != -100).sum()}[reduction]
    return (loss, entropy) if returned else loss

  def objective(out):
    loss, entropy = out if returned else (out, None)
    loss = (loss * ct).sum() if reduction == "none" else loss * -1.5
    return loss if entropy is None else loss + (entropy * ct).sum()

  got = mt.linear_cross_entropy(x, w, y, bias=b, token_weights=omega, reduction=reduction,
                                token_loss=_PPO_JAX[bonus], token_loss_args=(old, advantage),
                                entropy=bonus, return_entropy=returned)
  want = ref()
  for a, r in zip(*((got, want) if returned else ((got,), (want,)))):
    _close(a, r)
  for a, r in zip(torch.autograd.grad(objective(got), inputs),
                  torch.autograd.grad(objective(want), inputs)):
    assert a.dtype == r.dtype and a.device == r.device
    _close(a, r)


def test_lce_token_loss_through_the_module_and_torch_compile(device):
  """The module takes a token_loss and its arguments; torch.compile(fullgraph=True) traces
  the op with them, the arguments' gradients included, and matches eager."""
  x, w, _, y = _lce_inputs(device=device)
  old = torch.full(y.shape, -5.0, device=device)
  advantage = torch.randn(y.shape, device=device, requires_grad=True)
  loss_fn = mt.LinearCrossEntropyLoss(w, reduction="sum", token_loss=_PPO_JAX[1], entropy=True)

  def objective(x, y, advantage):
    return loss_fn(x, y, token_loss_args=(old, advantage)) * 0.5

  _compiled_matches_eager(objective, (x, y, advantage), (x, w, advantage))


def test_lce_new_token_loss_functions_warn(monkeypatch):
  """Each token_loss function object compiles anew: the bridge warns when a training loop
  makes one per step, and not for the same function called again."""
  monkeypatch.setattr(mt, "_TOKEN_LOSSES", set())
  monkeypatch.setattr(mt, "_MANY_TOKEN_LOSSES", 3)
  x, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.int64)
  same = lambda log_p: -log_p  # noqa: E731
  for _ in range(3):
    mt.linear_cross_entropy(x, w, y, token_loss=same)
  mt.linear_cross_entropy(x, w, y, token_loss=lambda log_p: -2.0 * log_p)
  with pytest.warns(UserWarning, match="3 distinct token_loss functions so far"):
    mt.linear_cross_entropy(x, w, y, token_loss=lambda log_p: -3.0 * log_p)


@pytest.mark.parametrize("scale", [1.0, -2.5])
def test_lce_scaled_loss_gradients(scale, device):
  """The unit gradients computed in the forward are scaled by the loss's cotangent."""
  x, w, _, y = _lce_inputs(device=device)
  (mt.linear_cross_entropy(x, w, y) * scale).backward()
  got = (x.grad.clone(), w.grad.clone())
  x.grad = w.grad = None
  (F.cross_entropy(F.linear(x, w).reshape(-1, V), y.reshape(-1)) * scale).backward()
  _close(got[0], x.grad)
  _close(got[1], w.grad)


@pytest.mark.parametrize("g", [1.0, -2.5, float("nan")])
def test_scale_unless_one_equals_mul(g, device):
  """The backward's in-place scaling (a Triton kernel on CUDA that skips g = 1 without a host
  sync) equals t.mul_(g) bit for bit, over sizes that leave partial blocks and programs
  that loop, in float32 and bfloat16."""
  gt = torch.tensor(g, device=device)
  for dtype in (torch.float32, torch.bfloat16):
    tensors = [torch.randn(n, device=device).to(dtype) for n in (1, 4097, 3 * 4096 * 700 + 5)]
    want = [t.clone().mul_(gt) for t in tensors]
    mt._scale_unless_one(tensors, gt)  # pylint: disable=protected-access
    for t, w in zip(tensors, want):
      torch.testing.assert_close(t, w, rtol=0, atol=0, equal_nan=True)


def test_lce_second_backward_is_refused(device):
  x, w, _, y = _lce_inputs(device=device)
  loss = mt.linear_cross_entropy(x, w, y)
  loss.backward(retain_graph=True)
  with pytest.raises(RuntimeError, match="second backward"):
    loss.backward()


def test_one_call_imports_zero_copy_with_none_kept(device):
  """_to_jax_call: the inputs of one call are views of the tensors, in order, None kept."""
  a, b = torch.randn(8, 4, device=device), torch.randn(6, device=device)
  got = mt._to_jax_call(a, None, b.to(torch.bfloat16), torch.randn(4, 8, device=device).t())  # pylint: disable=protected-access
  assert got[0].unsafe_buffer_pointer() == a.data_ptr() and got[1] is None
  np.testing.assert_array_equal(np.asarray(got[0]), a.cpu().numpy())
  assert got[2].dtype == jnp.bfloat16 and got[3].shape == (8, 4)


def test_lce_chunk_size_is_used(device):
  x, w, _, y = _lce_inputs(device=device)
  want = mt.linear_cross_entropy(x, w, y)
  got = mt.linear_cross_entropy(x, w, y, chunk_size=16)
  _close(got, want, 1e-6)
  with pytest.raises(ValueError, match="chunk_size"):
    mt.linear_cross_entropy(x, w, y, chunk_size=0)


def test_lce_implementation_is_used(device):
  """A name, an object and a sequence reach memeff_jax.linear_cross_entropy, forward and
  (reduction "none") the recomputing backward; unknown names are refused up front."""
  from memeff_jax.ops import linear_cross_entropy as lce  # pylint: disable=import-outside-toplevel
  calls = []

  class Counting:  # an implementation object: the reference, counted
    name = "counting"

    def __call__(self, *args, **kwargs):
      calls.append(kwargs["opts"].reduction)
      return lce.IMPLEMENTATIONS["reference"](*args, **kwargs)

  x, w, _, y = _lce_inputs(device=device)
  want = mt.linear_cross_entropy(x, w, y, implementation="chunked_xla")
  impl = Counting()
  for choice in ("reference", impl, (impl, "chunked_xla")):
    _close(mt.linear_cross_entropy(x, w, y, implementation=choice), want, 1e-6)
  assert calls == ["mean", "mean"]
  loss_fn = mt.LinearCrossEntropyLoss(w, reduction="none", implementation=impl)
  loss_fn(x, y).sum().backward()
  assert calls[2:] and set(calls[2:]) == {"none"}  # forward, then the backward's recompute
  with pytest.raises(ValueError, match="implementation='bogus'"):
    mt.linear_cross_entropy(x, w, y, implementation="bogus")


def test_lce_bf16_and_module(device):
  x, w, _, y = _lce_inputs(torch.bfloat16, device=device)
  head = torch.nn.Linear(D, V, bias=False, dtype=torch.bfloat16, device=device)
  with torch.no_grad():
    head.weight.copy_(w)
  loss_fn = mt.LinearCrossEntropyLoss(head.weight)
  assert not list(loss_fn.parameters())  # holds the weight by reference only
  loss = loss_fn(x, y)
  loss.backward()
  assert head.weight.grad is not None and head.weight.grad.dtype == torch.bfloat16
  ref = F.cross_entropy(F.linear(x.float(), w.float()).reshape(-1, V), y.reshape(-1))
  _close(loss, ref, 2e-2)


def test_lce_float_labels_raise():
  x, w, _, y = _lce_inputs()
  with pytest.raises(TypeError, match="labels must be integer class ids"):
    mt.linear_cross_entropy(x, w, y.float())


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_equals_sdpa_with_gqa(layout, causal, device):
  g = torch.Generator().manual_seed(1)
  b, hq, hkv, t, d = 2, 4, 2, 29, 32
  q, k, v = (torch.randn(b, h, t, d, generator=g).to(device).requires_grad_()
             for h in (hq, hkv, hkv))
  ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
  ref_grads = torch.autograd.grad((ref * ref).sum(), (q, k, v))
  args = (q, k, v) if layout == "bhtd" else tuple(a.transpose(1, 2) for a in (q, k, v))
  out = mt.flash_attention(*args, causal=causal, layout=layout)
  out_bhtd = out if layout == "bhtd" else out.transpose(1, 2)
  tol = 2e-5 if device.type == "cpu" else 2e-3  # the GPU kernels' exp2/bf16-free paths
  _close(out_bhtd, ref, tol)
  for a, r in zip(torch.autograd.grad((out_bhtd * out_bhtd).sum(), (q, k, v)), ref_grads):
    _close(a, r, 2.5 * tol)


class _TinyLM(torch.nn.Module):

  def __init__(self):
    super().__init__()
    g = torch.Generator().manual_seed(2)
    self.qkv = torch.nn.Linear(32, 96)
    self.head = torch.nn.Linear(32, 100, bias=False)
    with torch.no_grad():
      for p in self.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)

  def forward(self, x, labels):
    b, t, _ = x.shape
    q, k, v = self.qkv(x).reshape(b, t, 3, 1, 32).unbind(2)
    h = x + mt.flash_attention(q, k, v, causal=True)[:, :, 0]
    return mt.linear_cross_entropy(h, self.head.weight, labels)


def test_torch_compile_fullgraph_matches_eager(device):
  model = _TinyLM().to(device)
  x = torch.randn(2, 16, 32, device=device)
  labels = torch.randint(0, 100, (2, 16), device=device)
  eager = model(x, labels)
  eager_grads = torch.autograd.grad(eager, list(model.parameters()))
  compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # no graph breaks
  got = compiled(x, labels)
  got_grads = torch.autograd.grad(got, list(model.parameters()))
  _close(got, eager, 1e-6)
  for a, r in zip(got_grads, eager_grads):
    _close(a, r, 1e-5)


def test_wrap_equals_torch(device):
  """wrap(f) of a JAX function of three arrays returning a pytree: torch's values and
  gradients, with one output left out of the loss (cotangent None) and one input that does
  not require grad."""
  g = torch.Generator().manual_seed(1)
  a = torch.randn(5, 7, generator=g).to(device).requires_grad_()
  b = torch.randn(7, 3, generator=g).to(device).requires_grad_()
  c = torch.randn(5, 3, generator=g).to(device)
  weights = torch.cos(torch.arange(15.0)).reshape(5, 3).to(device)
  f = mt.wrap(lambda a, b, c: {"y": jnp.tanh(a @ b) * c, "s": (jnp.sum(a**2), a.T)})
  out = f(a, b, c)
  want = torch.tanh(a @ b) * c
  _close(out["y"], want)
  _close(out["s"][0], (a**2).sum())
  _close(out["s"][1], a.t())
  got = torch.autograd.grad((out["y"] * weights).sum() + 3 * out["s"][0], (a, b))
  ref = torch.autograd.grad((want * weights).sum() + 3 * (a**2).sum(), (a, b))
  for x, r in zip(got, ref):
    _close(x, r)


def test_wrap_without_jit_takes_value_dependent_python_control_flow():
  """jit=False runs jax.vjp eagerly, so f may branch on array values; jitted (the default)
  such an f fails in JAX's tracing with its own error."""
  f = lambda a: jnp.sum(a * 2 if jnp.sum(a) > 0 else -a)  # noqa: E731
  for sign in (1.0, -1.0):
    a = (sign * torch.rand(6) + sign).requires_grad_()
    mt.wrap(f, jit=False)(a).backward()
    _close(a.grad, torch.full((6,), 2.0 if sign > 0 else -1.0))
  with pytest.raises(jax.errors.TracerBoolConversionError):
    mt.wrap(f)(a)


@pytest.mark.parametrize("op", ["lce", "attention", "wrap"])
def test_residuals_are_saved_tensors_and_freed_after_backward(op, device):
  """Residuals pass through saved_tensors_hooks (so offloading works) and die after backward."""
  seen = []
  x, w, _, y = _lce_inputs(device=device)
  q = torch.randn(1, 20, 2, 32, device=device, requires_grad=True)
  inputs = (x, w, y, q)

  def pack(t):
    if not any(t is i for i in inputs):  # the caller keeps its inputs alive, as it should
      seen.append(weakref.ref(t))
    return t

  with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    if op == "lce":
      loss = mt.linear_cross_entropy(x, w, y)
    elif op == "attention":
      loss = mt.flash_attention(q, q, q, causal=True).square().sum()
    else:
      loss = mt.wrap(lambda a: jnp.sum(jnp.tanh(a) ** 2))(q)
  assert seen, "no residual went through save_for_backward"
  assert any(r() is not None for r in seen)
  loss.backward()
  del loss
  gc.collect()
  assert all(r() is None for r in seen), "a residual outlived backward"


def test_zero_copy_by_data_pointers(device):
  for dtype in (torch.float32, torch.bfloat16):
    t = torch.randn(64, 32).to(device, dtype)
    a = mt.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert next(iter(a.devices())).platform == ("gpu" if device.type == "cuda" else "cpu")
    back = mt.to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype and back.device == t.device
  j = jax.device_put(jnp.arange(1024, dtype=jnp.float32),
                     jax.devices("gpu" if device.type == "cuda" else "cpu")[0])
  assert mt.to_torch(j).data_ptr() == j.unsafe_buffer_pointer()
  # A non-contiguous tensor is copied once (documented), and still right.
  t = torch.randn(32, 64, device=device).t()
  np.testing.assert_array_equal(np.asarray(mt.to_jax(t)), t.cpu().numpy())


def test_imports_skip_from_dlpacks_python_and_equal_it(device):
  """With the jaxlibs this package runs on, imports call jaxlib's DLPack import directly (no
  silent fallback); the arrays equal jax.dlpack.from_dlpack's in value, dtype, device and
  commitment."""
  assert mt._fast_import is not None  # pylint: disable=protected-access
  for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8,
                torch.bool):
    t = (torch.randn(5, 7) * 50).to(device, dtype)
    got, want = mt.to_jax(t), jax.dlpack.from_dlpack(t)
    assert (got.dtype, got.shape, got.devices(), got.committed) == (
        want.dtype, want.shape, want.devices(), want.committed)
    assert got.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_import_falls_back_to_from_dlpack_for_good(device, monkeypatch):
  """A jaxlib whose direct import takes other arguments (TypeError) leaves the bridge on
  jax.dlpack.from_dlpack, still zero-copy and ordered, and it does not try again."""
  calls = []

  def moved_on(*args):
    calls.append(args)
    raise TypeError("dlpack_managed_tensor_to_buffer(): incompatible function arguments")

  monkeypatch.setattr(mt, "_fast_import", moved_on)
  a, b = torch.randn(6, 5, device=device), torch.randn(3, device=device)
  got = mt._to_jax_call(a, b)  # pylint: disable=protected-access
  assert len(calls) == 1 and mt._fast_import is None  # pylint: disable=protected-access
  assert [g.unsafe_buffer_pointer() for g in got] == [a.data_ptr(), b.data_ptr()]
  np.testing.assert_array_equal(np.asarray(got[1]), b.cpu().numpy())


def test_int64_labels_reach_jax_without_a_copy(device):
  """The loss reads torch's int64 labels in place, as int32 words (Int64Labels), and keeps
  64-bit meaning: -100 + 2³² is not ignore_index, an id past int32 is out of range (NaN)."""
  y = torch.randint(0, V, (3, N), device=device)
  x, w, _, _ = _lce_inputs(device=device)
  *_, words = mt._lce_arrays(x, w, None, y)  # pylint: disable=protected-access
  assert words.words.unsafe_buffer_pointer() == y.data_ptr()
  assert words.shape == tuple(y.shape)
  y[0, :3] = torch.tensor([-100 + 2**32, 2**40 + 1, -100], device=device)
  loss = mt.linear_cross_entropy(x, w, y, reduction="none").detach()
  assert torch.isnan(loss[0, :2]).all() and loss[0, 2] == 0
  y32 = y.to(torch.int32)  # the ids that fit agree with the same ids as int32
  _close(loss[:, 3:], mt.linear_cross_entropy(x, w, y32, reduction="none")[:, 3:])


def test_no_silent_64_bit_narrowing():
  if jax.config.jax_enable_x64:
    pytest.skip("x64 enabled: 64-bit tensors convert as they are")
  with pytest.raises(TypeError, match="int64 tensor.*convert explicitly"):
    mt.to_jax(torch.arange(4))
  with pytest.raises(TypeError, match="uint64 tensor.*convert explicitly"):
    mt.to_jax(torch.arange(4).to(torch.uint64))


def _fresh_python(code):
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
  return subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                        capture_output=True, text=True, check=True)


def test_import_sets_on_demand_allocation_before_jax_starts():
  run = _fresh_python("import os, memeff_jax.interop.torch, jax; jax.devices(); "
                      "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])")
  assert run.stdout.strip() == "false"


def test_import_after_jax_started_warns():
  run = _fresh_python("import jax; jax.devices(); import memeff_jax.interop.torch")
  assert "set XLA_PYTHON_CLIENT_PREALLOCATE=false before importing JAX" in run.stderr


def _cuda_or_skip():
  if not torch.cuda.is_available():
    pytest.skip("needs a GPU (torch with CUDA)")


def _slow_work(n=24):
  """~50 ms of float32 matmuls queued on torch's current stream (so that a write after it
  is still pending when the host moves on)."""
  a = torch.randn(4096, 4096, device="cuda") / 64
  out = torch.empty_like(a)
  for _ in range(n):
    torch.mm(a, a, out=out)


@pytest.mark.gpu
def test_torch_writes_on_a_side_stream_are_seen_by_jax():
  """to_jax, and the one-handshake imports of a call (later tensors exported without their
  own stream wait), see what torch wrote on its current (side) stream just before, behind
  slow work: JAX's stream waits for torch's."""
  _cuda_or_skip()
  side = torch.cuda.Stream()
  with torch.cuda.stream(side):
    a, b, c = (torch.zeros(1 << 20, device="cuda") for _ in range(3))
    torch.cuda.synchronize()
    _slow_work()
    a.fill_(1.0)
    b.fill_(2.0)
    c.fill_(4.0)
    single = mt.to_jax(a)
    call = mt._to_jax_call(b, None, c)  # pylint: disable=protected-access
    total = jax.jit(lambda x, y, z: (jnp.sum(x), jnp.sum(y), jnp.sum(z)))(single, call[0],
                                                                           call[2])
  assert [float(t) for t in total] == [1 << 20, 2 << 20, 4 << 20]


@pytest.mark.gpu
def test_jax_results_are_seen_by_torch_on_a_side_stream():
  """to_torch makes torch's current (side) stream wait for the JAX computation that produced
  the array, however long it runs."""
  _cuda_or_skip()
  x = jax.device_put(jnp.full((4096, 4096), 1 / 4096, jnp.float32), jax.devices("gpu")[0])

  @jax.jit
  def slow_then_42(x):
    y = x
    for _ in range(24):
      y = y @ x  # stays x (x @ x == x): finite, so y * 0 is 0
    return y * 0 + 42.0

  side = torch.cuda.Stream()
  with torch.cuda.stream(side):
    got = mt.to_torch(slow_then_42(x))
    ok = bool(torch.all(got == 42.0))  # ordered on `side` after JAX's work
  assert ok


@pytest.mark.gpu
def test_ops_on_a_side_stream_read_fresh_inputs_and_return_ordered_outputs():
  """The bridged loss and attention on a side stream, their inputs written there behind slow
  work, equal the same calls on inputs made ready beforehand."""
  _cuda_or_skip()
  x0, w, _, y = _lce_inputs(device=torch.device("cuda"))
  q0 = torch.randn(2, 64, 4, 32, device="cuda")
  want_loss = mt.linear_cross_entropy(x0, w, y).detach()
  want_out = mt.flash_attention(q0, q0, q0, causal=True)
  side = torch.cuda.Stream()
  with torch.cuda.stream(side):
    x, q = torch.zeros_like(x0), torch.zeros_like(q0)
    torch.cuda.synchronize()
    _slow_work()
    x.copy_(x0.detach())
    q.copy_(q0)
    loss = mt.linear_cross_entropy(x, w, y).detach().clone()
    out = mt.flash_attention(q, q, q, causal=True).clone()
  side.synchronize()
  assert torch.equal(loss, want_loss) and torch.equal(out, want_out)


def test_lce_bool_labels_raise():
  with pytest.raises(TypeError, match=r"labels must be integer class ids.*torch.bool"):
    mt.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8),
                            torch.tensor([True, False, True, True]))


@pytest.mark.parametrize("window, jax_window", [((-1, 0), (None, 0)), ((3, -1), (3, None)),
                                                ((2, 5), (2, 5)), (4, (4, 4))])
def test_attention_window_takes_flash_attentions_minus_one(window, jax_window):
  """-1 is an unbounded side, as FlashAttention's window_size: (-1, 0) sees every earlier key
  and no later one. Never silently no window at all."""
  q = torch.randn(1, 40, 2, 16)
  got = mt.flash_attention(q, q, q, sliding_window=window)
  a = jnp.asarray(q.numpy())
  want = memeff_jax.flash_attention(a, a, a, sliding_window=jax_window, implementation="reference")
  np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.allclose(got.numpy(), mt.flash_attention(q, q, q).numpy(), atol=1e-3)


@pytest.mark.parametrize("window", [(-2, 0), True, (1.5, 2), (1, 2, 3)])
def test_attention_bad_window_raises(window):
  q = torch.randn(1, 8, 2, 16)
  with pytest.raises(ValueError, match=r"sliding_window must be an int or a \(left, right\)"):
    mt.flash_attention(q, q, q, sliding_window=window)


@pytest.mark.parametrize("weight, labels, match", [
    ((8, 10), (4,), r"weight.shape=\(8, 10\) must be \[V, D=8\].*It looks transposed"),
    ((10, 7), (4,), r"weight.shape=\(10, 7\) must be \[V, D=8\] \(torch.nn.Linear's weight\)"),
    ((10, 8), (3,), r"labels.shape=\(3,\) must be x.shape\[:-1\]=\(4,\)")])
def test_lce_errors_speak_torch(weight, labels, match):
  with pytest.raises(ValueError, match=match):
    mt.linear_cross_entropy(torch.randn(4, 8), torch.randn(*weight),
                            torch.zeros(labels, dtype=torch.int64))


@pytest.mark.parametrize("weights, error, match", [
    (torch.ones(4, dtype=torch.int32), TypeError,
     r"token_weights must be floating point, got token_weights.dtype=torch.int32"),
    (torch.ones(2, 2), ValueError, r"token_weights.shape=\(2, 2\) must equal labels.shape=\(4,\)")])
def test_lce_bad_token_weights_raise(weights, error, match):
  with pytest.raises(error, match=match):
    mt.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8),
                            torch.zeros(4, dtype=torch.int64), token_weights=weights)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(token_loss_args=(torch.ones(4),)), ValueError,
     r"token_loss_args \(1 tensors\) given without a token_loss"),
    (dict(entropy=True), ValueError, r"entropy=True hands each token's entropy to a "
     r"token_loss; to get it back, pass return_entropy=True"),
    (dict(token_loss="ppo"), TypeError, r"token_loss must be a callable"),
    (dict(token_loss=lambda lp, a: lp * a, token_loss_args=torch.ones(4)), TypeError,
     r"token_loss_args must be a tuple of tensors, got Tensor"),
    (dict(token_loss=lambda lp, a: lp * a, token_loss_args=(torch.ones(4, dtype=torch.int32),)),
     TypeError, r"token_loss_args\[0\] must be floating point, got .*torch.int32"),
    (dict(token_loss=lambda lp, a: lp * a, token_loss_args=(torch.ones(2, 2),)), ValueError,
     r"token_loss_args\[0\].shape=\(2, 2\) must equal labels.shape=\(4,\)"),
    (dict(token_loss=lambda lp, a: lp * a, token_loss_args=(0.5,)), TypeError,
     r"token_loss_args\[0\] must be a torch.Tensor shaped like labels, got float"),
    (dict(token_loss=lambda lp, a: lp * a, token_loss_args=(torch.ones(4, device="meta"),)),
     ValueError, r"token_loss_args\[0\] is on meta, x on cpu"),
    (dict(token_loss=lambda lp: -lp, entropy=1), TypeError, r"entropy must be a bool"),
    (dict(token_loss=lambda lp, a: lp * a), TypeError,
     r"token_loss must take the log-probability and 0 more"),
    (dict(token_loss=lambda lp: -lp, label_smoothing=0.1), ValueError,
     r"token_loss replaces the cross-entropy, so it takes no label_smoothing")])
def test_lce_bad_token_loss_raises(kwargs, error, match):
  with pytest.raises(error, match=match):
    mt.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8),
                            torch.zeros(4, dtype=torch.int64), **kwargs)


def test_lce_inputs_on_another_device_raise():
  x, w = torch.randn(4, 8), torch.randn(10, 8)
  with pytest.raises(ValueError, match=r"labels is on meta, x on cpu: pass them on one device"):
    mt.linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.int64, device="meta"))
  with pytest.raises(ValueError, match=r"token_weights is on meta, x on cpu"):
    mt.linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.int64),
                            token_weights=torch.ones(4, device="meta"))


def test_attention_errors_show_the_callers_shapes():
  q, k = torch.randn(1, 2, 16, 8), torch.randn(1, 3, 16, 8)
  with pytest.raises(ValueError, match=r"layout='bhtd', q must be \[B, Hq, T, D\].*"
                     r"q.shape=\(1, 2, 16, 8\), k.shape=\(1, 3, 16, 8\)"):
    mt.flash_attention(q, k, k, layout="bhtd")


def test_wide_float_tensor_error_suggests_float32():
  with pytest.raises(TypeError, match=r"t.to\(torch.float32\)"):
    mt.to_jax(torch.randn(3, dtype=torch.float64))
