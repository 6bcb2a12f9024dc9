"""The overlapped local engine of `vqserve tokenize` (offline/engine.py): decoded pixels
through shared memory, several devices, the writer thread, the closing line. Real worker
processes, real files (crops of whole scikit-image photographs, a truncated file and a
non-image among them), the simulated accelerator (`--model synthetic:N`); no timing limits:
only what the runs write and say."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import alive, child_pids, wait_until
from tests.integration.test_tokenize import photo_set, write_folder
from vqserve.cli import main
from vqserve.offline import engine, pipeline, shards
from vqserve.offline.job import Job, Settings
from vqserve.offline.tasks import decode_pool

pytestmark = pytest.mark.timeout(300)
MODEL = "synthetic:0"  # no simulated device time: the pipeline alone


def _shards_and_errors(out: Path) -> dict[str, bytes]:
    """Everything but the manifest, which records the device(s) a run used."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and p.name != "manifest.json"}


def _manifest(out: Path) -> dict:
    return json.loads((out / "__vqserve__" / "manifest.json").read_text())


def _tokenize(inputs: Path, out: Path, *flags: str, capsys=None) -> str:
    rc = main(["tokenize", str(inputs), "--out", str(out), "--model", MODEL, "--no-progress", *flags])
    err = capsys.readouterr().err if capsys else ""
    assert rc == 0, err
    return err


def _mixed_sizes(folder: Path, n: int) -> None:
    """Photo crops of several sizes (multiples of 8 and not), so a task holds several image
    shapes and --keep-size crops some."""
    folder.mkdir(parents=True)
    for i, px in enumerate(photo_set(n, seed=3, sizes=((40, 48), (64, 64), (43, 57), (96, 72), (40, 48)))):
        Image.fromarray(px).save(folder / f"m{i:03d}.png")
    (folder / "zz-truncated.png").write_bytes((folder / "m000.png").read_bytes()[:60])


def test_shared_memory_pipe_serial_and_two_devices_write_the_same_shards(tmp_path, capsys):
    write_folder(tmp_path / "in", 40)
    common = ["--size", "32", "--shard-size", "8", "--batch-size", "3"]
    ref = tmp_path / "serial-inline"
    _tokenize(tmp_path / "in", ref, *common, "--workers", "0", capsys=capsys)
    expected = _shards_and_errors(ref)
    assert len([k for k in expected if k.startswith("shard-")]) == 6
    assert b"decodable" in expected["__vqserve__/errors.jsonl"]  # bad images recorded, not fatal
    runs = {
        "shm, 2 workers": ["--workers", "2"],
        "serial engine, pickled through pipes": ["--workers", "1", "--serial-engine"],
        "two simulated devices": ["--workers", "1", "--device", "synthetic:0,1"],
        "two devices, inline decoding": ["--workers", "0", "--device", "synthetic:2,3"],
    }
    for name, flags in runs.items():
        out = tmp_path / name.replace(" ", "-").replace(",", "")
        _tokenize(tmp_path / "in", out, *common, *flags, capsys=capsys)
        assert _shards_and_errors(out) == expected, name
        manifest = _manifest(out)
        assert manifest["complete"] and manifest["shards"] == _manifest(ref)["shards"], name
    assert _manifest(tmp_path / "two-simulated-devices")["model"]["device"] == "synthetic:0,synthetic:1"
    # the token identity keeps the kind of device only: a one-device run resumes a two-device one
    assert _manifest(tmp_path / "two-simulated-devices")["identity"] == _manifest(ref)["identity"]


