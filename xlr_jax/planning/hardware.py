"""The hardware probe: what the machine is and what it can do, as a frozen profile.

`probe()` reads the backend and devices from JAX, memory as the JAX client can
allocate it (GPU: its preallocated pool's limit, or NVML's free memory read
before JAX starts; CPU: /proc/meminfo), and peak bandwidth and FLOP/s from
a table of known GPUs. An unknown GPU falls back to a measurement when asked
(`probe(measure=True)`) or else to a conservative default, and says so in
`notes`. `measure_peaks()` times a copy and a matmul on the spot.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)
GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    bandwidth_gb_s: float   # peak HBM/GDDR bandwidth
    tflops_bf16: float      # dense bf16 tensor-core peak (f32 accumulate)
    memory_gb: float
    # one direction of a device's link to the others of its host: NVLink on SXM boards,
    # else its PCIe slot (what a tensor-parallel all-reduce moves through)
    interconnect_gb_s: float = 0.0


NVLINK4, NVLINK3, NVLINK5 = 450, 300, 900  # GB/s a direction (900, 600, 1800 both ways)
PCIE4, PCIE5 = 32, 64  # x16, a direction
# Vendor datasheet peaks (dense, no sparsity). Matched by whole words of the
# device name, longest key first (see gpu_spec).
KNOWN_GPUS: dict[str, GpuSpec] = {
    "B200": GpuSpec(8000, 2250, 180, NVLINK5),
    "H200": GpuSpec(4800, 989, 141, NVLINK4),
    "H100 PCIe": GpuSpec(2000, 756, 80, PCIE5),
    "H100": GpuSpec(3350, 989, 80, NVLINK4),
    "A100-SXM4-40GB": GpuSpec(1555, 312, 40, NVLINK3),
    "A100": GpuSpec(2039, 312, 80, NVLINK3),
    "L40S": GpuSpec(864, 362, 48, PCIE4),
    "L40": GpuSpec(864, 181, 48, PCIE4),
    "L4": GpuSpec(300, 121, 24, PCIE4),
    "A10": GpuSpec(600, 125, 24, PCIE4),
    "RTX 5090": GpuSpec(1792, 209, 32, PCIE5),
    "RTX 4090": GpuSpec(1008, 165, 24, PCIE4),
    "RTX 3090": GpuSpec(936, 71, 24, PCIE4),
}
# unmeasured fallbacks: low enough not to promise too much
CONSERVATIVE_GPU = GpuSpec(300, 50, 0, PCIE4)
CONSERVATIVE_CPU = GpuSpec(20, 0.5, 0)


@dataclass(frozen=True)
class HardwareProfile:
    backend: str                  # "gpu" or "cpu"
    device_name: str
    device_count: int
    memory_total_bytes: int       # per device
    memory_free_bytes: int        # what the JAX client can still allocate
    compute_capability: str | None
    cpu_cores: int
    peak_bandwidth_gb_s: float
    peak_tflops: float            # the compute dtype's dense peak
    peak_source: str              # "table", "measured" or "default"
    notes: tuple[str, ...] = ()
    cpu_vector_bits: int = 0      # the host CPU's widest SIMD registers; 0: unknown
    memory_source: str = ""       # where memory_free_bytes comes from
    # one direction of a device's link to its peers (GpuSpec); the CPU's virtual devices
    # share its memory, so theirs is its memory bandwidth
    interconnect_gb_s: float = 0.0

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where compute and memory time are equal."""
        return self.peak_tflops * 1e12 / (self.peak_bandwidth_gb_s * GB)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        raw = json.loads(text)
        return cls(**{**raw, "notes": tuple(raw.get("notes", ()))})


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


def gpu_spec(name: str) -> GpuSpec | None:
    """The table's entry whose words appear together in the device name, the longest key
    first: "NVIDIA H100 PCIe" is an "H100 PCIe", "NVIDIA A100-SXM4-40GB" an
    "A100-SXM4-40GB", and "NVIDIA L40" no "L4" (a substring match would say so)."""
    words = _words(name)
    for key in sorted(KNOWN_GPUS, key=lambda k: (len(_words(k)), len(k)), reverse=True):
        run = _words(key)
        if any(words[i:i + len(run)] == run for i in range(len(words) - len(run) + 1)):
            return KNOWN_GPUS[key]
    return None


PRESET_ALIASES = {"a10080gb": "A100"}  # the table's "A100" is the 80 GB one


