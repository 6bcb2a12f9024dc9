"""Client: send images to a running `vqserve serve`, get token indices back.

INPUT is any mix of image files, folders (recursive: .jpg .jpeg .png .webp .bmp .tif
.tiff) and globs. Every image is prepared here by the same function `vqserve tokenize`
uses (EXIF orientation, 16-bit, alpha over white, palette, grayscale, CMYK), then:

  --size N      shorter side to N, centre crop N x N (N a multiple of the model's factor)
  --keep-size   centre-crop down to multiples of the factor (the crop is recorded)
  (neither)     the image must already be a multiple of the factor, else that file fails

The prepared pixels go to the server as raw uint8, so a file gets the same tokens as
from `vqserve tokenize` with the same flags.

Output:
  --out DIR        DIR/<path>.npy per image ([h,w], the server's index dtype), where <path>
                   is the file's path inside the folder given (or its name, for a file
                   given directly) without extension; beside each, DIR/<path>.json says
                   which model made it (model_hash, codebook, factor, ...), how the image
                   was prepared and the crop. `vqserve decode` checks it.
  --out FILE.npy   one stacked [N,h,w] array (all tokens of one shape, e.g. with --size),
                   FILE.json beside it with the identity and one entry per row
  (no --out)       one JSON line per image on stdout

Existing outputs are refused unless --overwrite; two inputs that would write the same
output are refused before anything is sent. A file that cannot be used (unreadable,
not an image, wrong size) is listed at the end with the reason and the rest go on.
Exit status: 0 all written, 1 some files failed (the others are written) or the server
stopped answering, 2 usage error (nothing written).

Examples:
  vqserve encode --server localhost:50051 photos/ --out tokens/ --size 256
  vqserve encode --server localhost:50051 'shots/**/*.jpg' --out tokens/ --keep-size
  vqserve encode --server localhost:50051 a.png b.png --out batch.npy
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vqserve.commands._client import (
    IDENTITY_FORMAT,
    Source,
    UsageError,
    add_client_args,
    check_out_dir,
    client_from_args,
    finish_run,
    list_sources,
    progress,
    refuse_collisions,
    refuse_existing,
    rpc_failure,
)
from vqserve.core.files import atomic_write_json, atomic_write_stream
from vqserve.core.identity import recorded_identity

__all__ = ["add_client_args", "add_parser", "client_from_args", "run"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="image files, folders of images (recursive) and globs")
    parser.add_argument("--out", help="output folder (one .npy + .json per image), or FILE.npy "
                                      "for one stacked array; without it, JSON lines on stdout")
    p = parser.add_argument_group("preprocessing (as `vqserve tokenize`; recorded beside the "
                                  "tokens)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--size", type=int, default=0, metavar="N",
                      help="resize the shorter side to N and centre-crop N x N "
                           "(default: no resizing)")
    size.add_argument("--keep-size", action="store_true",
                      help="keep the size, centre-cropping down to multiples of the model's factor")
    p.add_argument("--resample", default="bicubic",
                   choices=["bicubic", "bilinear", "lanczos", "area", "nearest"],
                   help="filter for --size (default bicubic)")
    add_client_args(parser)


# ---- where results go -------------------------------------------------------------------------
class _Sink:
    """Where tokens go; ``start`` learns the model, ``add`` takes one file's tokens."""

    def start(self, model: dict, preprocess: dict) -> None:
        self.header = {"format": IDENTITY_FORMAT, "model": model, "preprocess": preprocess}
        self.count = 0

    def add(self, src: Source, outcome) -> None:
        raise NotImplementedError

    def finish(self) -> str:
        """Write what waits for the end; returns where the tokens went."""
        raise NotImplementedError


def _entry(src: Source, outcome) -> dict:
    """What is known about one image: its file, size as displayed and the crop taken."""
    return {
        "source": src.path,
        "original_size": list(outcome.tag.original_size),
        "crop": list(outcome.tag.crop),
        "tokens_shape": list(outcome.result.shape),
    }


class _FolderSink(_Sink):
    """DIR/<key>.npy plus DIR/<key>.json (the identity) per image."""

    def __init__(self, out: Path, sources: list[Source], overwrite: bool):
        check_out_dir(out)
        refuse_collisions(((f"{s.key}.npy", s.shown) for s in sources), out)
        refuse_existing(
            [out / f"{s.key}{ext}" for s in sources for ext in (".npy", ".json")], overwrite
        )
        self.out = out

    def add(self, src: Source, outcome) -> None:
        import numpy as np

        atomic_write_stream(self.out / f"{src.key}.npy", lambda fh: np.save(fh, outcome.result))
        atomic_write_json(self.out / f"{src.key}.json", {**self.header, **_entry(src, outcome)})
        self.count += 1

    def finish(self) -> str:
        return f"{self.out} (a .npy and its .json identity per image)"


