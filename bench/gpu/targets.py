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
# decode (issue 54): served decode / in-process decode at its best batch, PNG replies / raw replies
DECODE_TARGET = 0.8
PNG_TARGET = 0.7


def row_method(row: dict) -> str:
    """``decode`` for a served row of a decode case (payload ``decode`` or ``decode-png``),
    else ``encode`` (``raw``, ``jpeg``; runs before decode cases existed)."""
    return "decode" if str(row.get("payload", "")).startswith("decode") else "encode"


def best_in_process(result: dict) -> dict[tuple[str, str], float]:
    """{(dtype, "encode" | "decode"): the best in-process images/s over the batches}."""
    best: dict[tuple[str, str], float] = {}
    for method, key in (("encode", "in_process"), ("decode", "decode_in_process")):
        for row in result.get(key) or []:
            if "error" not in row:
                best[(row["dtype"], method)] = max(best.get((row["dtype"], method), 0.0), row["throughput"])
    return best


def unmeasured_targets(result: dict) -> list[str]:
    """The targets a run could not judge, for want of the figures (a run stopped early, or
    a section or case left out), in words."""
    out = []
    best = best_in_process(result)
    served = [r for r in result.get("served") or [] if "error" not in r and r.get("calls", 1) > 0]
    idle = [f"{r['dtype']} {r['layout']} {r['case']}" for r in result.get("served") or [] if r.get("calls", 1) == 0]
    if idle:  # clients slower to start than the window: nothing was measured there
        out.append(f"{len(idle)} served rows in which no call finished ({', '.join(idle[:3])}"
                   + (", ..." if len(idle) > 3 else "") + ")")
    if not result.get("tokens"):
        out.append("tokens identical to CPU fp32 / batch-invariant (section 1)")
    for method, section in (("encode", "2"), ("decode", "2c")):
        if not any(m == method for _, m in best):
            out.append(f"served {method} / in-process {method} (section {section}, in-process, not measured)")
        elif not any(row_method(r) == method for r in served):
            out.append(f"served {method} / in-process {method} (section 3, served {method}, not measured)")
    if not any(r.get("payload") == "decode-png" for r in served):
        out.append(f"decode PNG replies / raw replies >= {PNG_TARGET} (no served decode-png case)")
    return out


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
    best = best_in_process(result)
    best_in = {dtype: rate for (dtype, method), rate in best.items() if method == "encode"}
    served = [r for r in result.get("served") or [] if "error" not in r and r.get("calls", 1) > 0]
    by_point: dict[tuple, list[dict]] = {}
    for row in served:
        by_point.setdefault((row["dtype"], row["case"], row.get("caller_kind")), []).append(row)
    for (dtype, case, kind), rows in by_point.items():
        top = max(rows, key=lambda r: r["throughput"])
        if row_method(top) == "decode":
            decode_targets(add, top, best.get((dtype, "decode")), by_point.get((dtype, case.replace("decode-png", "decode"), kind)))
            continue
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
            if raw and max(r["throughput"] for r in raw) > 0:  # a row with no call judges nothing
                ratio = top["throughput"] / max(r["throughput"] for r in raw)
                add(f"{dtype} {case} / raw >= {JPEG_TARGET}", ratio, ratio >= JPEG_TARGET, top["layout"], ".3f")
    changed = [f"{r['dtype']} {r['layout']} {r['case']}" for r in served if r.get("tokens_equal_in_process") is False]
    checked = [r for r in served if r.get("tokens_equal_in_process") is not None]
    if checked:
        add("served tokens = the same plan in-process", f"{len(checked) - len(changed)}/{len(checked)} rows",
            not changed, ", ".join(changed[:3]))
    return out


def decode_targets(add, top: dict, best_decode: float | None, raw_rows: list[dict] | None) -> None:
    """A served decode case's targets: served / in-process decode at its best batch (raw
    replies) and PNG replies / raw replies (the same protocol and images per call)."""
    case, dtype = top["case"], top["dtype"]
    if top["payload"] == "decode" and best_decode:
        ratio = top["throughput"] / best_decode
        add(f"{dtype} {case} served / in-process decode >= {DECODE_TARGET}", ratio, ratio >= DECODE_TARGET,
            f"{top['layout']}, {top['throughput']:.0f} of {best_decode:.0f} img/s", ".3f")
    if top["payload"] == "decode-png" and raw_rows and max(r["throughput"] for r in raw_rows) > 0:
        ratio = top["throughput"] / max(r["throughput"] for r in raw_rows)
        add(f"{dtype} {case} / raw replies >= {PNG_TARGET}", ratio, ratio >= PNG_TARGET, top["layout"], ".3f")
