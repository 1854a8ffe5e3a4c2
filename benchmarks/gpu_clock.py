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

# As the harness's rows name them. power_w is nvmlDeviceGetPowerUsage, which on Ampere
# (but GA100) and newer averages the draw over the last second: longer than a timed
# round, so a row's reading mixes in the rows before it. power_now_w is the instantaneous
# draw (the field NVML_FI_DEV_POWER_INSTANT), a row's own; with the row's TFLOP/s it gives
# the energy a flop, which decides the speed of a kernel held at the board's power limit.
SAMPLE_FIELDS = ("sm_mhz", "power_w", "temp_c", "power_now_w")
_NVML_CLOCK_SM = 1
_NVML_TEMPERATURE_GPU = 0
_NVML_FI_DEV_POWER_INSTANT = 186  # milliwatts


class _Value(ctypes.Union):  # nvmlValue_t, its members in nvmlValueType_t's order
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class _FieldValue(ctypes.Structure):  # nvmlFieldValue_t
    _fields_ = [
        ("fieldId", ctypes.c_uint),
        ("scopeId", ctypes.c_uint),
        ("timestamp", ctypes.c_longlong),
        ("latencyUsec", ctypes.c_longlong),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", _Value),
    ]


# nvmlValueType_t: the union member each type is read from
_VALUE_MEMBERS = tuple(name for name, _ in _Value._fields_)


def _instant_power_w(lib, handle) -> float:
    """The instantaneous draw in W, or NaN where NVML does not give it."""
    field = _FieldValue(fieldId=_NVML_FI_DEV_POWER_INSTANT)
    if lib.nvmlDeviceGetFieldValues(handle, 1, ctypes.byref(field)) or field.nvmlReturn:
        return float("nan")
    if field.valueType >= len(_VALUE_MEMBERS):
        return float("nan")
    return getattr(field.value, _VALUE_MEMBERS[field.valueType]) / 1000.0


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
    """[SM clock in MHz, power in W (averaged by NVML), temperature in C, power in W (now,
    NaN where NVML lacks the field)], or None if one of the first three fails."""
    lib, handle = nvml
    clock, power, temp = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    if (
        lib.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(clock))
        or lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power))  # milliwatts
        or lib.nvmlDeviceGetTemperature(handle, _NVML_TEMPERATURE_GPU, ctypes.byref(temp))
    ):
        return None
    return [
        float(clock.value),
        power.value / 1000.0,
        float(temp.value),
        _instant_power_w(lib, handle),
    ]


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
        arr = np.asarray(rows, dtype=float)
        return {
            f: round(float(np.nanmean(arr[:, i])), 1)
            for i, f in enumerate(SAMPLE_FIELDS)
            if not np.isnan(arr[:, i]).all()  # a field NVML never gave: left out
        }

    def stop(self):
        self._stop.set()
