"""What `vqserve encode` and `vqserve decode` share: connection flags, listing INPUTs (files,
folders, globs) with the paths to write, refusing collisions and overwrites up front, the
progress bar, the failure list, and one-line messages for gRPC errors.

Not a subcommand itself (the leading underscore keeps it out of the command list).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vqserve.commands.common import UsageError  # one exit-2 error for every command

IDENTITY_FORMAT = "vqserve-tokens/1"

@dataclass(frozen=True)
class Source:
    """One input file: ``path`` to read, ``key`` (its output path without extension, relative
    to --out) and ``shown`` (how messages name it)."""

    path: str
    key: str
    shown: str


def add_client_args(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("server")
    c.add_argument("--server", default="localhost:50051",
                   help="HOST:PORT of a running `vqserve serve` (default localhost:50051)")
    c.add_argument("--tls-ca", help="CA or server certificate (PEM); turns TLS on")
    c.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    c.add_argument("--auth-token-file", help="file holding the bearer token the server expects")
    c.add_argument("--timeout", type=float, default=None,
                   help="deadline in seconds for each call (default: 30 s + 15 s per megapixel "
                        "in the call, so big batches get more time)")
    c.add_argument("--batch-size", type=int, default=None,
                   help="images per call (default and most: the server's --max-batch-size)")
    o = parser.add_argument_group("output")
    o.add_argument("--overwrite", action="store_true",
                   help="replace output files that already exist (default: refuse to start)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def check_timeout(timeout: float | None) -> None:
    """--timeout of a command that calls a server: positive (0 or less asked anyway, and the
    call failed as DEADLINE_EXCEEDED, as if the server were unreachable)."""
    if timeout is not None and not timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout:g}")


def client_from_args(args: argparse.Namespace):
    from vqserve.serve.clients.sync import AUTO, TokenizerClient

    check_timeout(args.timeout)
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    token = None
    if args.auth_token_file:
        try:
            token = Path(args.auth_token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(f"--auth-token-file {args.auth_token_file}: {exc.strerror}") from None
    return TokenizerClient(args.server, token=token, tls_ca=args.tls_ca, tls=args.tls,
                           timeout=AUTO if args.timeout is None else args.timeout,
                           batch_size=args.batch_size)


# ---- inputs ---------------------------------------------------------------------------------
def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _walk(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under ``folder`` ending in ``suffixes``, recursively, hidden ones skipped, sorted
    (the rules of ``offline/sources.py``'s folder listing)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, n) for n in filenames
                  if n.lower().endswith(suffixes) and not n.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _folder_sources(folder: Path, suffixes: tuple[str, ...] | None) -> list[Source]:
    if suffixes is None:  # images: exactly the listing (and keys) `vqserve tokenize` uses
        from vqserve.offline import sources

        return [Source(r.path, r.key, _shown(r.path)) for r in sources.list_records([str(folder)])
                if r.kind == "file"]
    return [
        Source(str(p.resolve()), p.relative_to(folder).as_posix().rsplit(".", 1)[0], _shown(str(p)))
        for p in _walk(folder, suffixes)
    ]


def list_sources(inputs: Sequence[str], suffixes: tuple[str, ...] | None = None) -> list[Source]:
    """INPUT arguments -> files to process, in order. Globs and brace ranges are expanded;
    a folder contributes its files (images, or ``suffixes``) recursively, keyed by their
    path inside it; a file is keyed by its name. A missing INPUT is a usage error. The same
    file reached twice under the same key is listed once."""
    from vqserve.offline import sources

    try:
        expanded = sources.expand_inputs(inputs)
    except sources.InputError as exc:
        raise UsageError(str(exc)) from None
    out: list[Source] = []
    seen: set[tuple[str, str]] = set()
    for arg in expanded:
        p = Path(arg)
        items = (
            _folder_sources(p, suffixes) if p.is_dir() else [Source(str(p.resolve()), p.stem, arg)]
        )
        for s in items:
            if (s.path, s.key) not in seen:
                seen.add((s.path, s.key))
                out.append(s)
    return out


# ---- outputs --------------------------------------------------------------------------------
def refuse_collisions(targets: Iterable[tuple[str, str]], out: Path) -> None:
    """``(output name, input shown)`` pairs -> UsageError when two inputs would write the
    same output: never overwrite one result with another."""
    first: dict[str, str] = {}
    for name, shown in targets:
        if name in first and first[name] != shown:
            raise UsageError(
                f"{first[name]} and {shown} would both be written to {out / name}; give the "
                "folder that holds them instead (paths inside a folder are kept), or use "
                "separate --out folders"
            )
        first.setdefault(name, shown)


def refuse_existing(paths: Sequence[Path], overwrite: bool) -> None:
    if overwrite:
        return
    existing = [p for p in paths if p.exists()]
    if existing:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise UsageError(
            f"{existing[0]}{more} already exist{'s' if len(existing) == 1 else ''}; "
            "pass --overwrite to replace, or choose another --out"
        )


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")


# ---- reporting ------------------------------------------------------------------------------
def progress(total: int, desc: str, disabled: bool):
    """A tqdm bar on stderr (images/s); in a log file (not a TTY) one update every 30 s."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(
        total=total,
        unit="img",
        desc=desc,
        dynamic_ncols=True,
        disable=disabled,
        mininterval=0.1 if tty else 30,
        file=sys.stderr,
    )


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def report_failures(command: str, failures: Sequence[tuple[str, str]], total: int) -> None:
    """The failure list at the end: one line per file, ``file: reason``."""
    if not failures:
        return
    print(f"vqserve {command}: {len(failures)} of {total} files failed:", file=sys.stderr)
    for shown, reason in failures:
        print(f"  {shown}: {one_line(reason)}", file=sys.stderr)


