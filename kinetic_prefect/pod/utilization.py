"""What a job used, sampled inside the job (stdlib only: it ships with the runner, and imports no Prefect).

The runner starts a ``Sampler`` thread around the function. Every ``KINETIC_USAGE_SAMPLE_SECONDS`` (default 2;
0 turns it off) it prints one line, ``contract.USAGE_PREFIX`` + JSON, with what it could read:

* ``cpu``: the job process's CPU time over the interval, in percent of the machine's cores; ``rss``: its
  resident memory in bytes; ``mem_total``: the machine's memory (everywhere, from ``/proc``);
* ``gpus``: per GPU, utilization percent and memory used / total, through NVML (``libnvidia-ml``) when the
  library and a GPU are there;
* ``devices``: per JAX accelerator device, ``memory_stats()`` (bytes in use, peak, limit), only once the
  function has initialised JAX itself (the sampler never imports JAX or starts a backend: that would pick the
  devices before ``jax.distributed`` joins a group). CPU devices give None or a partial dict: skipped.

The worker following the job takes these lines out of the log and turns them into the job run's usage
artifacts (``kinetic_prefect.workers.usage_report``). A figure that cannot be read is left out, never faked.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
import time
from typing import Any

from kinetic_prefect.contract import USAGE_PREFIX, settings

DEFAULT_INTERVAL_SECONDS = settings.USAGE_SAMPLE_SECONDS.default


def _cpu_seconds() -> float | None:
    """User + system CPU time of this process and its waited-for children."""
    try:
        times = os.times()
    except OSError:
        return None
    return times.user + times.system + times.children_user + times.children_system


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _memory_total() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _NvmlUtilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class Nvml:
    """The few NVML calls the sampler needs, through ctypes (no Python package needed in the job's image)."""

    LIBRARY_NAMES = ("libnvidia-ml.so.1", "libnvidia-ml.so")

    def __init__(self, library: Any):
        self.lib = library
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        count = ctypes.c_uint()
        if self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            raise OSError("nvmlDeviceGetCount failed")
        self.handles = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0:
                self.handles.append(handle)

    @classmethod
    def open(cls) -> Nvml | None:
        """NVML when the library loads and sees at least one GPU, else None."""
        for name in cls.LIBRARY_NAMES:
            try:
                nvml = cls(ctypes.CDLL(name))
            except (OSError, AttributeError):
                continue
            return nvml if nvml.handles else None
        return None

    def sample(self) -> list[dict[str, Any]]:
        gpus = []
        for index, handle in enumerate(self.handles):
            utilization, memory = _NvmlUtilization(), _NvmlMemory()
            entry: dict[str, Any] = {"index": index}
            if self.lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(utilization)) == 0:
                entry["util"] = float(utilization.gpu)
            if self.lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0:
                entry["mem_used"], entry["mem_total"] = int(memory.used), int(memory.total)
            gpus.append(entry)
        return gpus


def _imported(name: str) -> Any:
    """``sys.modules[name]`` once its import has finished, else None; never imports anything."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def jax_device_memory() -> list[dict[str, Any]]:
    """``memory_stats()`` of JAX's local non-CPU devices, once the job initialised a JAX backend; else []."""
    # Only modules the job finished importing: this runs on the sampler's thread, and an import from here while
    # the job's main thread is still inside `import jax` handed the main thread a half-made `xla_bridge` (Python's
    # import deadlock avoidance), which failed the job with "no attribute 'is_known_platform'".
    jax, xla_bridge = _imported("jax"), _imported("jax._src.xla_bridge")
    if jax is None or xla_bridge is None:
        return []
    try:
        if not getattr(xla_bridge, "_backends", None):
            return []
        devices = jax.local_devices()
    except Exception:
        return []
    found: list[Any] = []
    for device in devices:
        if getattr(device, "platform", "cpu") == "cpu":
            continue
        try:
            stats = device.memory_stats()
        except Exception:
            stats = None
        if not stats or "bytes_in_use" not in stats:
            continue  # CPU-like devices answer None or a partial dict: nothing to report
        found.append(
            {
                "id": int(getattr(device, "id", len(found))),
                "platform": device.platform,
                "in_use": int(stats["bytes_in_use"]),
                "peak": int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])),
                "limit": int(stats["bytes_limit"]) if stats.get("bytes_limit") else None,
            }
        )
    return found


class Sampler:
    """Prints a usage line every ``interval`` seconds from a daemon thread, and a last one at ``stop()``."""

    def __init__(self, interval: float = DEFAULT_INTERVAL_SECONDS, nvml: Nvml | None = None, write: Any = None):
        self.interval = interval
        self.nvml = nvml
        self._write = write or self._write_stdout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cores = os.cpu_count() or 1
        self._last_cpu = _cpu_seconds()
        self._last_wall = time.monotonic()
        self.samples = 0

    @staticmethod
    def _write_stdout(text: str) -> None:
        # One write per line, so the line never interleaves with the function's own output mid-line.
        try:
            os.write(sys.stdout.fileno(), text.encode())
        except (OSError, ValueError, AttributeError):
            print(text, end="", flush=True)

    @classmethod
    def from_env(cls) -> Sampler | None:
        try:
            interval = settings.USAGE_SAMPLE_SECONDS.value()
        except ValueError:  # a bad value must not fail the job: it samples at the default
            interval = DEFAULT_INTERVAL_SECONDS
        if interval <= 0:
            return None
        return cls(interval, nvml=Nvml.open())

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        record: dict[str, Any] = {"t": round(time.time(), 3)}
        cpu = _cpu_seconds()
        if cpu is not None and self._last_cpu is not None and now > self._last_wall:
            record["cpu"] = round(100.0 * (cpu - self._last_cpu) / (now - self._last_wall) / self._cores, 2)
        self._last_cpu, self._last_wall = cpu, now
        for name, value in (("rss", _rss_bytes()), ("mem_total", _memory_total()), ("cores", self._cores)):
            if value is not None:
                record[name] = value
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                record["gpus"] = self.nvml.sample()
        devices = jax_device_memory()
        if devices:
            record["devices"] = devices
        return record

    def emit(self) -> None:
        try:
            self._write(USAGE_PREFIX + json.dumps(self.sample()) + "\n")
            self.samples += 1
        except Exception:  # usage is a nicety: it never fails a job
            pass

    def start(self) -> Sampler:
        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.emit()

        self._thread = threading.Thread(target=loop, name="kinetic-usage-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.emit()


def start() -> Sampler | None:
    """The runner's hook: a started sampler, or None when sampling is off."""
    sampler = Sampler.from_env()
    return sampler.start() if sampler is not None else None


def parse(line: str) -> dict[str, Any] | None:
    """The usage sample of a log line, or None when the line is ordinary output."""
    if not line.startswith(USAGE_PREFIX):
        return None
    try:
        record = json.loads(line[len(USAGE_PREFIX) :])
    except ValueError:
        return None
    return record if isinstance(record, dict) and "t" in record else None


__all__ = ["Nvml", "Sampler", "jax_device_memory", "parse", "start"]
