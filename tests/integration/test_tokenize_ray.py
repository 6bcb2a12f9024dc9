"""`vqserve tokenize --engine ray`: a real local Ray (no mocks) writes byte-identical shards,
manifest and error log to the local engine's, and resumes shard by shard."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import folder_bytes, stop_after_first_shard
from vqserve.cli import main

ray = pytest.importorskip("ray")
# one local Ray at a time (make test runs two pytest workers): the Ray tests share one worker
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("ray"),
              pytest.mark.filterwarnings(r"ignore::DeprecationWarning:ray\..*")]

SIZES = ((40, 48), (48, 40), (32, 32), (56, 64), (64, 56), (33, 47), (48, 48), (40, 64))


RAY_START_ATTEMPTS = 3


def _ray_start_report() -> str:
    """What a failed start left behind: the load, and the last lines of the GCS and raylet
    logs of the newest session (CI saw both a raylet and a GCS miss their start-up waits
    on a loaded 2-core box, with nothing else to go on)."""
    import glob
    import os

    lines = [f"load average {os.getloadavg()}"]
    for log in sorted(glob.glob("/tmp/ray/session_latest/logs/*")):
        if os.path.basename(log).startswith(("gcs_server", "raylet")) and os.path.isfile(log):
            with open(log, errors="replace") as f:
                tail = f.readlines()[-8:]
            lines += [f"--- {log}"] + [line.rstrip() for line in tail]
    return "\n".join(lines)


def _kill_ray_children() -> None:
    """A start that timed out can leave its GCS or raylet running, competing with the next
    try for the same two cores: end this process's own Ray children (and nothing else)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if any(name in " ".join(child.cmdline()) for name in ("gcs_server", "raylet", "ray/")):
                child.kill()
        except psutil.Error:
            pass


def _give_ray_time_to_start() -> None:
    """Longer start-up waits for a local Ray (this process's, and those of the processes it
    starts): on a loaded 2-core CI box its raylet and its GCS have missed Ray's defaults."""
    import os

    os.environ.setdefault("RAY_raylet_start_wait_time_s", "90")
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "90")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray. On a loaded 2-core CI box its raylet (and once, on the retry, its GCS)
    has missed Ray's start-up waits: wait longer, clear what a failed try left, try again,
    and fail with the logs that say why."""
    _give_ray_time_to_start()
    reports = []
    for attempt in range(RAY_START_ATTEMPTS):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:
            reports.append(f"try {attempt + 1}: {exc}\n{_ray_start_report()}")
            ray.shutdown()
            _kill_ray_children()
    else:
        pytest.fail("a local Ray did not start:\n" + "\n".join(reports))
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def photos_dir(tmp_path_factory) -> Path:
    """8 crops of the scikit-image photos (PNG and JPEG, 32-64 px) and one corrupt file."""
    from skimage import data

    folder = tmp_path_factory.mktemp("photos")
    srcs = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    for i, (h, w) in enumerate(SIZES):
        src = srcs[i % len(srcs)]
        px = np.ascontiguousarray(src[10 * i:10 * i + h, 20 * i:20 * i + w, :3])
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="PNG" if i % 3 else "JPEG")
        (folder / f"img{i}.{'png' if i % 3 else 'jpg'}").write_bytes(buf.getvalue())
    (folder / "img3x.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")  # sorts 5th
    return folder


def tokenize(photos: Path, out: Path, model: str, engine: str, *extra: str) -> int:
    return main(["tokenize", str(photos), "--out", str(out), "--model", model, "--device", "cpu",
                 "--shard-size", "3", "--batch-size", "2", "--engine", engine, "--workers", "0",
                 "--ray-actors", "1", "--no-progress", *extra])


@pytest.mark.parametrize("size", [["--size", "32"], ["--keep-size"]], ids=["size32", "keep"])
def test_ray_equals_local_and_resumes(ray_local, photos_dir, tiny_checkpoint, tmp_path, size):
    local, dist = tmp_path / "local", tmp_path / "ray"
    assert tokenize(photos_dir, local, tiny_checkpoint, "local", *size) == 0
    assert tokenize(photos_dir, dist, tiny_checkpoint, "ray", *size) == 0
    want = folder_bytes(local)
    # 9 images in shards of 3, tasks of 2 + 1: several shards, a partial last task, one error
    assert sorted(want) == ["__vqserve__/errors.jsonl", "__vqserve__/manifest.json", "shard-000000.parquet",
                            "shard-000001.parquet", "shard-000002.parquet"]
    errors = want["__vqserve__/errors.jsonl"]
    assert errors.count(b"\n") == 1 and b"img3x" in errors
    assert folder_bytes(dist) == want

    # resume on Ray: only the missing shard is redone, and the folder is byte-identical again
    (dist / "shard-000001.parquet").unlink()
    kept = {n: (dist / n).stat().st_mtime_ns for n in ("shard-000000.parquet", "shard-000002.parquet")}
    assert tokenize(photos_dir, dist, tiny_checkpoint, "ray", *size) == 0
    assert {n: (dist / n).stat().st_mtime_ns for n in kept} == kept
    assert folder_bytes(dist) == want


def test_ray_fail_fast_and_actor_refusal(ray_local, photos_dir, tiny_checkpoint, tmp_path, capsys):
    # every CPU of the cluster (2) held by an actor would leave none to decode: refused up front
    assert tokenize(photos_dir, tmp_path / "a", tiny_checkpoint, "ray", "--size", "32",
                    "--ray-actors", "2") == 2
    assert "leave none for decoding" in capsys.readouterr().err
    assert tokenize(photos_dir, tmp_path / "b", tiny_checkpoint, "ray", "--size", "32",
                    "--fail-fast") == 1
    err = capsys.readouterr().err
    assert "img3x.png" in err and "(--fail-fast)" in err
    assert not (tmp_path / "b" / "__vqserve__" / "errors.jsonl").exists()


def test_ray_runs_the_drivers_plan_and_either_engine_resumes_the_other(ray_local, photos_dir, tiny_checkpoint,
                                                                      tmp_path):
    """Was: the local engine followed the plan (an export) while the Ray actors ran eager, so
    every shard and the manifest differed and neither could resume the other's run."""
    import json

    from tests.helpers import export_plan_file

    plan, _ = export_plan_file(tiny_checkpoint, tmp_path / "plan")
    local, dist = tmp_path / "local", tmp_path / "ray"
    args = ("--size", "32", "--plan", plan)
    assert tokenize(photos_dir, local, tiny_checkpoint, "local", *args) == 0
    assert tokenize(photos_dir, dist, tiny_checkpoint, "ray", *args) == 0
    want = folder_bytes(local)
    assert json.loads(want["__vqserve__/manifest.json"])["model"]["backend"] == "torchscript", "the plan's backend ran"
    assert folder_bytes(dist) == want
    (dist / "shard-000001.parquet").unlink()  # a Ray run finished by the local engine
    assert tokenize(photos_dir, dist, tiny_checkpoint, "local", *args) == 0
    assert folder_bytes(dist) == want
    (local / "shard-000000.parquet").unlink()  # and a local run finished on Ray
    assert tokenize(photos_dir, local, tiny_checkpoint, "ray", *args) == 0
    assert folder_bytes(local) == want


