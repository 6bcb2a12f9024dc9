"""Client: send token indices (.npy files) to a running `vqserve serve`, get PNG images back.

TOKENS is any mix of .npy files, folders of them (recursive) and globs, as written by
`vqserve encode --out`. Each file holds one [h,w] grid (one image) or an [N,h,w] stack.
Images are written to --out keeping the relative paths: a folder's a/img.npy becomes
OUT/a/img.png; a file given directly becomes OUT/<name>.png; a stack becomes
OUT/<name>_<i>.png. Existing images are refused unless --overwrite, and two inputs that
would write the same image are refused before anything is sent.

Model identity: beside x.npy, `vqserve encode` writes x.json naming the model that made
the tokens (model_hash). When the server's model is another one, decode refuses (exit 2):
tokens only mean something to the model that made them. --force decodes anyway. Tokens
without an identity file are decoded with a warning.

A file that is not a token array (not .npy, pickled objects, floats, structured, corrupt)
or that the server refuses (indices outside the codebook) is listed at the end with the
reason; the others are written. Exit status: 0 all written, 1 some failed, 2 usage error.

Examples:
  vqserve decode --server localhost:50051 tokens/ --out recon/
  vqserve decode --server localhost:50051 'tokens/**/*.npy' --out recon/
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vqserve.commands._client import (
    Source,
    UsageError,
    add_client_args,
    check_out_dir,
    client_from_args,
    finish_run,
    list_sources,
    one_line,
    progress,
    refuse_collisions,
    refuse_existing,
    rpc_failure,
)
from vqserve.core.files import atomic_write_stream
from vqserve.core.identity import same_tokens
from vqserve.core.token_layout import TokenLayout

NOT_TOKENS = "not a token array"


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tokens", nargs="+", metavar="TOKENS",
                        help=".npy token files, folders of them (recursive) and globs")
    parser.add_argument("--out", required=True, help="output folder for the PNG images")
    parser.add_argument("--force", action="store_true",
                        help="decode even tokens whose identity file names another model than the "
                             "server's (the images will be wrong)")
    add_client_args(parser)


@dataclass
class _TokenFile:
    """One input file and the images it will become (``names``, relative to --out)."""

    src: Source
    shape: tuple[int, ...] = ()
    names: list[str] = field(default_factory=list)
    error: str = ""


class _NotTokens(ValueError):
    """The file is not a plain integer array; the message says what it is instead."""


# ---- reading token files safely -----------------------------------------------------------------
def inspect_npy(path: str) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) from a .npy header, without loading data or ever unpickling.
    Raises :class:`_NotTokens` for anything but a complete integer array."""
    import numpy as np

    fmt = np.lib.format
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
            if magic != b"\x93NUMPY":
                raise _NotTokens(_what_instead(magic))
            fh.seek(0)
            version = fmt.read_magic(fh)
            if version not in ((1, 0), (2, 0)):
                raise _NotTokens(
                    f".npy format version {version[0]}.{version[1]}, not written by numpy.save "
                    "of an integer array"
                )
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(fh)
            start = fh.tell()
            fh.seek(0, 2)
            have = fh.tell() - start
    except _NotTokens:
        raise
    except OSError as exc:
        raise _NotTokens(f"cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - a corrupt header can raise many types
        raise _NotTokens(f"its .npy header is corrupt ({type(exc).__name__})") from None
    _check_dtype(dtype)
    need = math.prod(shape) * dtype.itemsize
    if have < need:
        raise _NotTokens(f"it is truncated: {have} of {need} bytes of data")
    return tuple(shape), dtype.name


def _what_instead(magic: bytes) -> str:
    if magic.startswith(b"PK"):
        return "it is a zip (.npz) archive, not a .npy file"
    if magic.startswith(b"\x80"):
        return "it is a Python pickle, not a .npy file"
    return "it is not a .npy file"


def _check_dtype(dtype) -> None:
    if dtype.hasobject:
        raise _NotTokens("it holds Python objects (pickled data), not integer token indices")
    if dtype.fields is not None or dtype.kind == "V":
        raise _NotTokens(f"it has a structured dtype ({dtype}), not integer token indices")
    if dtype.kind not in "iu":
        raise _NotTokens(f"its dtype is {dtype.name}, not an integer type")


def load_tokens(path: str):
    """The whole array, loaded without pickle support and re-checked."""
    import numpy as np

    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - changed or corrupt since inspected
        raise _NotTokens(f"it cannot be loaded ({type(exc).__name__})") from None
    _check_dtype(arr.dtype)
    return arr


# ---- planning ---------------------------------------------------------------------------------
def _plan(src: Source, per_image_ndim: int) -> _TokenFile:
    tf = _TokenFile(src)
    try:
        tf.shape, _ = inspect_npy(src.path)
    except _NotTokens as exc:
        tf.error = f"{NOT_TOKENS}: {exc}"
        return tf
    grid = {1: "[L]", 2: "[h,w]"}.get(per_image_ndim, "[h,w,Q]")
    if len(tf.shape) == per_image_ndim:
        tf.names = [f"{src.key}.png"]
    elif len(tf.shape) == per_image_ndim + 1:
        tf.names = [f"{src.key}_{i}.png" for i in range(tf.shape[0])]
    else:
        tf.error = (
            f"{NOT_TOKENS} for this model: shape {list(tf.shape)}; expected {grid} or [N,{grid[1:]}"
        )
    return tf


def _refuse_oversized(files: list[_TokenFile], layout: TokenLayout, max_pixels: int) -> None:
    """Tokens whose image would exceed the server's pixel limit (or, for a pyramid, whose
    length has no scale schedule) fail here, naming both, rather than in a call the server
    refuses (or, for a huge grid, one gRPC cannot even send)."""
    for tf in files:
        if tf.error:
            continue
        item = tuple(tf.shape[-layout.item_rank():])
        try:
            height, width = layout.image_size(item)
        except ValueError as exc:
            tf.error = f"tokens {exc}"
            continue
        if max_pixels and height * width > max_pixels:
            what = f"a {item[0]}x{item[1]} grid" if layout.is_grid else f"a {layout.kind} of {item[0]} tokens"
            tf.error = (f"{what} decodes to {height}x{width} = {height * width} "
                        f"pixels, more than the server's limit of {max_pixels} per image")


def read_identity(src: Source) -> dict | None:
    """The identity file beside ``x.npy`` (``x.json``), or None when there is none."""
    path = Path(src.path).with_suffix(".json")
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return dict(data["model"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(
            f"{path}: not a readable vqserve identity file ({type(exc).__name__}: "
            f"{one_line(exc)}); restore it, or move it away to decode without a check"
        ) from None


def check_identity(files: list[_TokenFile], info: dict, server: str, force: bool) -> None:
    """Refuse (UsageError) tokens made by another model than the server's; warn about tokens
    without identity. With ``force`` a mismatch is a warning."""
    mismatched, unknown = [], []
    for tf in files:
        try:
            ident = read_identity(tf.src)
        except UsageError as exc:
            if not force:
                raise
            print(f"vqserve decode: warning: {exc} (--force: decoding anyway)", file=sys.stderr)
            continue
        if ident is None:
            unknown.append(tf.src.shown)
        elif not same_tokens(ident, info):  # the same files, or exact tokens of the same checkpoint
            mismatched.append((tf.src.shown, str(ident.get("model_hash", ""))))
    if unknown:
        more = ", ..." if len(unknown) > 1 else ""
        print(f"vqserve decode: warning: {len(unknown)} token file(s) have no identity .json "
              f"beside them ({unknown[0]}{more}); cannot check they were made by the server's "
              "model", file=sys.stderr)
    if mismatched:
        shown, theirs = mismatched[0]
        more = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
        msg = (
            f"{shown}{more}: made by model {theirs[:12]}, but the server at {server} runs model "
            f"{info['model_hash'][:12]}; tokens decoded by another model give wrong images"
        )
        if not force:
            raise UsageError(f"{msg}: use the server that made them, or pass --force")
        print(f"vqserve decode: warning: {msg} (--force: decoding anyway)", file=sys.stderr)


# ---- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """UsageError (exit 2, one line) is reported by vqserve.cli.main, like every command's."""
    import grpc

    sources = list_sources(args.tokens, suffixes=(".npy",))
    if not sources:
        raise UsageError(f"no .npy files in {' '.join(args.tokens)}")
    out = Path(args.out)
    check_out_dir(out)
    with client_from_args(args) as client:
        try:
            info = client.model_info()
        except grpc.RpcError as exc:
            print(f"vqserve decode: error: {rpc_failure(exc, args.server)}", file=sys.stderr)
            return 1
        if not info.get("decodes", True):
            raise UsageError(f"the model served at {args.server} encodes only (it has no decoder): "
                             "decode its tokens where a decoder for them is served")
        layout = TokenLayout.from_info(info)  # a grid, or a pyramid's flat [L] per image
        per_image = layout.item_rank()
        files = [_plan(s, per_image) for s in sources]
        _refuse_oversized(files, layout, int(info.get("max_pixels") or 0))
        good = [tf for tf in files if not tf.error]
        refuse_collisions(((n, tf.src.shown) for tf in good for n in tf.names), out)
        refuse_existing([out / n for tf in good for n in tf.names], args.overwrite)
        check_identity(good, info, args.server, args.force)
        failures, stopped, written, seconds = _send_all(client, files, per_image, out, args)
    total = sum(len(tf.names) for tf in files)
    return finish_run("decode", written, total, f"written to {out}", seconds, failures,
                      len(files), stopped)


def _save_png(fh, pixels) -> None:
    from PIL import Image

    Image.fromarray(pixels, "RGB").save(fh, "PNG")


def _items(files: list[_TokenFile], per_image: int) -> Iterator:
    """Token files -> one client Item per image (tag: file number, image number); a file
    that fails to load becomes a failed Outcome."""
    from vqserve.serve.clients.batches import Item, Outcome

    for n, tf in enumerate(files):
        if tf.error:
            continue
        try:
            arr = load_tokens(tf.src.path)
        except _NotTokens as exc:
            yield Outcome((n, -1), error=f"{NOT_TOKENS}: {exc}")
            continue
        stack = arr[None] if arr.ndim == per_image else arr
        if len(stack) != len(tf.names) or stack.shape[1:] != tuple(tf.shape[-stack.ndim + 1:]):
            yield Outcome((n, -1), error="the file changed while decode was running")
            continue
        for i in range(len(stack)):
            yield Item((n, i), stack[i], group=n)


def _send_all(
    client, files: list[_TokenFile], per_image: int, out: Path, args: argparse.Namespace
) -> tuple[list[tuple[str, str]], str, int, float]:
    """Decode and write every image; returns (failures, why the run stopped or '', images
    written, seconds)."""
    import grpc

    errors: dict[int, str] = {n: tf.error for n, tf in enumerate(files) if tf.error}
    written, stopped, t0 = 0, "", time.perf_counter()
    with progress(sum(len(tf.names) for tf in files), "decode", args.no_progress) as bar:
        try:
            for o in client.decode_items(_items(files, per_image), batch_size=args.batch_size):
                n, i = o.tag
                tf = files[n]
                if o.ok:
                    name = tf.names[i]
                    atomic_write_stream(out / name, lambda fh, px=o.result: _save_png(fh, px))
                    written += 1
                else:
                    where = f"image {i}: " if len(tf.names) > 1 and i >= 0 else ""
                    errors.setdefault(n, where + o.error)
                bar.update(1 if i >= 0 else len(tf.names))
        except grpc.RpcError as exc:
            stopped = rpc_failure(exc, args.server)
    seconds = time.perf_counter() - t0
    failures = [(files[n].src.shown, errors[n]) for n in sorted(errors)]
    return failures, stopped, written, seconds
