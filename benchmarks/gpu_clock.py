"""The GPU's SM clock, power draw and temperature, read through NVML in a thread.

On the H200 the attention kernels run at the board's power limit: timed back to back,
the draw climbs to about 690 of its 700 W within a second and the SM clock falls from
1980 MHz to 1550-1700 (`benchmarks/sustained.py`, `results/mosaic-488cafb/`), so a
timing says what it says at the clock it ran at. The harness (`bench.py`) records the
mean of these over each implementation's timed rounds.

NVML (libnvidia-ml, the driver's own library, through ctypes) rather than `nvidia-smi
-lms` in a pipe: nvidia-smi's output to a pipe is block-buffered, so its lines arrived
seconds after they were read, and at 488cafb the first rows of a run were given the
idle clock of the compile before them.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

SAMPLE_FIELDS = ("sm_mhz", "power_w", "temp_c")  # as the harness's rows name them
_NVML_CLOCK_SM = 1
_NVML_TEMPERATURE_GPU = 0


def _nvml():
    """(library, device 0's handle), or None where there is no NVML (no NVIDIA driver)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    handle = ctypes.c_void_p()
    if lib.nvmlInit_v2() or lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)):
        return None
    return lib, handle


def read_once(nvml) -> list[float] | None:
    """[SM clock in MHz, power in W, temperature in C] now, or None if a read fails."""
    lib, handle = nvml
    clock, power, temp = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    if (
        lib.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(clock))
        or lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power))  # milliwatts
        or lib.nvmlDeviceGetTemperature(handle, _NVML_TEMPERATURE_GPU, ctypes.byref(temp))
    ):
        return None
    return [float(clock.value), power.value / 1000.0, float(temp.value)]


class Sampler:
    """The readings every `ms` milliseconds, each with the host time (`time.time()`) it
    was taken; none where NVML is missing."""

    def __init__(self, ms: int = 20):
        self.samples: list[tuple[float, list[float]]] = []
        self.interval = ms / 1000.0
        self._stop = threading.Event()
        self.nvml = _nvml()
        if self.nvml is not None:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while not self._stop.is_set():
            values = read_once(self.nvml)
            if values is not None:
                self.samples.append((time.time(), values))
            time.sleep(self.interval)

    def between(self, t0: float, t1: float) -> dict:
        return self.during([(t0, t1)])

    def during(self, spans) -> dict:
        """Each field's mean over the samples taken within any of the (start, end) spans
        (host times); {} where none was (no NVML, or spans too short)."""
        rows = [v for t, v in self.samples if any(a <= t <= b for a, b in spans)]
        if not rows:
            return {}
        arr = np.asarray(rows)
        return {f: round(float(np.mean(arr[:, i])), 1) for i, f in enumerate(SAMPLE_FIELDS)}

    def stop(self):
        self._stop.set()
