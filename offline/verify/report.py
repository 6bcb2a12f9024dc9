"""The report of ``vqserve verify``: per-check counts, the first problems, and how it prints.

Every check of :mod:`vqserve.offline.verify` counts passed / failed / skipped units (shards
or rows) into one :class:`Report` and keeps the first few problems with their file and key;
:func:`format_summary` is what ``vqserve verify`` prints (``--json`` prints the dict itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vqserve.core.machine import machine_summary, same_arithmetic

CHECKS = ("manifest", "files", "sha256", "readable", "schema", "rows", "keys", "tokens", "grid",
          "reencode")


@dataclass
class Count:
    passed: int = 0
    failed: int = 0
    skipped: int = 0


@dataclass
class Report:
    """Per-check counts plus the first ``max_problems`` problems (all are counted)."""

    out_dir: str
    max_problems: int = 10
    checks: dict[str, Count] = field(default_factory=lambda: {c: Count() for c in CHECKS})
    problems: list[dict] = field(default_factory=list)
    problem_count: int = 0
    notes: list[str] = field(default_factory=list)
    sample: dict = field(default_factory=dict)
    ties: dict = field(default_factory=dict)
    machines: dict = field(default_factory=dict)

    def ok(self, check: str, n: int = 1) -> None:
        self.checks[check].passed += n

    def skip(self, check: str, n: int = 1) -> None:
        self.checks[check].skipped += n

    def fail(self, check: str, message: str, file: str | None = None, key: str | None = None) -> None:
        self.checks[check].failed += 1
        self.problem_count += 1
        if len(self.problems) < self.max_problems:
            self.problems.append({"check": check, "file": file, "key": key, "message": message})

    @property
    def passed(self) -> bool:
        return all(c.failed == 0 for c in self.checks.values())

    def to_dict(self) -> dict:
        return {"dir": self.out_dir, "ok": self.passed,
                "checks": {k: dataclasses.asdict(v) for k, v in self.checks.items()},
                "problem_count": self.problem_count, "problems": self.problems,
                "sample": self.sample, "ties": self.ties, "machines": self.machines, "notes": self.notes}


def format_summary(report: dict) -> str:
    """The human-readable form of :meth:`Report.to_dict` (what ``vqserve verify`` prints)."""
    status = "OK" if report["ok"] else f"FAILED ({report['problem_count']} problems)"
    lines = [f"verify {report['dir']}: {status}"]
    for name, c in report["checks"].items():
        if not (c["passed"] or c["failed"] or c["skipped"]):
            lines.append(f"  {name:<9} -     not checked")
            continue
        mark = "FAIL" if c["failed"] else "ok"
        extra = f", {c['skipped']} skipped" if c["skipped"] else ""
        lines.append(f"  {name:<9} {mark:<5} {c['passed']} passed, {c['failed']} failed{extra}")
    s = report["sample"]
    if s:
        lines.append(f"  sample: {s['selected']} of {s['rows']} rows (seed {s['seed']}): "
                     f"{s['matched']} re-encoded identically, {s.get('tied', 0)} identical but for fp32 ties, "
                     f"{s['mismatched']} differ, {s['skipped']} skipped (source unavailable)")
    lines += _ties_lines(report.get("ties") or {})
    lines += _machine_lines(report.get("machines") or {})
    lines += [f"  note: {n}" for n in report["notes"]]
    if report["problems"]:
        shown = len(report["problems"])
        lines.append(f"problems (first {shown} of {report['problem_count']}):")
        for p in report["problems"]:
            where = ":".join(x for x in (p["file"], f"key={p['key']!r}" if p["key"] is not None
                                         else None) if x)
            lines.append(f"  [{p['check']}] {where + ': ' if where else ''}{p['message']}")
    return "\n".join(lines)


def _ties_lines(ties: dict) -> list[str]:
    """The ties, one line each after a total: fp32 rounding noise, not corruption."""
    if not ties.get("count"):
        return []
    lines = [f"  ties: {ties['count']} of {ties['tokens']} re-encoded tokens ({ties['rate']:.2e}) differ "
             f"only where the fp64 latent lies within {ties['delta']:g} of the rounding boundary "
             "between the two codes (fp32 noise of two machines, not corruption)"]
    for t in ties["list"]:
        lines.append(f"    tie {t['file']}:key={t['key']!r} at {tuple(t['at'])}: recorded {t['recorded']}, "
                     f"re-encoded {t['fresh']}, fp64 margin {t['margin']:.2e}")
    if ties["count"] > len(ties["list"]):
        lines.append(f"    ... and {ties['count'] - len(ties['list'])} more")
    return lines


def _machine_lines(machines: dict) -> list[str]:
    """Both machines when the tokens were made on another one than re-encodes them here."""
    here, recorded = machines.get("here"), machines.get("recorded") or []
    if not here or not recorded or all(same_arithmetic(m, here) for m in recorded):
        return []
    return ([f"  tokens made on: {machine_summary(m)}" for m in recorded]
            + [f"  re-encoded on:  {machine_summary(here)}"])
