"""benchmarks/profile_kernels.py: the kernel summary of a profile, and a CPU run end to end."""

import json
import re

import jax
import pytest

from benchmarks import profile_kernels

# One GPU plane: two overlapping kernels on a stream (busy 3 µs, not 4), the all-reduce's
# last µs beside a copy only (exposed all the same), and a derived "XLA Ops" line that
# repeats one of them and must not count.
_PROFILE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines {
    id: 1
    name: "Stream #13(compute)"
    timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 }
    events { metadata_id: 2 offset_ps: 1000000 duration_ps: 2000000 }
    events { metadata_id: 1 offset_ps: 9000000 duration_ps: 1000000 }
  }
  lines {
    id: 3
    name: "Stream #14(copies)"
    timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 2000000 duration_ps: 1000000 }
  }
  lines {
    id: 2
    name: "XLA Ops"
    timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "attention_kernel" } }
  event_metadata { key: 2 value { id: 2 name: "ncclDevKernel_AllReduce_Sum_bf16" } }
  event_metadata { key: 3 value { id: 3 name: "MemcpyD2D" } }
}
planes { id: 2 name: "/host:CPU" }
"""


def test_summary_counts_stream_kernels_once():
  data = jax.profiler.ProfileData.from_text_proto(_PROFILE)
  got = profile_kernels.summarize(data, calls=2)
  assert list(got) == ["/device:GPU:0"]
  gpu = got["/device:GPU:0"]
  assert gpu["busy_ms"] == pytest.approx(4e-3 / 2)  # [0, 3) ∪ [9, 10) µs, over 2 calls
  assert gpu["collectives_ms"] == pytest.approx(2e-3 / 2)
  assert gpu["exposed_collectives_ms"] == pytest.approx(1e-3 / 2)  # [2, 3): beside the copy
  assert gpu["kernels"] == [("attention_kernel", pytest.approx(3e-3 / 2), 1.0),
                            ("ncclDevKernel_AllReduce_Sum_bf16", pytest.approx(2e-3 / 2), 0.5),
                            ("MemcpyD2D", pytest.approx(1e-3 / 2), 0.5)]


def test_a_case_profiles_on_cpu(tmp_path, capsys):
  """On a CPU the profile has no GPU plane: the run says so and records an empty summary,
  with the compiled program's collectives (the data-parallel loss on 2 devices: its float32
  dW all-reduced)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  out = tmp_path / "kernels.jsonl"
  profile_kernels.main(["--case", "loss", "--small", "--devices", "1,2",
                        "--provider", "jax_naive", "--calls", "2", "--out", str(out)])
  one, two = [json.loads(line) for line in out.read_text().splitlines()]
  assert (one["case"], one["provider"], one["devices"], one["gpus"]) == (
      "loss", "jax_naive", 1, {})
  assert one["collectives"] == {} and two["devices"] == 2 and one["wall_ms"] > 0
  assert any(k.startswith("all-reduce") and re.search(r"f32\[(64,1024|1024,64)\]", k)
             for k in two["collectives"]), two["collectives"]  # dW, [D, V] = [64, 1024]
  assert "no GPU kernels" in capsys.readouterr().out


def test_collectives_of_hlo_text():
  text = ("%ag = bf16[64,1024]{1,0} all-gather-start(bf16[32,1024]{1,0} %p), dimensions={0}\n"
          "%ar = (f32[8]{0}, f32[]) all-reduce(f32[8]{0} %a, f32[] %b), to_apply=%add\n"
          "%ag2 = bf16[64,1024]{1,0} all-gather(bf16[32,1024]{1,0} %q), dimensions={0}\n")
  assert profile_kernels.collectives(text) == {"all-gather bf16[64,1024]": 2,
                                               "all-reduce (f32[8], f32[])": 1}


def test_an_attention_shape_profiles_on_cpu(tmp_path):
  """--attention: one device's forward+backward at a shape, memeff beside the peer."""
  out = tmp_path / "kernels.jsonl"
  profile_kernels.main(["--attention", "b=1,t=256,h=4,hkv=2,d=32,window=64", "--calls", "2",
                        "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["provider"], r["devices"]) for r in rows] == [("memeff", 1), ("xla", 1)]
  with pytest.raises(SystemExit, match="unknown sizes"):
    profile_kernels.main(["--attention", "b=1,t=256,h=4,d=32,heads=2"])


def test_a_loss_head_profiles_on_cpu(tmp_path):
  """--loss: one device's linear cross-entropy with gradients at a head, memeff beside the
  three-matmul floor and plain XLA."""
  out = tmp_path / "kernels.jsonl"
  profile_kernels.main(["--loss", "n=256,d=64,v=1000", "--calls", "2", "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["case"], r["provider"]) for r in rows] == [
      ("loss n=256,d=64,v=1000", p) for p in ("memeff", "floor", "jax_naive")]
  with pytest.raises(SystemExit, match="give n, d and v"):
    profile_kernels.main(["--loss", "n=256,d=64"])
