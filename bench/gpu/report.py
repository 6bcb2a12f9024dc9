"""The table ``vqserve bench gpu`` prints: served / in-process at each dtype's best batch.

:func:`report` turns a result (a finished run, or a stored ``--json`` file read again with
``--report``) into the one table, the figures beside it and the targets, met or missed.
"""

from __future__ import annotations

from vqserve.bench.gpu.targets import best_in_process, row_method, targets, unmeasured_targets
from vqserve.bench.load import CALL_COLUMNS, call_columns, mean_text
from vqserve.bench.profiling import brief


def call_against_in_process(row: dict) -> float | None:
    """A served model call's mean time over one lone in-process call of its micro-batch
    (``call/in``): about 1 with ``busy`` under 1 is a device left idle between calls; well
    above 1 is calls slowed by the serving around them (or two calls sharing the device)."""
    if row.get("ms_per_call") is None or not row.get("in_process_call_ms"):
        return None
    return row["ms_per_call"] / row["in_process_call_ms"]


# the sections of a run, as their keys in the JSON; those of a CUDA device only second
SECTIONS = (("tokens", "1. tokens against CPU fp32"), ("in_process", "2. in-process images/s"),
            ("decode_in_process", "2c. in-process decode images/s"), ("served", "3. served"),
            ("tokenize", "4. tokenize end to end"))
CUDA_SECTIONS = (("noise", "1b. fp32 noise"), ("cuda_graphs", "2b. CUDA graphs"))


def not_measured(result: dict) -> list[str]:
    """The sections a run left without a figure: a run stopped at its time limit (its JSON
    is saved section by section, ``complete`` false) or a section turned off."""
    sections = SECTIONS + (CUDA_SECTIONS if str(result.get("device", "")).startswith("cuda") else ())
    return [title for key, title in sections if not result.get(key)]


