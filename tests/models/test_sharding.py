"""The model on a mesh (eight CPU devices): models.sharding's rules, and training on a
data × fsdp × tensor mesh with the loss curve of one device."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from memeff_jax import cli
from memeff_jax.models import LlamaConfig
from memeff_jax.models import run
from memeff_jax.models import sharding

CFG = LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192,
                  tie_embeddings=True)
TRAIN = dict(learning_rate=3e-3, data="source")


@pytest.fixture(scope="module")
def eight_devices():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


@pytest.fixture(scope="module")
def mesh(eight_devices):
  del eight_devices
  return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


_KW = dict(kernels="memeff", steps=3, batch=4, seq_len=64, show_progress=False)


@functools.lru_cache(maxsize=None)
def _one_device_losses(tie: bool) -> tuple:
  return tuple(run.train(dataclasses.replace(CFG, tie_embeddings=tie), TRAIN, **_KW).losses)


@pytest.mark.parametrize("tie, sizes, context", [
    (True, {"data": 2, "fsdp": 2, "tensor": 2}, {}),
    (False, {"fsdp": 2, "tensor": 2, "context": 2}, {}),
    (True, {"data": 2, "context": 4}, dict(context_order="zigzag", context_strategy="ring"))])
def test_training_on_a_mesh_follows_one_device(eight_devices, tie, sizes, context):
  """Three steps on a mesh (packed documents, segment ids): the same losses as one device.
  With the sequence over a context axis, K and V are gathered in each layer and nothing else
  of the sequence (the loss's tokens are flattened where they lie); or passed round the
  ring, the batch in the zig-zag order."""
  import re  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama, make_train_step  # pylint: disable=import-outside-toplevel
  del eight_devices
  cfg = dataclasses.replace(CFG, tie_embeddings=tie)
  mesh = sharding.make_mesh(sizes)
  many = run.train(cfg, TRAIN, mesh=mesh, **_KW, **context)
  np.testing.assert_allclose(many.losses, _one_device_losses(tie), rtol=2e-5)
  if "context" not in sizes or context:
    return
  state, step = make_train_step(Llama(cfg, rngs=nnx.Rngs(0)), mesh=mesh)
  tokens = jax.ShapeDtypeStruct((4, 64), np.int32, sharding=sharding.batch_sharding(mesh))
  text = step.lower(state.state, {"tokens": tokens, "labels": tokens}).compile().as_text()
  gathered = [tuple(map(int, g.split(","))) for g in re.findall(
      r"f32\[([0-9,]*)\]\S* all-gather(?:-start)?\(", text)]
  activations = [g for g in gathered if len(g) > 2]  # weights (2-D) gather under fsdp
  head_dim = CFG.d_model // CFG.n_heads
  assert activations and all(len(g) == 4 and g[1] == 64 and g[3] == head_dim
                             for g in activations), activations


def test_rules_shard_weights_and_moments(mesh):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama, make_train_step  # pylint: disable=import-outside-toplevel
  state, _ = make_train_step(Llama(dataclasses.replace(CFG, tie_embeddings=False),
                                   rngs=nnx.Rngs(0)), mesh=mesh)
  specs = {jax.tree_util.keystr(path): leaf.sharding.spec
           for path, leaf in jax.tree_util.tree_flatten_with_path(state.state)[0]}
  assert specs["[0]['blocks']['attn']['q_proj']['kernel'].value"] == P(None, "fsdp", "tensor")
  assert specs["[0]['blocks']['attn']['o_proj']['kernel'].value"] == P(None, "tensor", "fsdp")
  assert specs["[0]['embed']['embedding'].value"] == P("tensor", "fsdp")
  assert specs["[0]['lm_head']['kernel'].value"] == P("fsdp", "tensor")
  assert specs["[0]['final_norm']['scale'].value"] == P()
  moment = "[1]['opt_state'][0]['mu']['blocks']['mlp']['down']['kernel'].value"
  assert specs[moment] == P(None, "tensor", "fsdp")
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))


@pytest.mark.parametrize("kernels, sizes", [("plain", {"fsdp": 4}),
                                            ("memeff", {"data": 2, "fsdp": 2, "tensor": 2})])
def test_fsdp_gathers_weights_not_activations(kernels, sizes, capfd):
  """On an fsdp mesh the compiled step all-gathers weights and all-reduces only
  parameter-sized gradients: no collective carries activations of the whole batch (XLA's
  propagation alone partitions the matmuls over their contraction instead, all-reducing
  [B, T, F] in every layer), and XLA never falls back to replicating a value to reshard it
  (its "involuntary full rematerialization", which the embedding's D-sharded rows caused)."""
  import re  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama, make_train_step  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(sizes)
  state, step = make_train_step(Llama(CFG, kernels=kernels, rngs=nnx.Rngs(0)), mesh=mesh)
  batch, seq = 8, 64
  tokens = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=sharding.batch_sharding(mesh))
  text = step.lower(state.state, {"tokens": tokens, "labels": tokens}).compile().as_text()
  ops = re.findall(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter|all-to-all)"
                   r"(?:-start)?\(", text)
  gathered = [shape for shape, op in ops if op == "all-gather"]
  assert any(f"[{CFG.d_model}," in s or f",{CFG.d_model}]" in s for s in gathered), gathered
  activations = [(op, shape) for shape, op in ops  # token ids may travel; floats may not
                 if re.search(rf"(f32|bf16)\[{batch},{seq}\b", shape)]
  assert not activations, activations
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_mesh_arguments_are_checked():
  assert sharding.parse_mesh("data=2,tensor=4") == {"data": 2, "tensor": 4}
  with pytest.raises(ValueError, match="name=size pairs"):
    sharding.parse_mesh("data:2")
  with pytest.raises(ValueError, match="mesh axes must be among"):
    sharding.make_mesh({"pipeline": 2})
  with pytest.raises(ValueError, match="needs 64 devices"):
    sharding.make_mesh({"data": 64})


