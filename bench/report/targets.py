"""The targets ``vqserve bench all`` judges, and the ratios they are judged on.

Each headline ratio (:func:`compute_ratios`) comes from the kept (best-round) rows at the
top client count; :func:`verdict` says whether its target was met, and by how much it was
missed; :func:`spread` measures how far a figure moved between rounds on this machine.
"""

from __future__ import annotations

import numpy as np

TARGETS = {  # ratio key -> (comparison, target, what it compares)
    "served_v1_vs_in_process": (">=", 0.9, "vqserve v1 / in-process throughput"),
    "served_oip_vs_in_process": (">=", 0.9, "vqserve OIP / in-process throughput"),
    "vqserve_vs_torchserve_throughput": (">=", 2.0, "vqserve v1 / TorchServe throughput"),
    "vqserve_vs_torchserve_p99": ("<=", 0.5, "vqserve v1 / TorchServe p99 latency"),
    "batching_on_vs_off": (">=", 3.0, "batching on / off throughput (docs/SERVING.md)"),
}

def _pick(rows: list[dict], mode: str, level: int) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r["level"] == level), None)


def compute_ratios(best: list[dict], memory: dict, top: int) -> dict:
    """Every headline ratio, from the kept (best-round) rows at ``top`` clients."""
    get = lambda mode: _pick(best, mode, top)  # noqa: E731
    ip, v1, oip, off, ts = (get(m) for m in ("in-process", "served-v1", "served-oip",
                                              "served-v1-no-batching", "torchserve"))
    ratios: dict[str, float | None] = dict.fromkeys(TARGETS)
    if ip and v1:
        ratios["served_v1_vs_in_process"] = v1["throughput"] / ip["throughput"]
    if ip and oip:
        ratios["served_oip_vs_in_process"] = oip["throughput"] / ip["throughput"]
    if v1 and off:
        ratios["batching_on_vs_off"] = v1["throughput"] / off["throughput"]
    if v1 and ts and ts["throughput"] > 0:
        ratios["vqserve_vs_torchserve_throughput"] = v1["throughput"] / ts["throughput"]
        ratios["vqserve_vs_torchserve_p99"] = v1["p99_ms"] / ts["p99_ms"]
        ratios["vqserve_vs_torchserve_p50"] = v1["p50_ms"] / ts["p50_ms"]
    if "vqserve" in memory and "torchserve" in memory:
        ratios["vqserve_vs_torchserve_peak_rss"] = (memory["vqserve"]["peak_mb"]
                                                    / memory["torchserve"]["peak_mb"])
    return ratios


def spread(rows: list[dict], key: tuple[str, ...], value: str) -> dict | None:
    """Round-to-round spread of ``value`` per point ((max - min) / max over the rounds of
    each ``key``), as median and max over the points: how noisy this machine was."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if value in r:
            groups.setdefault(tuple(r[k] for k in key), []).append(r[value])
    spreads = [(max(v) - min(v)) / max(v) for v in groups.values() if len(v) > 1 and max(v) > 0]
    if not spreads:
        return None
    return {"median": float(np.median(spreads)), "max": max(spreads), "points": len(spreads)}


def verdict(key: str, value: float | None) -> dict:
    """Met or missed, and by how much (absolute and relative to the target)."""
    op, target, what = TARGETS[key]
    if value is None:
        return {"key": key, "what": what, "target": f"{op} {target:g}", "value": None,
                "met": None, "text": "not measured"}
    met = value >= target if op == ">=" else value <= target
    if met:
        text = "met"
    elif op == ">=":
        text = f"missed: {_f(target - value, 3)} short ({100 * (1 - value / target):.1f}% below the target)"
    else:
        text = f"missed: {_f(value - target, 3)} over ({value / target:.2f}× the target)"
    return {"key": key, "what": what, "target": f"{op} {target:g}", "value": value, "met": met,
            "text": text}


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"
