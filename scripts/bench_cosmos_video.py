"""Benchmark Cosmos DV encoding: frames/s and clips/s, vqserve in-process, served, and NVIDIA's own code path.

A benchmark, not a test: it prints numbers for the machine it runs on. The same clips (the
fixture script's sliding windows, ``--frames`` x ``--size`` x ``--size``) go through

* ``inprocess``: ``vqserve.load(DIR).encode`` (fp32, exact);
* ``served``: a ``vqserve.serve`` server in this process, the Python gRPC client, one clip
  per request (``--no-served`` skips it);
* ``reference``: with ``--reference`` (a Cosmos-Tokenizer checkout outside the repository),
  ``CausalDiscreteVideoTokenizer.encode`` on ``numpy2tensor``'s tensor, fp32, the same
  weights; its tokens are compared with vqserve's too.

The model is a published architecture (``--model DV8x16x16`` ...) with random
``deterministic_video_weights`` seed 0, imported into a temporary directory the way a
release is (traced archives, ``vqserve import cosmos``)::

    python scripts/bench_cosmos_video.py --model DV4x8x8 --frames 17 --size 64 --clips 3 --reference /tmp/cosmos-ref
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_cosmos_video_fixtures import moving_clip, reference_model  # noqa: E402  (sibling scripts)

import vqserve  # noqa: E402
from vqserve.model.families.cosmos.importer import import_cosmos  # noqa: E402
from vqserve.model.families.cosmos.video import (  # noqa: E402
    PRESETS,
    CosmosVideoTokenizer,
    deterministic_video_weights,
    normalise_clip,
)


def release(name: str, where: Path) -> tuple[Path, dict]:
    """Trace the architecture's encoder/decoder into archives and import them."""
    arch = PRESETS[name]
    tok = CosmosVideoTokenizer(arch).eval()
    weights = deterministic_video_weights(arch, 0)
    tok.load_state_dict(weights)
    folder = where / "release"
    folder.mkdir()
    x = normalise_clip(torch.zeros(1, 1 + arch.temporal_compression, 32, 32, 3, dtype=torch.uint8))
    with torch.no_grad():
        encoder = torch.nn.Sequential(OrderedDict(encoder=tok.encoder, quant_conv=tok.quant_conv))
        decoder = torch.nn.Sequential(OrderedDict(post_quant_conv=tok.post_quant_conv, decoder=tok.decoder))
        torch.jit.trace(encoder, x, check_trace=False).save(str(folder / "encoder.jit"))
        torch.jit.trace(decoder, encoder(x), check_trace=False).save(str(folder / "decoder.jit"))
    out, _ = import_cosmos(folder, where / "model", preset=name)
    return out, weights


def timed(fn, clips: list[np.ndarray]) -> tuple[float, list]:
    started = time.perf_counter()
    results = [fn(clip) for clip in clips]
    return time.perf_counter() - started, results


def rates(seconds: float, clips: list[np.ndarray]) -> dict:
    frames = sum(c.shape[1] for c in clips)
    return {"seconds": round(seconds, 3), "clips_per_s": round(len(clips) / seconds, 4),
            "frames_per_s": round(frames / seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="DV8x16x16", choices=list(PRESETS))
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--clips", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reference", type=Path, default=None)
    parser.add_argument("--no-served", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clips = [moving_clip(args.frames, args.size, args.size, start=7 * i)[None] for i in range(args.clips)]
    result = {"model": args.model, "clip": f"{args.frames}x{args.size}x{args.size}", "clips": args.clips,
              "threads": args.threads, "torch": torch.__version__, "dtype": "fp32", "device": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        model, weights = release(args.model, Path(tmp))
        runtime = vqserve.load(model)
        runtime.encode(clips[0])  # warm-up
        seconds, ours = timed(runtime.encode, clips)
        result["inprocess"] = rates(seconds, clips)
        if not args.no_served:
            with vqserve.serve(model=str(model), port=0, plan="default") as server:
                client = vqserve.TokenizerClient(server.target)
                client.encode(clips[0])
                seconds, served = timed(client.encode, clips)
            result["served"] = rates(seconds, clips)
            result["served_tokens_equal_inprocess"] = all(np.array_equal(a, b) for a, b in zip(ours, served, strict=True))
        if args.reference is not None:
            from make_cosmos_fixtures import import_reference

            ref = import_reference(args.reference.resolve())
            net = reference_model(ref, PRESETS[args.model], weights)

            def encode(clip):
                with torch.no_grad():
                    return net.encode(ref.utils.numpy2tensor(clip, dtype=torch.float32, device="cpu"))[0]

            encode(clips[0])
            seconds, theirs = timed(encode, clips)
            result["reference"] = rates(seconds, clips)
            result["reference_tokens_equal_vqserve"] = all(np.array_equal(a, b.numpy())
                                                           for a, b in zip(ours, theirs, strict=True))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