def preset(name: str) -> HardwareProfile:
    """A profile for a GPU in the table (e.g. "h200", "rtx 4090", "a100-80gb"), as if
    probed idle."""
    wanted = name.lower().replace(" ", "").replace("-", "")
    key = PRESET_ALIASES.get(wanted) or next(
        (k for k in KNOWN_GPUS if k.lower().replace(" ", "").replace("-", "") == wanted), None)
    if key is None:
        raise ValueError(f"unknown hardware {name!r}; known: "
                         + ", ".join([k.lower().replace(" ", "") for k in KNOWN_GPUS]
                                     + ["a100-80gb"]))
    spec = KNOWN_GPUS[key]
    mem = int(spec.memory_gb * GB)
    return HardwareProfile("gpu", f"NVIDIA {key}", 1, mem, mem, None, os.cpu_count() or 1,
                           spec.bandwidth_gb_s, spec.tflops_bf16, "table",
                           memory_source="the datasheet's memory, as if idle (a preset)",
                           interconnect_gb_s=spec.interconnect_gb_s)


def probe(measure: bool = False) -> HardwareProfile:
    """Profile the first JAX device; `measure` times its peaks instead of looking them up."""
    nvml = _nvml_memory()  # before JAX starts a backend, whose preallocation NVML counts as used
    device = jax.devices()[0]
    backend = jax.default_backend()
    if backend == "cpu":
        name, capability = cpu_name(), None
        (total, free), memory_source = _host_memory(), "host RAM available (/proc/meminfo)"
    else:
        name, capability = device.device_kind, getattr(device, "compute_capability", None)
        total, free, memory_source = gpu_memory(nvml, device.memory_stats(), jax_preallocates())
    spec, source, notes = peaks(name, backend, measure)
    link = spec.bandwidth_gb_s if backend == "cpu" else spec.interconnect_gb_s
    return HardwareProfile(backend, name, jax.device_count(), total, free,
                           None if capability is None else str(capability), os.cpu_count() or 1,
                           spec.bandwidth_gb_s, spec.tflops_bf16, source, notes,
                           cpu_vector_bits(), memory_source, link)


def peaks(name: str, backend: str, measure: bool = False) -> tuple[GpuSpec, str, tuple]:
    """(peak rates, where they come from, notes) for a device: the table, a measurement,
    or, for an unknown device, conservative defaults with a warning saying so."""
    if measure:  # the link is not measured: a GPU's is the table's
        rates = measure_peaks()
        link = (gpu_spec(name) or CONSERVATIVE_GPU).interconnect_gb_s if backend == "gpu" else 0
        return (GpuSpec(rates["bandwidth_gb_s"], rates["matmul_tflops"], 0, link),
                "measured", ())
    spec = gpu_spec(name) if backend == "gpu" else None
    if spec is not None:
        return spec, "table", ()
    spec = CONSERVATIVE_GPU if backend == "gpu" else CONSERVATIVE_CPU
    what = f"{name} is not in the GPU table" if backend == "gpu" else "the CPU has no table"
    note = (f"{what}: conservative peaks ({spec.bandwidth_gb_s:.0f} GB/s, "
            f"{spec.tflops_bf16:g} TFLOP/s); `xlr probe --measure` measures them")
    if backend == "gpu":
        log.warning(note)
    return spec, "default", (note,)


def measure_peaks(gib: float | None = None, runs: int = 10) -> dict:
    """Memory bandwidth and a square matmul rate, medians. GPU: a copy (read + write);
    CPU: a read (jnp.sum), since XLA:CPU's elementwise copy runs on one thread and
    decode's weight reads are what the bandwidth bounds."""
    cpu = jax.default_backend() == "cpu"
    kind = "read" if cpu else "copy"
    rate = measure_bandwidth(kind, gib or (0.5 if cpu else 2.0), runs)
    dtype, size = (jnp.float32, 1024) if cpu else (jnp.bfloat16, 8192)
    a = jax.random.normal(jax.random.key(1), (size, size), dtype)
    seconds = _median_seconds(jax.jit(lambda m: m @ m), a, runs)
    return {"bandwidth_gb_s": rate[f"{kind}_bandwidth_gb_per_s"], "bandwidth": rate,
            "matmul_tflops": 2 * size ** 3 / seconds / 1e12, "matmul_size": size,
            "matmul_dtype": jnp.dtype(dtype).name, "runs": runs}


