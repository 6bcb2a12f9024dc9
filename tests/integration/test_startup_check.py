"""No silent start: a real server says what its start-up check does (log lines, health's
``vqserve-step`` message while NOT_SERVING), keeps a passed check beside the plan cache, and a
restart with the same model, runtime, plan, machine and software serves without checking
again; another model or another plan checks again (issue: first start of a large model)."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.conftest import make_tokenizer
from vqserve.model import save_tokenizer
from vqserve.serve.clients import TokenizerClient
from vqserve.serve.clients.channel import health_detail
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread


class Events(logging.Handler):
    """The serving log's events, as the JSON lines carry them (event name and fields)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"msg": record.getMessage(), **(getattr(record, "fields", {}) or {})})

    def named(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("event") == name]


@pytest.fixture
def events():
    handler = Events()
    logger = logging.getLogger("vqserve.serve")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def config(**kw) -> ServerConfig:
    base = dict(backend="eager", device="cpu", host="127.0.0.1", port=0, metrics_port=-1, grace_s=5,
                plan="default")
    return ServerConfig(**{**base, **kw})


def serve_once(cfg: ServerConfig) -> str:
    """Start, wait until SERVING, read the certificate clients see, stop."""
    with ServerThread(cfg).start() as srv:
        return TokenizerClient(srv.target).model_info()["determinism"]


def test_health_names_the_check_while_it_runs(events, tmp_path):
    """While the check runs, health says NOT_SERVING and what runs, how far, the time left and
    how to skip it; once SERVING it says nothing more."""
    # the stand-in accelerator: ~20 ms of simulated device time per 64x64 image, so the check
    # lasts a moment on any machine, however fast
    srv = ServerThread(config(model="synthetic:300000", device="auto", backend="auto",
                              plan_cache=str(tmp_path))).start(wait_loaded=False)
    seen, stop = [], threading.Event()
    try:
        while not stop.is_set():
            status, step = health_detail(srv.target, timeout=30)
            seen.append((status, step))
            if status == "SERVING":
                break
    finally:
        srv.stop()
    checking = [step for status, step in seen if status == "NOT_SERVING" and step and "start-up check" in step]
    assert checking, f"health never named the check: {seen[:5]}...{seen[-3:]}"
    assert any("left" in step and "--no-self-check" in step and "images" in step for step in checking)
    assert seen[-1] == ("SERVING", None)
    lines = events.named("self_check_progress")
    assert lines and lines[0]["step"].startswith("each image alone") and lines[-1]["step"] == "done"
    assert all({"done", "total", "elapsed_s", "eta_s"} <= set(line) for line in lines)


def test_a_restart_reuses_the_certificate_and_a_changed_key_checks_again(events, tmp_path, tiny_checkpoint):
    cache = str(tmp_path / "plans")
    first = serve_once(config(model=tiny_checkpoint, plan_cache=cache))
    assert events.named("self_check_progress") and events.named("self_check_kept")
    assert not events.named("self_check_reused")
    kept = events.named("self_check_kept")[0]["file"]

    events.records.clear()
    again = serve_once(config(model=tiny_checkpoint, plan_cache=cache))
    reused = events.named("self_check_reused")
    assert len(reused) == 1 and reused[0]["file"] == kept and reused[0]["checked_at"]
    assert not events.named("self_check_progress")  # not run again
    assert again == first  # the same certificate, the same meaning

    other = tmp_path / "other-model"
    save_tokenizer(make_tokenizer(seed=1), other)  # another model file: another hash
    events.records.clear()
    serve_once(config(model=str(other), plan_cache=cache))
    assert events.named("self_check_progress") and not events.named("self_check_reused")

    events.records.clear()
    serve_once(config(model=tiny_checkpoint, plan_cache=cache, micro_batch=2))  # another plan (CPU: 1)
    assert events.named("self_check_progress") and not events.named("self_check_reused")
    assert events.named("self_check_again")[0]["changed"] == ["plan.micro_batch"]  # and the log says why

    events.records.clear()
    serve_once(config(model=tiny_checkpoint, plan_cache=cache, self_check=False))  # asked for no check
    assert not events.named("self_check_progress") and not events.named("self_check_reused")


def test_a_runtime_handed_in_is_always_checked(events, tmp_path, tiny_checkpoint):
    """A ready-made runtime may be anything under a known model hash: never a stored certificate."""
    from vqserve.export.runtimes.loader import EagerRuntime

    cache = str(tmp_path / "plans")
    serve_once(config(model=tiny_checkpoint, plan_cache=cache))
    events.records.clear()
    with ServerThread(config(model=tiny_checkpoint, plan_cache=cache),
                      runtime=EagerRuntime(tiny_checkpoint, device="cpu")).start():
        pass
    assert events.named("self_check_progress") and not events.named("self_check_reused")


def test_a_plan_file_carries_its_certificate_to_a_machine_of_the_same_kind(events, tmp_path, tiny_checkpoint):
    """`vqserve plan --out` writes the chosen plan's certificate into the file; a server of the
    same machine kind and software serving by that file (with an empty plan cache of its own)
    reuses it, and a certificate made under another key (another torch) is not taken."""
    import copy
    import json

    from vqserve.export.plan import PlanChoice
    from vqserve.export.runtimes.execution import default_plan
    from vqserve.export.runtimes.loader import model_hash_of

    serve_once(config(model=tiny_checkpoint, plan_cache=str(tmp_path / "here")))
    record = json.loads(next((tmp_path / "here" / "certificates").glob("certificate-*.json")).read_text())
    plan = default_plan("cpu")
    assert record["key"]["plan"] == plan.to_dict()

    def plan_file(name: str, records: list) -> str:
        choice = PlanChoice("fp32", plan, "file", None, {"backend": "eager", "dtype": "fp32", "exact": True,
                                                         "plan": plan.to_dict(), "device": {"device": "cpu"},
                                                         "certificates": records}, model_hash_of(tiny_checkpoint))
        return str(choice.to_file(tmp_path / name))

    events.records.clear()
    serve_once(config(model=tiny_checkpoint, plan=plan_file("plan.json", [record]),
                      plan_cache=str(tmp_path / "fleet-1")))
    reused = events.named("self_check_reused")
    assert len(reused) == 1 and reused[0]["file"] == "the plan file" and not events.named("self_check_progress")

    other = copy.deepcopy(record)
    other["key"]["machine"]["versions"]["torch"] = "0.0.1"
    events.records.clear()
    serve_once(config(model=tiny_checkpoint, plan=plan_file("other.json", [other]),
                      plan_cache=str(tmp_path / "fleet-2")))
    assert events.named("self_check_progress") and not events.named("self_check_reused")
