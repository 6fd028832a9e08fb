"""A jitted AdamW train step over the model's state, donating that state.

The step is a pure function of (state, batch): nnx.split once, then jax.jit with
donate_argnums, so XLA updates parameters and optimizer moments in place and
`jax.jit(...).lower(...).compile().memory_analysis()` reports its peak.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flax import nnx
import jax
import optax


class TrainState(NamedTuple):
  graphdef: Any
  state: Any  # (model, optimizer) state


def make_train_step(model: nnx.Module, learning_rate: float = 3e-3, weight_decay: float = 0.1,
                    mesh=None):
  """(TrainState, step) with step(state, batch) -> (new state, loss); batch is a dict of
  tokens, labels and optionally segment_ids. With a mesh (models.sharding.make_mesh), the
  state is placed by models.sharding's rules and the step keeps it there; batches are
  placed by the caller (sharding.batch_sharding)."""
  optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, weight_decay=weight_decay),
                            wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(**batch))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  if mesh is None:
    return TrainState(graphdef, state), jax.jit(step, donate_argnums=0)
  from memeff_jax.models import sharding  # pylint: disable=import-outside-toplevel
  placed = sharding.state_shardings(state, mesh)
  state = jax.device_put(state, placed)
  return TrainState(graphdef, state), jax.jit(sharding.in_mesh(step, mesh), donate_argnums=0,
                                              out_shardings=(placed, None))


def abstract_train_step(make_model, learning_rate: float = 3e-3, weight_decay: float = 0.1):
  """(state as ShapeDtypeStructs, step) for compiling a train step without allocating it:
  `make_model()` runs under nnx.eval_shape, so a 1B model costs no device memory here."""
  model = nnx.eval_shape(make_model)
  state, step = make_train_step(model, learning_rate, weight_decay)
  spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state.state)
  return spec, step


def policy_steps(make_model, learning_rate: float = 3e-3):
  """(make_step, state spec) for memeff_jax.remat.fit: make_step(policy) is the abstract
  train step of make_model(policy). A remat policy changes the step, not its state, so one
  spec (built with no remat) serves every policy."""
  spec, _ = abstract_train_step(lambda: make_model("none"), learning_rate)

  def make_step(policy):
    return abstract_train_step(lambda: make_model(policy), learning_rate)[1]

  return make_step, spec
