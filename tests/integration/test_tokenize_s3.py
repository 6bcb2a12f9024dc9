"""`vqserve tokenize` with object storage in and out, against a real S3 endpoint the tests
start (moto in server mode on 127.0.0.1, behind a logging, fault-injecting proxy:
tests/object_store.py). A few images, tiny shards: seconds each.

What each test holds: the tokens of an S3 run equal a local run's; verify, detokenize and
TokenShards read the S3 folder; no written object or message holds the credentials; a
failed upload leaves no object and no open multipart upload; of two drivers exactly one
commits; a list file of URLs lists nothing; a changed input is refused; kill -9 twice and
resume twice gives the uninterrupted run's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_tokenize import encoded, photo_set
from tests.object_store import ACCESS_KEY, SECRET_KEY
from vqserve.cli import main

pytestmark = pytest.mark.timeout(300)
FLAGS = ["--size", "32", "--shard-size", "3", "--batch-size", "2"]


def tok(args: list[str], model: str) -> int:
    return main(["tokenize", *args, *FLAGS, "--model", model, "--workers", "0", "--no-progress"])


def put_images(s3, prefix: str, n: int, local: Path | None = None) -> list[np.ndarray]:
    """``n`` PNGs under ``prefix`` (and, if asked, the same files in a local folder), plus
    what a prefix listing must skip: a folder marker, ``_SUCCESS`` and a ``.crc``."""
    client, pics = s3.client(), photo_set(n)
    for i, px in enumerate(pics):
        rel = f"{'a' if i % 2 else 'b'}/img{i:03d}.png"
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/{rel}", Body=encoded(px))
        if local is not None:
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            (local / rel).write_bytes(encoded(px))
    for extra in ("_SUCCESS", "a/", "a/.img001.png.crc", "b/part.crc"):
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/{extra}", Body=b"")
    return pics


def objects(s3, prefix: str = "") -> dict[str, bytes]:
    client = s3.client()
    found = client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read() for o in found}


def rows_by_key(folder: str) -> dict[str, np.ndarray]:
    from vqserve.offline.reader import open_folder, read_rows

    out = {}
    for path, n in open_folder(folder).shards:
        for r in read_rows(path, 0, n):
            out[r["key"]] = r["tokens"]
    return out


def test_s3_in_and_out_equals_a_local_run_and_reads_back(tiny_checkpoint, s3, tmp_path, capsys, one_thread):
    put_images(s3, "in", 7, local=tmp_path / "in")
    url = f"s3://{s3.bucket}/out"
    assert tok([f"s3://{s3.bucket}/in", "--out", url], tiny_checkpoint) == 0
    assert tok([str(tmp_path / "in"), "--out", str(tmp_path / "out")], tiny_checkpoint) == 0
    remote, local = rows_by_key(url), rows_by_key(str(tmp_path / "out"))
    assert list(remote) == list(local) == [f"{d}/img{i:03d}" for d, i in sorted(
        ("a" if i % 2 else "b", i) for i in range(7))]
    for key in local:
        np.testing.assert_array_equal(remote[key], local[key])
    written = objects(s3, "out/")
    assert sorted(written) == ["out/__vqserve__/errors.jsonl", "out/__vqserve__/manifest.json",
                               "out/__vqserve__/started.json", "out/shard-000000.parquet",
                               "out/shard-000001.parquet", "out/shard-000002.parquet"]
    manifest = json.loads(written["out/__vqserve__/manifest.json"])
    assert manifest["complete"] and manifest["totals"]["rows"] == 7

    capsys.readouterr()
    assert main(["verify", url, "--sample", "2"]) == 0
    assert main(["detokenize", url, "--out", str(tmp_path / "png"), "--model", tiny_checkpoint,
                 "--no-progress"]) == 0
    assert len(list((tmp_path / "png").rglob("*.png"))) == 7

    from vqserve.offline.token_shards import TokenShards

    for a, b in zip(TokenShards(url), TokenShards(str(tmp_path / "out")), strict=True):
        assert a["key"] == b["key"]
        np.testing.assert_array_equal(np.asarray(a["tokens"]), np.asarray(b["tokens"]))
    # forked DataLoader workers after this process used the filesystem (s3fs#914): each opens its own
    import warnings

    from torch.utils.data import DataLoader

    def loaded(folder: str) -> dict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the advice to use .loader() for mid-epoch state
            return {k: t.numpy() for batch in DataLoader(TokenShards(folder), batch_size=2, num_workers=2)
                    for k, t in zip(batch["key"], batch["tokens"], strict=True)}
    remote_loaded, local_loaded = loaded(url), loaded(str(tmp_path / "out"))
    assert sorted(remote_loaded) == sorted(local_loaded) == sorted(local)
    for key, tokens in local_loaded.items():
        np.testing.assert_array_equal(remote_loaded[key], tokens)
    # the credentials are nowhere: not in any object written, nor in anything printed
    said = capsys.readouterr()
    for blob in [*written.values(), said.out.encode(), said.err.encode()]:
        assert ACCESS_KEY.encode() not in blob and SECRET_KEY.encode() not in blob


def open_uploads(s3) -> list:
    return s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])


def test_a_failed_multipart_upload_leaves_no_object_and_no_open_upload(tiny_checkpoint, s3, monkeypatch, capsys,
                                                                      one_thread):
    from tests.object_store import Fault

    put_images(s3, "in", 4)
    monkeypatch.setenv("VQSERVE_UPLOAD_PART_BYTES", "1024")   # each shard is several parts
    s3.proxy.faults.append(Fault(lambda r: r.method == "PUT" and r.query.get("partNumber") == ["2"],
                                 status=500, times=None))
    retries = json.dumps({"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}})
    status = tok([f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/out", "--storage-options", retries],
                 tiny_checkpoint)
    err = capsys.readouterr().err
    assert status != 0
    failed = [line for line in err.splitlines() if "error" in line]
    assert len(failed) == 1 and "shard-000000.parquet was not uploaded" in failed[0], err
    assert not [k for k in objects(s3, "out/") if "shard-" in k or k.endswith("manifest.json")]
    assert open_uploads(s3) == []
    # the same command, the store healthy again: it resumes and commits
    s3.proxy.faults.clear()
    assert tok([f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/out"], tiny_checkpoint) == 0
    assert "out/__vqserve__/manifest.json" in objects(s3, "out/")


def test_throttling_and_resets_are_retried(tiny_checkpoint, s3, monkeypatch, capsys, one_thread):
    from tests.object_store import Fault

    put_images(s3, "in", 4)
    monkeypatch.setenv("VQSERVE_UPLOAD_PART_BYTES", "1024")
    s3.proxy.faults += [Fault(lambda r: r.method == "PUT" and "partNumber" in r.query, status=503, times=2),
                        Fault(lambda r: r.method == "GET" and r.key.endswith(".png"), status=0, times=1),
                        Fault(lambda r: r.method == "PUT" and r.key.endswith("manifest.json"), status=503, times=1)]
    assert tok([f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/out"], tiny_checkpoint) == 0
    assert all(f.hits == f.times for f in s3.proxy.faults)
    said = [line for line in capsys.readouterr().err.splitlines() if "calls retried" in line]
    assert len(said) == 1 and int(said[0].split("storage: ")[1].split()[0]) >= 3, said
    assert main(["verify", f"s3://{s3.bucket}/out", "--sample", "0"]) == 0


def test_of_two_drivers_exactly_one_commits(tiny_checkpoint, s3, monkeypatch, capsys, one_thread):
    """Driver A has tokenized everything; before it commits, driver B (another process, the
    same command) runs start to end. B commits; A is refused in one line."""
    import subprocess
    import sys

    from vqserve.offline.job import Job

    put_images(s3, "in", 4)
    args = [f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/out"]
    real_finish, other = Job.finish, {}

    def finish_after_the_other_driver(job):
        other["run"] = subprocess.run([sys.executable, "-m", "vqserve.cli", "tokenize", *args, *FLAGS,
                                       "--model", tiny_checkpoint, "--workers", "0", "--no-progress"],
                                      capture_output=True, text=True, timeout=240)
        return real_finish(job)

    monkeypatch.setattr(Job, "finish", finish_after_the_other_driver)
    status = tok(args, tiny_checkpoint)
    err = capsys.readouterr().err
    assert other["run"].returncode == 0, other["run"].stderr
    assert status == 2
    refusal = [line for line in err.splitlines() if "error" in line]
    assert len(refusal) == 1 and "another run committed" in refusal[0], err
    manifest = json.loads(objects(s3, "out/__vqserve__/manifest.json")["out/__vqserve__/manifest.json"])
    assert manifest["complete"] and manifest["totals"]["rows"] == 4


def test_a_list_file_of_urls_lists_nothing_in_the_input_bucket(tiny_checkpoint, s3, tmp_path, one_thread):
    put_images(s3, "in", 5)
    urls = [f"s3://{s3.bucket}/in/{'a' if i % 2 else 'b'}/img{i:03d}.png" for i in range(5)]
    (tmp_path / "inputs.txt").write_text("# five images\n" + "\n".join(urls) + "\n")
    s3.proxy.log.clear()
    assert tok([str(tmp_path / "inputs.txt"), "--out", str(tmp_path / "out")], tiny_checkpoint) == 0
    seen = s3.proxy.requests(s3.bucket)
    assert [r for r in seen if r.is_list] == []
    assert sorted((r.method, r.key) for r in seen) == sorted(("GET", u.split("/", 3)[3]) for u in urls)
    assert list(rows_by_key(str(tmp_path / "out"))) == urls


def test_an_input_that_changed_is_refused_on_resume(tiny_checkpoint, s3, capsys, one_thread):
    pics = put_images(s3, "in", 4)
    args = [f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/out"]
    assert tok(args, tiny_checkpoint) == 0
    s3.client().put_object(Bucket=s3.bucket, Key="in/b/img000.png", Body=encoded(pics[1]))
    capsys.readouterr()
    assert tok(args, tiny_checkpoint) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "the inputs changed since shard-000000.parquet" in err[0] and "ETag" in err[0]


@pytest.mark.slow
def test_kill_resume_kill_resume_gives_the_uninterrupted_bytes(tiny_checkpoint, s3, one_thread):
    import os
    import signal
    import subprocess
    import sys
    import time

    put_images(s3, "in", 10)
    flags = [*FLAGS[:2], "--shard-size", "2", "--batch-size", "1", "--model", tiny_checkpoint, "--workers", "0",
             "--no-progress", "--threads", "1"]
    assert main(["tokenize", f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/ref", *flags]) == 0
    expected = {k[len("ref/"):]: v for k, v in objects(s3, "ref/").items()}
    client, kills = s3.client(), 0
    for at_least in (1, 3):   # kill -9 once a shard is up, resume, kill again two shards later
        proc = subprocess.Popen([sys.executable, "-m", "vqserve.cli", "tokenize", f"s3://{s3.bucket}/in",
                                 "--out", f"s3://{s3.bucket}/out", *flags], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None:
            listed = client.list_objects_v2(Bucket=s3.bucket, Prefix="out/shard-").get("KeyCount", 0)
            if listed >= at_least:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.01)
        proc.wait()
        for key, data in objects(s3, "out/shard-").items():  # every object with a final name is right
            assert data == expected[key[len("out/"):]]
    assert kills >= 1
    assert main(["tokenize", f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/out", *flags]) == 0
    assert main(["tokenize", f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/out", *flags]) == 0
    assert {k[len("out/"):]: v for k, v in objects(s3, "out/").items()} == expected
    assert open_uploads(s3) == []


def test_credentials_given_as_storage_options_are_written_nowhere(tiny_checkpoint, s3, tmp_path, monkeypatch,
                                                                   capsys, one_thread):
    """Only --storage-options carries the endpoint and the keys (no AWS_* variable); an input
    that is missing makes an error line. Nothing written or printed holds the keys."""
    put_images(s3, "in", 2)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    options = json.dumps({"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": s3.endpoint})
    urls = [f"s3://{s3.bucket}/in/b/img000.png", f"s3://{s3.bucket}/in/missing.png"]
    (tmp_path / "list.txt").write_text("\n".join(urls) + "\n")
    out = f"s3://{s3.bucket}/out"
    assert tok([str(tmp_path / "list.txt"), "--out", out, "--storage-options", options], tiny_checkpoint) == 0
    said = capsys.readouterr()
    written = objects(s3, "out/")
    errors = [json.loads(line) for line in written["out/__vqserve__/errors.jsonl"].splitlines()]
    assert [e["source"] for e in errors] == [urls[1]]
    assert main(["verify", out, "--sample", "1", "--storage-options", options]) == 0
    said_verify = capsys.readouterr()
    for blob in [*written.values(), *(s.encode() for s in (*said, *said_verify))]:
        assert ACCESS_KEY.encode() not in blob and SECRET_KEY.encode() not in blob


def test_a_scheme_without_its_extra_or_a_read_only_out_is_one_line_before_the_model(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: the missing-extra line cannot show")
    status = main(["tokenize", "gs://bucket/images/", "--out", str(tmp_path / "out"), "--model", "no-such-model"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == ["vqserve tokenize: error: gs:// needs the 'gcs' extra: pip install 'vqserve[gcs]'"]
    status = main(["tokenize", str(tmp_path), "--out", "hf://datasets/me/tokens", "--model", "no-such-model"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "hf:// is read-only" in err[0]


@pytest.mark.slow
def test_ray_engine_s3_to_s3_equals_the_local_engine(tiny_checkpoint, s3, one_thread):
    """Ray's tasks read the inputs from the store themselves (the standard chain reaches them
    as it reaches the driver); the shards equal the local engine's, byte for byte."""
    ray = pytest.importorskip("ray")
    put_images(s3, "in", 5)
    common = ["--model", tiny_checkpoint, "--device", "cpu", *FLAGS, "--workers", "0", "--no-progress"]
    assert main(["tokenize", f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/local", *common]) == 0
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)   # after AWS_* are set
    try:
        assert main(["tokenize", f"s3://{s3.bucket}/in", "--out", f"s3://{s3.bucket}/ray", *common,
                     "--engine", "ray", "--ray-actors", "1"]) == 0
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, handler)   # ray.init took it
    local = {k[len("local/"):]: v for k, v in objects(s3, "local/").items()}
    assert {k[len("ray/"):]: v for k, v in objects(s3, "ray/").items()} == local


def test_a_plan_file_in_object_storage(tiny_checkpoint, s3, tmp_path, capsys, one_thread):
    """``--plan s3://...``: the plan file is read from the store."""
    from tests.integration.test_plan import FAST

    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", tiny_checkpoint, "--device", "cpu", *FAST, "--backends", "eager",
                 "--plan-cache", str(tmp_path / "plans"), "--out", str(plan)]) == 0
    s3.client().put_object(Bucket=s3.bucket, Key="plans/plan.json", Body=plan.read_bytes())
    put_images(s3, "in", 3)
    capsys.readouterr()
    assert main(["tokenize", f"s3://{s3.bucket}/in", "--out", str(tmp_path / "out"), "--model", tiny_checkpoint,
                 *FLAGS, "--workers", "0", "--no-progress", "--plan", f"s3://{s3.bucket}/plans/plan.json", "--device", "cpu",
                 "--plan-cache", str(tmp_path / "empty")]) == 0
    assert "(file; " in capsys.readouterr().err
