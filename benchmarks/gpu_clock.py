"""The GPU's SM clock, power draw and temperature, read from `nvidia-smi` in a thread.

On the H200 the attention kernels run at the board's power limit: timed back to back,
the draw climbs to about 690 of its 700 W within a second and the SM clock falls from
1980 MHz to 1620-1700 (`benchmarks/sustained.py`, `results/mosaic-39889fd/`), so a
timing says what it says at the clock it ran at. The harness (`bench.py`) records the
mean of these over each implementation's timed rounds.
"""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np

SAMPLE_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")


class Sampler:
    """nvidia-smi's readings every `ms` milliseconds, each with the host time it arrived."""

    def __init__(self, ms: int = 20):
        cmd = ["nvidia-smi", f"--query-gpu={','.join(SAMPLE_FIELDS)}"]
        cmd += ["--format=csv,noheader,nounits", f"-lms={ms}"]
        self.samples: list[tuple[float, list[float]]] = []
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                values = [float(x) for x in line.split(",")]
            except ValueError:
                continue
            self.samples.append((time.time(), values))

    def between(self, t0: float, t1: float) -> dict:
        return self.during([(t0, t1)])

    def during(self, spans) -> dict:
        """Each field's mean over the samples taken within any of the (start, end) spans
        (host times, `time.time()`); {} where none was (no nvidia-smi, or spans too short)."""
        rows = [v for t, v in self.samples if any(a <= t <= b for a, b in spans)]
        if not rows:
            return {}
        arr = np.asarray(rows)
        return {f: round(float(np.mean(arr[:, i])), 1) for i, f in enumerate(SAMPLE_FIELDS)}

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