def measure_bandwidth(kind: str, gib: float, runs: int) -> dict:
    """Device memory bandwidth from a jitted pass over a large f32 array (median of runs)."""
    # random contents: a constant array's identical pages can be merged by the host
    # (same-page dedup), and reads then hit cache (seen: 71 GB/s on 2 cores)
    x = jax.random.uniform(jax.random.key(0), (int(gib * 2 ** 30) // 4,), jnp.float32)
    if kind == "read":  # bytes read once
        fn, moved, how = jax.jit(jnp.sum), x.nbytes, "jitted jnp.sum over an f32 array"
    elif kind == "copy":  # read once, written once
        fn, moved, how = jax.jit(lambda a: a + 1), 2 * x.nbytes, "jitted x + 1 (read + write)"
    else:
        raise ValueError(f"bandwidth kind must be 'read' or 'copy' (got {kind!r})")
    fn(x).block_until_ready()
    rates = []
    for _ in range(runs):
        t = time.perf_counter()
        fn(x).block_until_ready()
        rates.append(moved / (time.perf_counter() - t) / 1e9)
    return {"kind": kind, "method": how, "array_bytes": x.nbytes, "runs": runs,
            f"{kind}_bandwidth_gb_per_s": statistics.median(rates), "runs_gb_per_s": rates}


def _median_seconds(fn, arg, runs: int) -> float:
    fn(arg).block_until_ready()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn(arg).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def jax_preallocates(env=os.environ) -> bool:
    """Whether JAX's GPU client reserves its memory pool when it starts (the default), as
    jaxlib reads XLA_PYTHON_CLIENT_ALLOCATOR and XLA_PYTHON_CLIENT_PREALLOCATE."""
    return (env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower() != "platform"
            and env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "") not in ("false", "False", "0"))


def gpu_memory(nvml: tuple[int, int] | None, stats: dict | None,
               preallocated: bool) -> tuple[int, int, str]:
    """(total, free, source) of a GPU: free is what the JAX client can still allocate.

    `nvml` is NVML's (total, free) read before JAX started, `stats` the device's
    `memory_stats()`. A preallocated pool (by default 75% of the GPU) is all JAX can
    use, and NVML counts it as taken: budget its limit less what is in use. Without
    preallocation JAX allocates on demand: NVML's free memory, within the allocator's
    limit when it has one (BFC keeps its fraction as a cap).
    """
    stats = stats or {}
    limit = stats.get("bytes_limit")
    pool_free = None if limit is None else int(limit) - int(stats.get("bytes_in_use", 0))
    total = nvml[0] if nvml else int(limit or 0)
    if pool_free is not None and (preallocated or nvml is None):
        what = "preallocated pool" if preallocated else "allocator"
        return total, pool_free, f"JAX's {what}: bytes_limit - bytes_in_use"
    if nvml is None:
        return total, 0, "no reading (no NVML, no JAX memory stats)"
    if pool_free is not None and pool_free < nvml[1]:
        return total, pool_free, "JAX's allocator limit (below NVML's free memory)"
    return total, nvml[1], "NVML free memory before JAX started"


def _nvml_memory() -> tuple[int, int] | None:
    """NVML's (total, free) bytes of the first visible GPU; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        handle = (pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-"))
                  else pynvml.nvmlDeviceGetHandleByIndex(int(first or 0)))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.free)
    except Exception:  # no NVML (non-NVIDIA, no driver, sandboxed)
        return None


def _host_memory() -> tuple[int, int]:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages


def cpu_name() -> str:
    return _cpuinfo_field("model name") or "cpu"


def cpu_features() -> str:
    """The CPU's feature flags (x86 `flags`, ARM `Features`), else the processor's name:
    what code compiled for this CPU may use (the same machine may come up with or
    without AVX-512), so what a cache of compiled code is keyed by."""
    return _cpuinfo_field("flags") or _cpuinfo_field("Features") or platform.processor()


def cpu_vector_bits() -> int:
    """Width of the host CPU's widest SIMD registers (0: unknown, e.g. off Linux)."""
    return simd_bits(_cpuinfo_field("flags") or "")


def simd_bits(flags: str) -> int:
    """From an x86 /proc/cpuinfo flags line: 512 with AVX-512F, 256 with AVX2, 128
    otherwise; 0 for no flags."""
    names = set(flags.split())
    if not names:
        return 0
    return 512 if "avx512f" in names else 256 if "avx2" in names else 128


def _cpuinfo_field(key: str) -> str | None:
    """The first `key : value` of /proc/cpuinfo (None off Linux or without it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
