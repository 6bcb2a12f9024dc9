"""Print the vqserve version, torch build, devices and the runtimes available here.

bf16 and fp16 support is measured, not assumed: a small matmul and convolution run in each
dtype and in fp32 on every device, and the CPU's own flags for native low-precision
arithmetic (amx_bf16, avx512_bf16, avx512_fp16, ...) are read from /proc/cpuinfo where it
exists. A dtype that runs much slower than fp32 is likely emulated. The probe takes about
0.1-0.3 s on a CPU (importing torch takes longer): it runs on one thread (vqserve's
execution plan runs each model call on one thread too; more threads on a busy machine time
the scheduler, not the dtype), and each dtype first runs a 64x smaller workload; one that
would need more than 0.25 s at full size (fp16 emulated on a CPU without
avx512_fp16/amx_fp16 runs ~100x slower than fp32) is reported from that small workload.
The ratio is a quick probe; for the tokenizer's own speed per dtype and runtime use
`vqserve bench runtimes`.

Example:
  vqserve info
  vqserve info --json
  vqserve info --no-probe     # skip the bf16/fp16 measurements
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import time
from collections.abc import Callable

from vqserve import __version__
from vqserve.core.machine import (
    affinity_cores,
    available_cores,
    available_memory,
    cpu_flags,  # noqa: F401 - re-exported: `vqserve info` reports it
    cpu_quota_cores,
    memory_limit_bytes,
)

LOW_PRECISION = ("bf16", "fp16")
# CPU flags for native arithmetic in each dtype: x86 lists them under "flags", Arm under
# "Features" (bf16; fphp/asimdhp for half precision). f16c (conversion only) is not one.
NATIVE_FLAGS = {
    "bf16": ("amx_bf16", "avx512_bf16", "avx_vnni_bf16", "bf16"),
    "fp16": ("amx_fp16", "avx512_fp16", "avx_vnni_fp16", "fphp", "asimdhp"),
}
# Workload sizes: big enough that arithmetic, not call overhead, dominates the timing.
PROBE_SIZES = {"cpu": (512, 64, 64), "cuda": (2048, 256, 128)}  # matmul n, conv channels, side
# The pilot workload: n/4, channels/4, side/2, so both the matmul (n^3) and the conv
# (channels^2 * side^2) do PILOT_SCALE times less arithmetic than the full one.
PILOT_SCALE = 64
# Most seconds the timed full-size calls of one dtype may take (as predicted from the
# pilot); a slower dtype is reported from the pilot, whose own repeats stop at this too.
PROBE_BUDGET_S = 0.25


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="skip running bf16/fp16 on each device (report CPU flags only)")


def _time_median(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 5,
                 budget_s: float | None = None) -> float:
    """Median seconds of ``fn`` after one warm-up call (which also triggers lazy kernels);
    with ``budget_s``, the repeats stop once they took that long (at least one runs)."""
    fn()
    sync()
    times: list[float] = []
    while len(times) < repeats and (budget_s is None or not times or sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def probe_sizes(device: str, pilot: bool = False) -> tuple[int, int, int]:
    """(matmul n, conv channels, side) of the full workload on ``device``, or of its pilot."""
    n, channels, side = PROBE_SIZES["cuda" if device.startswith("cuda") else "cpu"]
    return (n // 4, channels // 4, side // 2) if pilot else (n, channels, side)


def _workload(device: str, dtype, sizes: tuple[int, int, int] | None = None) -> Callable[[], object]:
    """A matmul and a 3x3 convolution in ``dtype``: the two op kinds a tokenizer spends on."""
    import torch

    n, channels, side = sizes or probe_sizes(device)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
    x = torch.randn(1, channels, side, side, generator=gen).to(device, dtype)
    w = torch.randn(channels, channels, 3, 3, generator=gen).to(device, dtype)

    def run():
        with torch.no_grad():
            return a @ b, torch.nn.functional.conv2d(x, w, padding=1)

    return run


def probe_device(device: str) -> dict:
    """For each low-precision dtype: does it run on ``device``, and at what speed vs fp32.

    Each dtype runs the pilot workload first; only when the full one is predicted to fit in
    PROBE_BUDGET_S is it timed too, otherwise the pilot's ratio is reported (``"workload":
    "pilot"``). On the CPU everything runs on one thread (restored afterwards)."""
    import torch

    if device.startswith("cuda"):
        return _probe(device, lambda: torch.cuda.synchronize(device))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _probe(device, lambda: None)
    finally:
        torch.set_num_threads(threads)


def _probe(device: str, sync: Callable[[], None]) -> dict:
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    full, small = probe_sizes(device), probe_sizes(device, pilot=True)
    fp32 = {"full": _time_median(_workload(device, dtypes["fp32"], full), sync),
            "pilot": _time_median(_workload(device, dtypes["fp32"], small), sync)}
    results = {}
    for name in LOW_PRECISION:
        try:
            seconds = _time_median(_workload(device, dtypes[name], small), sync,
                                   budget_s=PROBE_BUDGET_S)
            workload = "pilot"
            if seconds * PILOT_SCALE * 6 <= PROBE_BUDGET_S:  # warm-up + 5 repeats at full size
                seconds, workload = _time_median(_workload(device, dtypes[name], full), sync), "full"
        except (RuntimeError, NotImplementedError) as exc:  # no kernel for this dtype here
            results[name] = {"runs": False, "error": str(exc).splitlines()[0][:160]}
            continue
        ratio = fp32[workload] / seconds
        results[name] = {"runs": True, "speed_vs_fp32": round(ratio, 2 if ratio >= 0.1 else 3),
                         "workload": workload}
    return results


def low_precision_facts(probe: bool = True) -> dict:
    """Per device (cpu, cuda:N): measured bf16/fp16 support; for the CPU also its flags."""
    import torch

    flags = cpu_flags()
    cpu: dict = {"native_flags": {name: sorted(f for f in NATIVE_FLAGS[name] if f in flags)
                                  for name in LOW_PRECISION}}
    facts = {"cpu": cpu}
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for device in ("cpu", *devices):
        found = facts.setdefault(device, {})
        if not probe:
            continue
        try:
            found.update(probe_device(device))
        except RuntimeError as exc:  # even fp32 fails: a broken driver, out of memory
            reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            found.update({name: {"runs": False, "error": f"fp32 failed too: {reason}"}
                          for name in LOW_PRECISION})
    return facts


def cores_facts() -> dict:
    """The cores serve and tokenize size themselves by (``usable``), and where that number
    comes from: the affinity mask, capped by the CPU quota (a container's CPU limit)."""
    return {"usable": available_cores(), "affinity_mask": affinity_cores(), "cpu_quota": cpu_quota_cores()}


def memory_facts() -> dict:
    """The memory the server sizes its CPU model calls by (``usable``, bytes): the RAM,
    capped by a memory limit (a container's)."""
    return {"usable": available_memory(), "limit": memory_limit_bytes()}


def collect(probe: bool = True) -> dict:
    """Gather facts cheaply: import only what is needed to report it."""
    import torch

    facts: dict = {
        "vqserve": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": importlib.metadata.version("grpcio"),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu_threads": torch.get_num_threads(),
        "cores": cores_facts(),
        "memory": memory_facts(),
    }
    runtimes = {"eager": True, "torchscript": True, "pt2": hasattr(torch, "export")}
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime

        facts["onnxruntime"] = onnxruntime.__version__
        facts["onnxruntime_providers"] = onnxruntime.get_available_providers()
        runtimes["onnx"] = True
    else:
        runtimes["onnx"] = False
    facts["runtimes"] = runtimes
    facts["low_precision"] = low_precision_facts(probe)
    try:
        from vqserve.model.checkpoint import PACKAGED_MODELS, packaged_model_available

        facts["default_tokenizer"] = packaged_model_available("default")
        # the names --model takes besides paths, where their weights are in this install
        facts["shipped_tokenizers"] = [n for n in PACKAGED_MODELS if packaged_model_available(n)]
    except ImportError:
        facts["default_tokenizer"] = False
        facts["shipped_tokenizers"] = []
    return facts


def describe_dtype(result: dict | None, flags: list[str] | None) -> str:
    """One table cell: whether the dtype ran, its speed relative to fp32, the CPU flags."""
    if result is None:
        text = "not measured (--no-probe)"
    elif not result["runs"]:
        text = f"no ({result['error']})"
    else:
        ratio = result["speed_vs_fp32"]
        verdict = "faster than" if ratio >= 1.2 else "about as fast as" if ratio > 0.8 else \
            "slower than"
        size = ("a matmul + conv" if result.get("workload", "full") == "full" else
                f"a {PILOT_SCALE}x smaller matmul + conv; too slow to time at full size")
        text = f"yes, {verdict} fp32 ({ratio:.{2 if ratio >= 0.1 else 3}f}x its speed on {size})"
    if flags is not None:
        text += f"; native CPU support: {', '.join(flags) if flags else 'none found'}"
    return text


def _rows(facts: dict) -> list[tuple[str, str]]:
    rows = []
    for key, value in facts.items():
        if key == "low_precision":
            for device, found in value.items():
                flags = found.get("native_flags", {})
                for name in LOW_PRECISION:
                    rows.append((f"{name} {device}", describe_dtype(
                        found.get(name), flags.get(name) if device == "cpu" else None)))
            continue
        if key == "cores":
            value = (f"{value['usable']} usable (affinity mask {value['affinity_mask']}, CPU quota "
                     f"{value['cpu_quota'] or 'none'})")
        elif key == "memory":
            limit = f"{value['limit'] / 2**30:.1f} GiB" if value["limit"] else "none"
            value = f"{value['usable'] / 2**30:.1f} GiB usable (memory limit {limit})"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "none"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        rows.append((key, str(value)))
    return rows


def run(args: argparse.Namespace) -> int:
    facts = collect(probe=args.probe)
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    rows = _rows(facts)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
