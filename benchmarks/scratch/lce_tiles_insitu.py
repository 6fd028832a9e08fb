"""ops.mosaic_gemm tiles timed where they run: in the chunk loop of linear_cross_entropy, under
ncu (per-kernel durations; isolated timings of these GEMMs move by ±10% between machines and
do not rank tiles the way the loop does).

Each round rewrites configs/tuning/linear_cross_entropy.toml's [mosaic_gemm.default.*_<layout>]
sections with one candidate per GEMM, runs benchmarks/scratch/lce_profile.py under ncu and
prints each GEMM's mean duration over the second call's chunks (the first chunk excluded).

    LCE_LAYOUT=vd CHUNK=512 python benchmarks/scratch/lce_tiles_insitu.py    (on the GPU machine)
"""
import os
import pathlib
import re
import statistics
import subprocess
import sys

TOML = pathlib.Path("configs/tuning/linear_cross_entropy.toml")
C = dict(tile_n=128, max_concurrent_steps=3)
PP = dict(schedule="pingpong", tile_n=128, band=8)
R = dict(schedule="ring", tile_n=128, max_concurrent_steps=3, in_flight=0)
R4 = dict(schedule="ring", tile_n=128, max_concurrent_steps=4, epilogue_rows=64)
# Round k uses the k-th candidate of every GEMM; the last round is the configured default.
# This sweep: the logits GEMM with one WGMMA group in flight and 4 slots (epilogue through
# 64-row halves). Earlier sweeps are in the history of this file.
PPX = dict(PP, max_concurrent_steps=5, minor="m", cluster="m")
CANDIDATES = {
    "vd": {
        "logits": [R4, dict(R4, in_flight=0), dict(R4, cluster="m"), R,
                   dict(R4, minor="m", band=8), C],
        "dw": [dict(C, minor="m", cluster="m")] * 6,
        "dx": [PPX] * 6,
    },
    "dv": {
        "logits": [R4, dict(R4, in_flight=0), dict(R4, cluster="m"), R,
                   dict(R4, minor="m", band=8), C],
        "dw": [dict(C, minor="m", band=4, cluster="m")] * 6,
        "dx": [dict(PP, max_concurrent_steps=4, minor="m")] * 6,
    },
}


def section(name, fields):
  body = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in fields.items())
  return f"[mosaic_gemm.default.{name}]\n{body}"


def main():
  layout, chunk = os.environ.get("LCE_LAYOUT", "vd"), os.environ.get("CHUNK", "512")
  original = TOML.read_text()
  env = dict(os.environ, LCE_LAYOUT=layout, LCE_GEMMS="logits+dx+dw")
  candidates = CANDIDATES[layout]
  rounds = len(candidates["dw"])
  try:
    for k in range(rounds):
      text = original
      for gemm, cands in candidates.items():  # replace the section, or add it (it outranks
        name = f"{gemm}_{layout}"               # a layout-free [mosaic_gemm.default.<gemm>])
        pattern = rf"\[mosaic_gemm\.default\.{name}\]\n(?:[^\[\n][^\n]*\n)*"
        text, found = re.subn(pattern, section(name, cands[k]) + "\n", text)
        if not found:
          text += "\n" + section(name, cands[k])
      TOML.write_text(text)
      subprocess.run([sys.executable, "benchmarks/scratch/lce_profile.py", "memeff", chunk],
                     env=env, check=True, capture_output=True)
      out = subprocess.run(["ncu", "--clock-control", "none", "--metrics", "gpu__time_duration.sum",
                            sys.executable, "benchmarks/scratch/lce_profile.py", "memeff", chunk],
                           env=env, capture_output=True, text=True).stdout
      names = re.findall(r"^  (\S+?)\s*\(", out, re.M)
      times = [float(v) * {"ms": 1000, "us": 1, "ns": 1e-3}[u] for u, v in
               re.findall(r"gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)", out.replace(",", ""))]
      assert len(names) == len(times), (len(names), len(times), out[-2000:])
      seq = list(zip(names, times))
      mosaic = [t for n, t in seq[len(seq) // 2:] if "mosaic" in n]
      # per chunk after the first: logits, dW +=, dx (the first chunk: logits, dx, dW =)
      means = [statistics.mean(mosaic[3 + i::3]) for i in range(3)]
      print(f"round {k}: logits {means[0]:6.1f} us  dW+= {means[1]:6.1f} us  dx {means[2]:6.1f} us"
            f"   {[candidates[g][k] for g in ('logits', 'dw', 'dx')]}", flush=True)
  finally:
    TOML.write_text(original)


if __name__ == "__main__":
  main()