_SIGTERM_IN_SHUTDOWN = """
import os, signal, sys
import ray
real_shutdown = ray.shutdown
def shutdown(*args, **kwargs):  # a scheduler's SIGTERM lands as the run shuts Ray down
    os.kill(os.getpid(), signal.SIGTERM)
    real_shutdown(*args, **kwargs)
    print("ray shut down whole", file=sys.stderr, flush=True)
ray.shutdown = shutdown
from vqserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_in_rays_shutdown_exits_143_with_ray_shut_down(photos_dir, tiny_checkpoint, tmp_path):
    """Regression: a SIGTERM that landed near the end of a Ray run, while the driver shut Ray
    down, broke the shutdown and the run exited 1 ("The core worker has already been
    shutdown") instead of 143. The clean-up now runs with the signal deferred: Ray shuts
    down whole, then the run stops as Ctrl-C stops it. Made certain here by sending the
    signal from inside ``ray.shutdown``."""
    import subprocess
    import sys

    out = tmp_path / "out"
    args = ["tokenize", str(photos_dir), "--out", str(out), "--model", tiny_checkpoint, "--device", "cpu",
            "--size", "32", "--shard-size", "4", "--engine", "ray", "--workers", "0", "--ray-actors", "1",
            "--no-progress"]
    _give_ray_time_to_start()
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_IN_SHUTDOWN, *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "ray shut down whole" in proc.stderr
    assert "terminated (SIGTERM):" in proc.stderr and "run the same command again to resume" in proc.stderr
    assert "core worker" not in proc.stderr


def test_sigterm_stops_a_ray_run_as_ctrl_c_does(photos_dir, tiny_checkpoint, tmp_path):
    """``ray.init`` replaced the SIGTERM handler: a scheduler's SIGTERM ended the driver with
    Ray's fault log and exit status 15, in the middle of a shard. The driver now takes the
    signal back: exit 143 and the resume hint, as with Ctrl-C. A separate process starts its
    own local Ray here (the module's Ray, already running, would not call ``ray.init``)."""
    import signal
    import sys

    out = tmp_path / "out"
    args = [sys.executable, "-m", "vqserve.cli", "tokenize", str(photos_dir), "--out", str(out), "--model",
            tiny_checkpoint, "--device", "cpu", "--size", "32", "--shard-size", "1", "--batch-size", "1",
            "--engine", "ray", "--workers", "0", "--ray-actors", "1", "--no-progress"]
    _give_ray_time_to_start()  # as the module's own Ray (ray_local)
    code, err = stop_after_first_shard(args, out, signal.SIGTERM, wait_s=600)
    if code == 0:
        pytest.skip("the run ended before the signal (nothing to stop)")
    assert code == 143, err
    assert "terminated (SIGTERM):" in err and "run the same command again to resume" in err, err