def test_several_shapes_per_task_and_images_too_large_for_a_slot(tmp_path, monkeypatch):
    """--keep-size: each task's images are grouped by shape in the slot; with slots too
    small for some groups those come back pickled. Same shards either way."""
    from vqserve.core import images
    from vqserve.export.runtimes.loader import load_runtime

    _mixed_sizes(tmp_path / "in", 23)
    runtime = load_runtime(MODEL, device="synthetic:0")
    info = {**runtime.info.to_dict(), "device": "synthetic:0"}
    settings = Settings(preprocess=images.Preprocess(mode="keep", factor=8), shard_size=10,
                        batch_size=5)

    def run(name: str, **kw) -> dict[str, bytes]:
        job = Job(inputs=[str(tmp_path / "in")], out=tmp_path / name, settings=settings,
                  runtime_info=info, model_ref=MODEL)
        job.prepare()
        result = pipeline.run_local(job, runtime, progress=False, **kw)
        assert result["manifest"]["totals"] == {"images": 24, "rows": 23, "errors": 1, "shards": 3}
        return _shards_and_errors(tmp_path / name)

    expected = run("serial", workers=0)
    assert run("shm", workers=1) == expected
    assert run("pipe", workers=1, use_shm=False) == expected
    monkeypatch.setattr(engine, "SLOT_IMAGE_BYTES", 40 * 48 * 3)  # the larger shapes miss the slot
    assert run("overflow", workers=2) == expected
    rows = [r for s in sorted((tmp_path / "shm").glob("shard-*")) for r in shards.read_rows(s)]
    assert {(r["height"], r["width"]) for r in rows} == {(40, 48), (64, 64), (40, 56), (96, 72)}


def test_steady_rate_leaves_out_start_up_and_the_drain():
    # 10 tasks of 100 images: 2 s before the first, then one every 0.1 s, then a slow last one
    stages = engine.Stages(marks=[(2.0 + 0.1 * i, 100 * (i + 1)) for i in range(9)] + [(5.0, 1000)])
    assert stages.first_s == 2.0
    assert stages.steady_rate == pytest.approx(1000.0)  # 100 images per 0.1 s, tasks 1..9 (10 % .. 90 %)
    assert engine.Stages(marks=[(1.0, 10), (2.0, 20)]).steady_rate is None  # too few tasks to tell
    assert engine.Stages().first_s is None


def test_closing_line_splits_the_time_and_names_the_bottleneck(tmp_path, capsys):
    write_folder(tmp_path / "in", 12, bad=False)
    err = _tokenize(tmp_path / "in", tmp_path / "out", "--size", "32", "--workers", "1", capsys=capsys)
    line = next(x for x in err.splitlines() if x.startswith("tokenize: time:"))
    assert re.search(r"decode \d+% \(1 workers, [\d,]+ img/s capacity\), device \d+% \(synthetic:0\), "
                     r"write \d+%, first tokens after [\d.]+ s; main process \d+ µs CPU/image; (decode|device|write|pipeline|start-up)-bound: ",
                     line), line


def test_bottleneck_and_advice():
    def stages(decode, device, write, workers=4, devices=("cuda:0",)):
        return engine.Stages(workers=workers, devices=list(devices), wall_s=10.0, images=100,
                             decode_s=decode * max(1, workers), decode_images=100, device_s={devices[0]: device},
                             write_s=write)

    assert stages(9.5, 3, 1).bottleneck() == ("decode", "add --workers or cores")
    assert stages(9.5, 3, 1, workers=0).bottleneck()[1].startswith("decoding runs inline")
    assert stages(2, 9.8, 1).bottleneck()[0] == "device"
    assert "--device cuda:0,1" in stages(2, 9.8, 1).bottleneck()[1]
    assert "GPU" in stages(2, 9.8, 1, devices=("cpu",)).bottleneck()[1]
    assert stages(2, 3, 9).bottleneck()[0] == "write"
    assert stages(2, 3, 1).bottleneck()[0] == "pipeline"
    assert stages(9.5, 3, 1).decode_capacity == pytest.approx(4 * 100 / 38)
    assert "decode-bound: add --workers or cores" in stages(9.5, 3, 1).line()
    short = stages(9.5, 3, 1)
    short.wall_s = 1.0
    assert short.bottleneck()[0] == "start-up"