def finish_run(command: str, done: int, total: int, where: str, seconds: float,
               failures: Sequence[tuple[str, str]], n_files: int, stopped: str) -> int:
    """The end of an encode/decode run: the summary line, the failure list, why it stopped
    early (if it did), and the exit status (1 when anything failed)."""
    rate = done / seconds if seconds > 0 else 0.0
    print(f"{command}: {done} of {total} images {where} in {seconds:.1f} s ({rate:.1f} img/s)",
          file=sys.stderr)
    report_failures(command, failures, n_files)
    if stopped:
        print(f"vqserve {command}: stopped: {stopped}", file=sys.stderr)
    return 1 if failures or stopped else 0


def plaintext_hint(details: str) -> str:
    """A server that expects TLS closes a plaintext connection at once ("Socket closed"):
    the one gRPC detail that points there, turned into what to pass."""
    if "socket closed" not in details.lower():
        return ""
    return ("; a server that serves TLS closes a plaintext connection like this: then pass --tls "
            "(and --tls-ca CA.pem for a certificate of your own CA)")


def rpc_failure(exc, server: str) -> str:
    """A gRPC error that stops the whole run -> one line with what to do."""
    import grpc

    code, details = exc.code(), one_line(exc.details() or "")
    if code == grpc.StatusCode.UNAVAILABLE and "handshake" in details.lower():
        return (
            f"the TLS handshake with {server} failed (UNAVAILABLE: {details[:160]}); does it serve "
            "TLS (vqserve serve --tls-cert/--tls-key)? If not, drop --tls; if it does, pass its CA "
            "with --tls-ca"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"cannot use the server at {server}: UNAVAILABLE: {details}; is `vqserve serve` "
            f"running and ready there? (check: vqserve health --server {server}){plaintext_hint(details)}"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            f"the server at {server} refused the call (UNAUTHENTICATED: {details}); pass its "
            "token with --auth-token-file"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {server} in time (DEADLINE_EXCEEDED); raise --timeout"
    return f"{code.name} from {server}: {details}"
