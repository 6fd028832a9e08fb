"""Can tests/interop's side-stream tests fail? The same write-behind-slow-work pattern, imported
without any stream handshake (DLPack stream -1 for every tensor): JAX should then read the
zeros from before the write (session 20)."""
import sys

import torch

sys.path.insert(0, ".")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import memeff_jax.interop.torch as mt  # noqa: E402
from tests.interop.test_torch import _slow_work  # noqa: E402

side = torch.cuda.Stream()
for trial in range(3):
  with torch.cuda.stream(side):
    a = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    _slow_work()
    a.fill_(1.0)
    unsynced = jax.dlpack.from_dlpack(mt._Ordered(a))  # pylint: disable=protected-access
    got_unsynced = float(jnp.sum(unsynced))
  side.synchronize()
  with torch.cuda.stream(side):
    b = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    _slow_work()
    b.fill_(1.0)
    got_synced = float(jnp.sum(mt.to_jax(b)))
  print(f"trial {trial}: without a handshake JAX read sum {got_unsynced:.0f}, with it "
        f"{got_synced:.0f} (written: {1 << 20})")
