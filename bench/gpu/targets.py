"""The GPU node's targets, judged from a ``vqserve bench gpu`` result alone.

:func:`targets` reads only the JSON a run writes, so a stored run (``--report``) is judged
again the same way it was when measured.
"""

from __future__ import annotations

# the GPU node's targets: served / in-process at the dtype's best batch (exact fp32 and bf16),
# JPEG / raw requests, p99 of 1-image calls at 64 clients (the first H200 measurement, 97-138 ms)
SERVED_TARGETS = {"fp32": 0.9, "bf16": 0.8}
JPEG_TARGET = 0.7
P99_MS_TARGET = 138.0


def targets(result: dict) -> list[dict]:
    """Each target the run measured: ``target`` (what is asked), ``measured`` (the figure and
    where it came from: the best layout for a served ratio) and ``met`` (bool). Computed
    from the JSON alone, so a stored run can be read again the same way."""
    out: list[dict] = []

    def add(target: str, value: float | None, met: bool | None, where: str = "", spec: str = ".2f") -> None:
        if met is not None:
            out.append({"target": target, "value": value, "met": met,
                        "measured": (format(value, spec) if isinstance(value, float) else str(value))
                        + (f" ({where})" if where else "")})

    for row in result.get("tokens", []):
        if "error" in row:
            continue
        if row["precision"] == "fp32":
            add("fp32 tokens identical to CPU fp32", row["agree_cpu_fp32"], row["agree_cpu_fp32"] == 1.0,
                f"{row['photos_identical']}/{row['photos']} photos", ".6f")
        elif row["precision"] in ("bf16", "fp16"):
            add(f"{row['precision']} tokens batch-invariant", row["batch_invariant"], bool(row["batch_invariant"]))
    best_in = {}
    for row in result.get("in_process", []):
        best_in[row["dtype"]] = max(best_in.get(row["dtype"], 0.0), row["throughput"])
    served = [r for r in result.get("served", []) if "error" not in r]
    by_point: dict[tuple, list[dict]] = {}
    for row in served:
        by_point.setdefault((row["dtype"], row["case"], row.get("caller_kind")), []).append(row)
    for (dtype, case, kind), rows in by_point.items():
        top = max(rows, key=lambda r: r["throughput"])
        want = SERVED_TARGETS.get(dtype)
        if want is not None and best_in.get(dtype) and case.endswith(("x1", "x16")) and "jpeg" not in case:
            ratio = top["throughput"] / best_in[dtype]
            add(f"{dtype} {case} served / in-process >= {want}", ratio, ratio >= want,
                f"{top['layout']}, {top['throughput']:.0f} of {best_in[dtype]:.0f} img/s", ".3f")
        if case.endswith(" x1"):
            clients = top.get("procs", 0) * (top.get("callers") or top.get("threads") or 0)
            add(f"{dtype} {case} p99 at {clients} clients <= {P99_MS_TARGET:.0f} ms", top["p99_ms"],
                top["p99_ms"] <= P99_MS_TARGET, top["layout"], ".0f")
        if "jpeg" in case.split():
            raw = by_point.get((dtype, case.replace("jpeg", "raw"), kind))
            if raw:
                ratio = top["throughput"] / max(r["throughput"] for r in raw)
                add(f"{dtype} {case} / raw >= {JPEG_TARGET}", ratio, ratio >= JPEG_TARGET, top["layout"], ".3f")
    changed = [f"{r['dtype']} {r['layout']} {r['case']}" for r in served if r.get("tokens_equal_in_process") is False]
    checked = [r for r in served if r.get("tokens_equal_in_process") is not None]
    if checked:
        add("served tokens = the same plan in-process", f"{len(checked) - len(changed)}/{len(checked)} rows",
            not changed, ", ".join(changed[:3]))
    return out