def report(result: dict) -> str:
    """One table: served / in-process at the dtype's best batch, per layout and case. A run
    stopped before its end prints what it finished and names the rest "not measured"."""
    took = (f"{result['seconds']:.0f} s" if "seconds" in result else
            "STOPPED before its end" if result.get("complete") is False else "time not recorded")
    lines = [f"\n== vqserve bench gpu: {result.get('model', '?')} on {result.get('gpu', result.get('device', '?'))}, "
             f"{result.get('size', '?')}², {result.get('cpu_cores', '?')} CPUs, {took} =="]
    for row in result.get("tokens", []):
        if "error" in row:
            lines.append(f"tokens {row['precision']:<5} error: {row['error']}")
            continue
        lines.append(f"tokens {row['precision']:<5} {100 * row['agree_cpu_fp32']:8.3f} % equal to CPU fp32, "
                     f"{row['photos_identical']}/{row['photos']} photos identical, batch-invariant "
                     f"{'yes' if row['batch_invariant'] else 'NO'}, buckets equal to calls of 64 "
                     f"{ {True: 'yes', False: 'NO'}.get(row.get('buckets_equal'), '?') }")
    noise = result.get("noise")
    if noise:
        lines.append(f"fp32 noise: {noise['differing']} of {noise['tokens']:,} tokens differ from CPU fp32 "
                     f"({noise['rate']:.1e}) in {noise['images_differing']} of {noise['tiles']} photo crops; "
                     f"{noise['ties']} fp32 ties, {noise['not_ties']} not")
    for row in result.get("cuda_graphs", []):
        if "error" in row:
            lines.append(f"cuda graphs {row['dtype']}: error {row['error'][-200:]}")
            continue
        speeds = ", ".join(f"batch {r['batch']} x{r['ratio']:.2f}" for r in row.get("rows", []))
        lines.append(f"cuda graphs {row['dtype']}: tokens {'= eager' if row.get('tokens_equal') else 'DIFFER'}"
                     f", pixels {({True: '= eager', False: 'DIFFER'}).get(row.get('pixels_equal'), '-')}"
                     f"; graphs / eager img/s: {speeds}")
    best = {}
    for row in result.get("in_process", []):
        if row["dtype"] not in best or row["throughput"] > best[row["dtype"]]["throughput"]:
            best[row["dtype"]] = row
    for dtype, row in best.items():
        tf = f", {row['tflops']:.1f} TFLOP/s" if row.get("tflops") else ""
        lines.append(f"in-process {dtype}: best {row['throughput']:.0f} img/s at batch {row['batch']}{tf}")
    lines += decode_lines(result)
    for row in result.get("plans", []):
        lines.append(f"plan {row['dtype']} (vqserve plan, served as 'planned'): "
                     f"{row.get('line') or 'error ' + str(row.get('error'))[-200:]}")
    in_process = best_in_process(result)
    lines.append(f"{'served':<8}{'layout':<16}{'case':<16}{'callers':<10}{'img/s':>9}{'/in-proc':>10}{'p99 ms':>9}{'CPU µs/img':>12}"
                 f"{CALL_COLUMNS}{'call/in':>9}")
    for row in result.get("served", []):
        if "error" in row:
            lines.append(f"{row['dtype']:<8}{row['layout']:<16}error: {row['error'][-200:]}")
            continue
        top = in_process.get((row["dtype"], row_method(row)))
        ratio = row["throughput"] / top if top else float("nan")  # decode rows: against in-process decode
        same = {True: "  tokens = in-process", False: "  TOKENS DIFFER"}.get(row.get("tokens_equal_in_process"), "")
        lines.append(f"{row['dtype']:<8}{row['layout']:<16}{row['case']:<16}{row.get('caller_kind', '-'):<10}"
                     f"{row['throughput']:9.0f}{ratio:10.2f}"
                     f"{row['p99_ms']:9.1f}{row['server_cpu_us_per_image'] or 0:12.0f}"
                     f"{call_columns(row)}{mean_text(call_against_in_process(row), 2):>9}{same}")
    for row in result.get("served", []):
        profile = row.get("profile")
        if not profile:
            continue
        alone = profile.get("executor_alone") or {}
        vs_in = (f" ({alone['throughput'] / best[row['dtype']]['throughput']:.2f} of in-process)"
                 if alone.get("throughput") and row["dtype"] in best else "")
        lines.append(f"profiled {row['dtype']} {row['layout']} {row['case']}: "
                     + (f"the executor alone (no gRPC) {alone['throughput']:.0f} img/s{vs_in}; " if alone else "")
                     + brief(profile))
    for row in result.get("tokenize", []):
        if "error" in row:
            lines.append(f"tokenize {row['dtype']}{' (CUDA graphs)' if row.get('cuda_graphs') else ''}: error {row['error'][-300:]}")
            continue
        before = row.get("before") or {}
        lines.append(f"tokenize {row['dtype']}{' (CUDA graphs)' if row.get('cuda_graphs') else ''}: end to end {row['end_to_end_images_per_s']:.0f} img/s, raw "
                     f"{row['raw_images_per_s']:.0f}, ratio {row['ratio_median']:.2f}; decode capacity "
                     f"{row.get('decode_capacity_images_per_s', 0):.0f} img/s, e2e / min(raw, decode) "
                     f"{row.get('ratio_to_bound_median', 0):.2f} ({row.get('bottleneck')}-bound); steady "
                     f"{_figure(row.get('steady_images_per_s'), '.0f')} img/s "
                     f"({_figure(row.get('steady_ratio_to_bound_median'), '.2f')} of the bound), first tokens "
                     f"after {_figure(row.get('first_tokens_s'), '.1f')} s; main process "
                     f"{row.get('main_cpu_us_per_image', 0):.0f} µs CPU/img"
                     + (f"; before (serial engine) {before.get('end_to_end_images_per_s', 0):.0f} img/s"
                        if before else ""))
    for title in not_measured(result):
        lines.append(f"{title}: not measured")
    verdicts, unmeasured = targets(result), unmeasured_targets(result)
    if verdicts or unmeasured:
        lines.append("targets:")
    lines += [f"  {'met   ' if v['met'] else 'MISSED'} {v['target']}: {v['measured']}" for v in verdicts]
    lines += [f"  not measured: {what}" for what in unmeasured]
    for row in result.get("failed", []):
        lines.append(f"FAILED {row['section']}: {row['error'][-300:]}")
    return "\n".join(lines)


def _figure(value, spec: str) -> str:
    """A figure, or "-" where a run too short to show it left none (None or NaN)."""
    return "-" if value is None or value != value else format(value, spec)


def decode_lines(result: dict) -> list[str]:
    """Section 2c: in-process decode images/s per dtype at its best batch (the ceiling the
    served decode rows are read against)."""
    lines = []
    tops: dict[str, dict] = {}
    for row in result.get("decode_in_process") or []:
        if "error" in row:
            lines.append(f"in-process decode {row['dtype']}: error {row['error'][-200:]}")
        elif row["dtype"] not in tops or row["throughput"] > tops[row["dtype"]]["throughput"]:
            tops[row["dtype"]] = row
    for dtype, row in tops.items():
        lines.append(f"in-process decode {dtype}: best {row['throughput']:.0f} img/s at batch {row['batch']}")
    return lines
