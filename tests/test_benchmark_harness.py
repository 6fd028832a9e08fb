"""benchmarks/_harness.py's GPU clock and power sampling: nvidia-smi's lines parsed, samples
averaged over each provider's timed windows, and the windows marked by interleaved."""

import pytest

from benchmarks import _harness


@pytest.mark.parametrize("line, expected", [
    ("1410, 691.23\n", (1410.0, 691.23)),
    ("1980, 72.5", (1980.0, 72.5)),
    ("clocks.sm [MHz], power.draw [W]", None),
    ("[N/A], 300.00", None),
    ("", None),
])
def test_nvidia_smi_lines_parse_to_clock_and_power(line, expected):
  assert _harness.parse_gpu_sample(line) == expected


def test_samples_are_averaged_over_each_providers_windows():
  gpu = _harness.GpuSampler()
  gpu.samples = [(1.0, 1300.0, 700.0), (2.0, 1320.0, 698.0), (3.0, 1450.0, 690.0),
                 (4.0, 1470.0, 692.0), (6.0, 1980.0, 80.0)]
  gpu.mark("floor", 0.5, 2.5)
  gpu.mark("memeff", 2.9, 3.1)
  gpu.mark("memeff", 3.9, 4.1)
  gpu.mark("idle", 4.5, 5.5)  # no sample inside: no entry
  summary = gpu.summary()
  assert summary == {"floor": {"sm_mhz": 1310.0, "power_w": 699.0, "gpu_samples": 2},
                     "memeff": {"sm_mhz": 1460.0, "power_w": 691.0, "gpu_samples": 2}}


def test_interleaved_marks_one_window_per_timed_call():
  gpu = _harness.GpuSampler()  # not entered: no nvidia-smi, only the windows
  calls = []
  timers = {name: (lambda name=name: calls.append(name) or float(len(calls)))
            for name in ("a", "b", "c")}
  times = _harness.interleaved(timers, rounds=4, gpu=gpu)
  assert {name: len(t) for name, t in times.items()} == {"a": 4, "b": 4, "c": 4}
  assert calls[:3] == ["a", "b", "c"] and calls[3:6] == ["b", "c", "a"]
  for name in timers:
    windows = gpu.windows[name]
    assert len(windows) == 4 and all(start <= end for start, end in windows)
  assert gpu.summary() == {}


def test_sampler_without_nvidia_smi_summarizes_nothing(monkeypatch):
  monkeypatch.setattr(_harness.shutil, "which", lambda name: None)
  with _harness.GpuSampler() as gpu:
    gpu.mark("floor", 0.0, 1e12)
  assert gpu.summary() == {}


@pytest.mark.parametrize("on_gpu", [False, True])
def test_sampled_rounds_times_every_timer(monkeypatch, on_gpu):
  monkeypatch.setattr(_harness.shutil, "which", lambda name: None)  # no nvidia-smi here
  times, clocks = _harness.sampled_rounds({"a": lambda: 1.0, "b": lambda: 2.0}, 3, on_gpu)
  assert times == {"a": [1.0] * 3, "b": [2.0] * 3}
  assert clocks == {}


def test_clock_text_shows_the_figures_a_row_has():
  assert _harness.clock_text({"sm_mhz": 1450.2, "power_w": 690.4}) == " | 1,450 MHz 690 W"
  assert (_harness.clock_text({"sm_mhz": 1450.2, "power_w": 690.4, "gpu_samples": 1})
          == " | 1,450 MHz 690 W (1 sample)")
  assert (_harness.clock_text({"sm_mhz": 1980.0, "power_w": 80.0, "gpu_samples": 12})
          == " | 1,980 MHz 80 W (12 samples)")
  assert _harness.clock_text({"ms": 1.0}) == ""
