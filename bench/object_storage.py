"""``vqserve bench tokenize --s3``: tokenize from and to object storage against the same run on
local files, same images, interleaved round by round, and the requests it costs.

Each round runs ``vqserve tokenize``'s local engine twice on the same photographs: folder ->
folder, and ``s3://`` prefix -> ``s3://`` prefix on a real S3 endpoint on this machine (moto in
server mode, behind a proxy that counts every request: :mod:`vqserve.bench.s3_endpoint`). It
prints images/s of both, the ratio S3 / local (goal: >= 0.9), and the requests per 1,000
images by kind (LIST, GET, HEAD, PUT, POST). A local endpoint measures the protocol's and
the client's cost, not a network's: on a real bucket, add the round trips.

    vqserve bench tokenize --s3 --model synthetic:50 --count 512 --size 64
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from vqserve.bench.offline import write_photo_folder


def _run(job_factory, runtimes: dict, workers: int) -> float:
    from vqserve.offline import pipeline

    job = job_factory()
    t0 = time.perf_counter()
    job.prepare()
    pipeline.run_local(job, runtimes, workers=workers, progress=False)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vqserve bench tokenize --s3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--s3", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--count", type=int, default=256, help="images (whole scikit-image photographs, JPEG)")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=None, help="decode processes (default as tokenize)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)

    import subprocess
    import sys

    import psutil

    from vqserve.bench.s3_endpoint import endpoint_env, fetch_log, moto_client
    from vqserve.core import images
    from vqserve.export.runtimes.loader import load_runtime
    from vqserve.offline import pipeline
    from vqserve.offline.job import Job, Settings
    from vqserve.offline.storage import fs as storage_fs

    scratch = Path(tempfile.mkdtemp(prefix="vqserve-bench-s3-"))
    # the endpoint in a process of its own: its proxy takes no CPU or GIL from the run measured
    server = subprocess.Popen([sys.executable, "-m", "vqserve.bench.s3_endpoint"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(server.stdout.readline())
        os.environ.update(endpoint_env(started["endpoint"]))
        storage_fs._FILESYSTEMS.clear()
        runtime = load_runtime(args.model, device=args.device)
        info = {**runtime.info.to_dict(), "device": args.device}
        workers = pipeline.default_workers(args.device) if args.workers is None else args.workers
        runtimes = {args.device: pipeline.planned_runtime(runtime, args.device, workers)}
        folder = scratch / "photos"
        files = write_photo_folder(folder, args.count)
        client, bucket = moto_client(started["moto_port"]), "bench"
        client.create_bucket(Bucket=bucket)
        for f in files:
            client.put_object(Bucket=bucket, Key=f"in/{f.relative_to(folder).as_posix()}", Body=f.read_bytes())
        settings = Settings(preprocess=images.Preprocess(mode="size", size=args.size, factor=info["factor"]),
                            shard_size=args.shard_size, batch_size=args.batch_size)
        passes = collections.Counter()

        def job(kind: str):
            passes[kind] += 1
            if kind == "local":
                return Job(inputs=[str(folder.resolve())], out=scratch / f"out{passes[kind]}", settings=settings,
                           runtime_info=info, model_ref=args.model)
            return Job(inputs=[f"s3://{bucket}/in"], out=f"s3://{bucket}/out{passes[kind]}", settings=settings,
                       runtime_info=info, model_ref=args.model)

        endpoint = [psutil.Process(server.pid), psutil.Process(started["moto_pid"])]  # proxy, moto

        def endpoint_cpu_s() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in endpoint)
        local, remote, requests, endpoint_cpu = [], [], collections.Counter(), []
        for r in range(args.rounds):
            local.append(args.count / _run(lambda: job("local"), runtimes, workers))
            fetch_log(started["endpoint"])
            cpu0 = endpoint_cpu_s()
            seconds = _run(lambda: job("s3"), runtimes, workers)
            remote.append(args.count / seconds)
            # the endpoint (moto) shares this machine's cores with the run: its CPU, against the run's time
            endpoint_cpu.append((endpoint_cpu_s() - cpu0) / seconds)
            requests.update(kind for kind, b, _ in fetch_log(started["endpoint"]) if b == bucket)
            shutil.rmtree(scratch / f"out{passes['local']}", ignore_errors=True)
            print(f"round {r + 1}: local {local[-1]:.1f} img/s, s3 -> s3 {remote[-1]:.1f} img/s, "
                  f"ratio {remote[-1] / local[-1]:.3f}; the endpoint used {endpoint_cpu[-1]:.2f} cores meanwhile",
                  flush=True)
        per_1000 = {k: 1000 * v / (args.count * args.rounds) for k, v in sorted(requests.items())}
        result = {"images": args.count, "size": args.size, "shard_size": args.shard_size,
                  "batch_size": args.batch_size, "workers": workers, "device": args.device,
                  "backend": info["backend"], "dtype": info["dtype"], "rounds": args.rounds,
                  "local_images_per_s": statistics.median(local), "s3_images_per_s": statistics.median(remote),
                  "ratios": [s / a for s, a in zip(remote, local, strict=True)],
                  "ratio_median": statistics.median(s / a for s, a in zip(remote, local, strict=True)),
                  "requests_per_1000_images": per_1000,
                  "endpoint_cores_busy_median": statistics.median(endpoint_cpu)}
        print(f"{args.count} images at {args.size}x{args.size}, shards of {args.shard_size}, batch "
              f"{args.batch_size}, {workers} decode workers, {info['backend']} {info['dtype']} on {args.device}")
        print(f"local -> local  {result['local_images_per_s']:8.1f} img/s (median of {args.rounds})")
        print(f"s3 -> s3        {result['s3_images_per_s']:8.1f} img/s (moto on 127.0.0.1)")
        print(f"ratio s3/local  {result['ratio_median']:8.3f} (the endpoint, proxy and moto, kept "
              f"{result['endpoint_cores_busy_median']:.2f} cores busy during the s3 runs)")
        print("requests per 1,000 images: " + ", ".join(f"{k} {v:.1f}" for k, v in per_1000.items()))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        server.stdin.close()
        server.wait(30)
        shutil.rmtree(scratch, ignore_errors=True)