class _StackSink(_Sink):
    """One FILE.npy ``[N,h,w]`` in input order, FILE.json with one entry per row."""

    def __init__(self, out: Path, overwrite: bool):
        refuse_existing([out, out.with_suffix(".json")], overwrite)
        self.out, self.rows = out, {}

    def add(self, src: Source, outcome) -> None:
        self.rows[outcome.tag.index] = (src, outcome)
        self.count += 1

    def finish(self) -> str:
        import numpy as np

        rows = [self.rows[i] for i in sorted(self.rows)]
        shapes = sorted({o.result.shape for _, o in rows})
        if len(shapes) > 1:
            raise UsageError(
                f"--out {self.out} needs tokens of one shape, got {shapes}; pass --size N, "
                "or an output folder instead of a .npy file"
            )
        if rows:
            stack = np.stack([o.result for _, o in rows])
            atomic_write_stream(self.out, lambda fh: np.save(fh, stack))
            atomic_write_json(
                self.out.with_suffix(".json"),
                {**self.header, "items": [_entry(s, o) for s, o in rows]},
            )
            return f"{self.out} {list(stack.shape)} (identity in {self.out.with_suffix('.json')})"
        return f"nothing ({self.out} not written)"


class _LinesSink(_Sink):
    """One JSON line per image on stdout, as results arrive."""

    def add(self, src: Source, outcome) -> None:
        r = outcome.result
        print(
            json.dumps(
                {
                    "file": src.shown,
                    "shape": list(r.shape),
                    "dtype": r.dtype.name,
                    "indices": r.tolist(),
                    "crop": list(outcome.tag.crop),
                    "model_hash": self.header["model"].get("model_hash", ""),
                }
            ),
            flush=True,
        )
        self.count += 1

    def finish(self) -> str:
        return "stdout (JSON lines)"


def _sink(args: argparse.Namespace, sources: list[Source]) -> _Sink:
    if not args.out:
        return _LinesSink()
    if args.out.lower().endswith(".npy"):
        return _StackSink(Path(args.out), args.overwrite)
    return _FolderSink(Path(args.out), sources, args.overwrite)


# ---- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """UsageError (exit 2, one line) is reported by vqserve.cli.main, like every command's."""
    import grpc

    if args.size < 0:
        raise UsageError(f"--size must be positive, got {args.size}")
    sources = list_sources(args.inputs)
    if not sources:
        raise UsageError(
            f"no image files in {' '.join(args.inputs)} (looked for "
            ".jpg .jpeg .png .webp .bmp .tif .tiff)"
        )
    sink = _sink(args, sources)
    with client_from_args(args) as client:
        try:
            info = client.model_info()
            pre = client.preprocess(args.size, args.keep_size, args.resample)
        except grpc.RpcError as exc:
            print(f"vqserve encode: error: {rpc_failure(exc, args.server)}", file=sys.stderr)
            return 1
        except ValueError as exc:  # --size not a multiple of this model's factor
            raise UsageError(str(exc)) from None
        sink.start(recorded_identity(info), pre.to_dict())
        failures, stopped, t0 = _send_all(client, sources, pre, sink, args)
    elapsed = time.perf_counter() - t0
    summary = sink.finish()
    return finish_run("encode", sink.count, len(sources), f"-> {summary}", elapsed, failures,
                      len(sources), stopped)


def _send_all(
    client, sources: list[Source], pre, sink: _Sink, args: argparse.Namespace
) -> tuple[list[tuple[str, str]], str, float]:
    """Every file through the client; returns (failures, why the run stopped early or '',
    start time). A server that stops answering ends the run; one bad file does not."""
    import grpc

    failed: dict[int, str] = {}
    done: set[int] = set()
    t0 = time.perf_counter()
    with progress(len(sources), "encode", args.no_progress) as bar:
        try:
            for o in client.iter_encode_files(
                [s.path for s in sources], pre, batch_size=args.batch_size
            ):
                src = sources[o.tag.index]
                done.add(o.tag.index)
                if o.ok:
                    sink.add(src, o)
                else:
                    failed[o.tag.index] = o.error
                bar.update(1)
        except grpc.RpcError as exc:
            left = len(sources) - len(done)
            stopped = f"{rpc_failure(exc, args.server)} ({left} images not sent)"
        else:
            stopped = ""
    return [(sources[i].shown, failed[i]) for i in sorted(failed)], stopped, t0