def test_cli_trains_on_a_mesh(mesh, capsys):
  assert cli.main(["train", "--config", "tiny", "--steps", "2", "--seq-len", "64", "--batch",
                   "4", "--mesh", "data=2,fsdp=2,tensor=2"]) == 0
  out = capsys.readouterr().out
  assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2} over 8 devices" in out and "loss" in out


def test_cli_trains_sequence_parallel(eight_devices, capsys):
  del eight_devices
  assert cli.main(["train", "--config", "tiny", "--steps", "2", "--seq-len", "64", "--batch",
                   "2", "--mesh", "tensor=2", "--sequence-parallel"]) == 0
  assert "loss" in capsys.readouterr().out


def test_context_options_are_checked():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="context_order must be one of"):
    Llama(CFG, context_order="ring", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="context_order and context_strategy are for"):
    Llama(CFG, kernels="plain", context_strategy="ring", rngs=nnx.Rngs(0))
  batch = {"tokens": np.arange(16).reshape(1, 16)}
  assert sharding.context_batch(batch, None, "zigzag") is batch


@pytest.mark.parametrize("kernels, sizes", [("memeff", {"data": 2, "tensor": 2}),
                                            ("plain", {"fsdp": 2, "tensor": 2})])
def test_sequence_parallel_follows_one_device(eight_devices, kernels, sizes):
  """The residual stream sharded on the sequence over tensor: the same losses as one
  device (packed documents, segment ids)."""
  del eight_devices
  kw = dict(_KW, kernels=kernels)
  one = run.train(CFG, TRAIN, **kw).losses if kernels != "memeff" else _one_device_losses(True)
  many = run.train(CFG, TRAIN, mesh=sharding.make_mesh(sizes), sequence_parallel=True, **kw)
  np.testing.assert_allclose(many.losses, one, rtol=2e-5)


def test_sequence_parallel_keeps_a_shard_of_the_residual_stream(eight_devices):
  """On tensor=2 the compiled step gathers each branch's input ([B, T, D] all-gathers),
  gathers no weight (tensor shards every one of them; XLA's propagation alone computed the
  backward's dW on sequence shards and gathered weights), and needs fewer temporary bytes
  than with the residual stream replicated: each rank keeps half of it."""
  import re  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama, make_train_step  # pylint: disable=import-outside-toplevel
  del eight_devices
  mesh = sharding.make_mesh({"tensor": 2})
  tokens = jax.ShapeDtypeStruct((8, 64), np.int32, sharding=sharding.batch_sharding(mesh))
  compiled = {}
  for sp in (False, True):
    state, step = make_train_step(Llama(CFG, sequence_parallel=sp, rngs=nnx.Rngs(0)),
                                  mesh=mesh)
    compiled[sp] = step.lower(state.state, {"tokens": tokens, "labels": tokens}).compile()
  gathered = re.findall(r"= (f32\[[0-9,]*\])\S* all-gather(?:-start)?\(", compiled[True].as_text())
  assert f"f32[8,64,{CFG.d_model}]" in gathered, gathered
  d, kv, f, v = CFG.d_model, CFG.n_kv_heads * CFG.d_model // CFG.n_heads, CFG.d_ff, CFG.vocab_size
  weights = {f"f32[{a},{b}]" for a, b in ((d, d), (d, kv), (kv, d), (d, f), (f, d), (v, d))}
  assert not weights & set(gathered), gathered
  temp = {sp: c.memory_analysis().temp_size_in_bytes for sp, c in compiled.items()}
  assert temp[True] < 0.95 * temp[False], temp


def test_sequence_parallel_and_a_context_axis_exclude_each_other(eight_devices):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from memeff_jax.models import Llama, make_train_step  # pylint: disable=import-outside-toplevel
  del eight_devices
  mesh = sharding.make_mesh({"tensor": 2, "context": 2})
  state, step = make_train_step(Llama(CFG, sequence_parallel=True, rngs=nnx.Rngs(0)),
                                mesh=mesh)
  tokens = jax.ShapeDtypeStruct((4, 64), np.int32, sharding=sharding.batch_sharding(mesh))
  with pytest.raises(ValueError, match="cannot combine with a context axis"):
    step.lower(state.state, {"tokens": tokens, "labels": tokens})