def test_device_lists():
    assert engine.parse_devices("synthetic:0,1", synthetic=True) == ["synthetic:0", "synthetic:1"]
    assert engine.parse_devices("auto", synthetic=True) == ["synthetic:0"]
    assert engine.parse_devices("cpu", synthetic=False) == ["cpu"]
    with pytest.raises(ValueError, match="once"):
        engine.parse_devices("synthetic:1,1", synthetic=True)
    with pytest.raises(ValueError, match="synthetic:N only"):
        engine.parse_devices("synthetic:0", synthetic=False)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            engine.parse_devices("cuda:0,2", synthetic=False)


def test_fail_fast_and_a_bad_device_are_one_line(tmp_path, capsys):
    write_folder(tmp_path / "in", 6)
    rc = main(["tokenize", str(tmp_path / "in"), "--out", str(tmp_path / "o"), "--model", MODEL, "--size", "32",
               "--workers", "1", "--fail-fast", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "(--fail-fast)" in err and "Traceback" not in err
    rc = main(["tokenize", str(tmp_path / "in"), "--out", str(tmp_path / "o2"), "--model", MODEL,
               "--device", "synthetic:0,0", "--no-progress"])
    assert rc == 2 and "give each device once" in capsys.readouterr().err


def test_bench_tokenize_json(tmp_path):
    """`vqserve bench tokenize --model M --device D --json PATH`: what `vqserve bench gpu` reads."""
    path = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "vqserve.cli", "bench", "tokenize", "--model", "synthetic:100",
                          "--device", "synthetic:0,1", "--count", "24", "--size", "64", "--rounds", "1",
                          "--workers", "1", "--loader-rows", "0", "--json", str(path)],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    result = json.loads(path.read_text())
    for key in ("end_to_end_images_per_s", "raw_images_per_s", "ratio_median", "main_cpu_us_per_image",
                "decode_capacity_images_per_s", "ratio_to_bound_median"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["devices"] == ["synthetic:0", "synthetic:1"] and result["images"] == 24
    assert result["before"]["main_cpu_us_per_image"] > 0
    assert "end-to-end" in res.stdout and "main process" in res.stdout
    assert np.isclose(result["ratio_median"], result["end_to_end_images_per_s"] / result["raw_images_per_s"])


@pytest.mark.xdist_group("ray")  # beside the other Ray tests: one local Ray at a time
def test_ray_engine_writes_the_overlapped_engines_bytes_with_the_simulated_device(tmp_path, capsys):
    """The Ray driver names the simulated device as the local engine does, so the two
    folders (manifest included) are the same bytes."""
    pytest.importorskip("ray")
    from tests.helpers import folder_bytes

    write_folder(tmp_path / "in", 10)
    common = ["--size", "32", "--shard-size", "4"]
    _tokenize(tmp_path / "in", tmp_path / "local", *common, "--workers", "1", capsys=capsys)
    _tokenize(tmp_path / "in", tmp_path / "ray", *common, "--engine", "ray", capsys=capsys)
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")


def test_folder_listing_records_real_paths_through_links(tmp_path):
    """A folder is listed by relative path, with each file's real path as its source, also
    through linked folders and linked files (the listing resolves a folder once and a file
    only when it is a link: resolving every component of every path cost ~115 µs a file)."""
    import os

    from vqserve.offline.sources import list_records

    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    top = tmp_path / "top"
    (top / "a b").mkdir(parents=True)
    for p in ("real/x.jpg", "real/sub/y.png", "top/a b/z.JPG", "other/t.jpg", "top/.hidden.jpg", "top/notes.txt"):
        (tmp_path / p).write_bytes(b"1")
    os.symlink(real, top / "linked")
    os.symlink(tmp_path / "other" / "t.jpg", top / "l.jpg")
    via_dotdot = tmp_path / "top" / ".." / "top"
    for folder in (top, via_dotdot):
        got = [(r.key, r.source) for r in list_records([str(folder)])]
        assert got == [("a b/z", str((top / "a b" / "z.JPG").resolve())),
                       ("l", str((tmp_path / "other" / "t.jpg").resolve())),
                       ("linked/sub/y", str((real / "sub" / "y.png").resolve())),
                       ("linked/x", str((real / "x.jpg").resolve()))]


def test_decode_pool_workers_end_with_a_parent_killed_mid_run():
    """Regression: `vqserve bench tokenize` decoded its raw pass in a plain process pool, so
    when `bench gpu` killed it at its time limit, its two workers and their resource tracker
    waited forever (found an hour later). It now takes the pool `vqserve tokenize` decodes
    with (`tasks.decode_pool`), whose workers end with their parent, kill -9 included."""
    code = ("import time; from vqserve.offline.tasks import decode_pool; pool = decode_pool(2); "
            "[f.result() for f in [pool.submit(time.sleep, 0.2) for _ in range(4)]]; "
            "print('ready', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    below: list[int] = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        below = child_pids(proc.pid)  # the workers and multiprocessing's resource tracker
        assert len(below) >= 2
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not any(alive(p) for p in below)), "a decode worker outlived its parent"
    finally:
        proc.kill()
        for pid in filter(alive, below):  # a failing run leaves nothing behind either
            os.kill(pid, signal.SIGKILL)


def _signal_handled(pid: int) -> bool:
    """Whether process ``pid`` has dealt with the signals sent to it: none pending any more
    (taken, or ignored), or it died of one."""
    if not alive(pid):
        return True
    with open(f"/proc/{pid}/status") as fh:
        fields = dict(line.split(":", 1) for line in fh if ":" in line)
    return int(fields["ShdPnd"], 16) == 0 and int(fields["SigPnd"], 16) == 0


def test_decode_pool_workers_leave_a_schedulers_sigterm_to_their_parent():
    """Regression (a CI hang): a scheduler's SIGTERM to the whole process group reached the
    serial engine's decode workers, and one killed while it sent its result back left half a
    message in the pool's shared result pipe. The pool's manager thread then read from it for
    ever, and tokenize hung after printing its resume line. A worker now leaves a SIGTERM
    from anyone but its parent to the parent (here `kill`, another process, sends it)."""
    with decode_pool(1) as pool:
        pid = pool.submit(os.getpid).result(timeout=60)
        subprocess.run(["kill", "-TERM", str(pid)], check=True)
        assert wait_until(lambda: _signal_handled(pid))
        assert alive(pid), "a decode worker died of a SIGTERM its parent did not send"
        assert pool.submit(os.getpid).result(timeout=60) == pid


def test_a_broken_decode_pool_still_ends_its_workers_which_ignore_sigterm():
    """The other side of the rule above: when a worker dies, the pool ends the others with
    ``terminate()`` and waits for them without a timeout (a busy one too, whose result
    nobody reads any more). Workers that ignore SIGTERM must still end then: the pool's
    ``terminate()`` kills them."""
    from concurrent.futures.process import BrokenProcessPool

    pool = decode_pool(2)
    procs: list = []
    try:
        # two calls at once start both workers (the pool starts them as calls find none idle)
        [f.result(timeout=60) for f in [pool.submit(os.getpid) for _ in range(2)]]
        procs = list(pool._processes.values())
        assert len(procs) == 2
        procs[0].terminate()
        # not join(): the pool's manager thread reaps the process too, and a join that loses
        # that race returns with no exit code yet; the winner records it on the same object
        wait_until(lambda: procs[0].exitcode is not None)
        assert procs[0].exitcode == -signal.SIGKILL, "terminate() did not end a decode worker"
        with pytest.raises(BrokenProcessPool):
            pool.submit(os.getpid).result(timeout=60)
        ended = threading.Thread(target=pool.shutdown, kwargs={"wait": True}, daemon=True)
        ended.start()
        ended.join(120)
        assert not ended.is_alive(), "the broken pool's shutdown waited for ever"
        assert not any(alive(p.pid) for p in procs)
    finally:
        for proc in procs:
            if alive(proc.pid):
                os.kill(proc.pid, signal.SIGKILL)
