"""Reading ``vqserve tokenize`` output folders back for training: which rows, in which order,
and only tokens of one identity. No torch here; :mod:`vqserve.offline.token_shards` wraps it for PyTorch.

The order is a pure function of (row counts, epoch, seed, rank, world size, worker, workers),
so every process of a distributed job computes the same plan without talking to the others:

* **epoch order** — the shards in manifest order, or (``shuffle``) permuted by
  ``(seed, epoch)``, give one sequence of all ``N`` rows;
* **ranks** — rank ``r`` of ``W`` takes the contiguous slice ``[r*N//W, (r+1)*N//W)`` of it
  (``even_ranks``: ``N//W`` rows each, so no rank waits for another's last batch);
* **workers** — worker ``w`` of a rank's ``K`` DataLoader workers takes the same kind of slice
  of its rank's rows. Slices are disjoint and together exactly the rows, whatever ``W`` and
  ``K``, and a worker reads only the shards its slice touches;
* **buffer** — within a slice, a seeded shuffle buffer mixes rows across shard boundaries.

Resuming is skipping: a consumer that had yielded ``k`` rows regenerates its stream and
drops the first ``k``, so nothing repeats and nothing is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vqserve.core.identity import folder_identity
from vqserve.offline import shards
from vqserve.offline.storage import as_path, readable
from vqserve.offline.verify.folder import NotADataset, read_manifest


@dataclass(frozen=True)
class TokenFolder:
    """One complete output folder: its manifest and its shards with their row counts."""

    path: Path
    manifest: dict
    shards: tuple[tuple[Path, int], ...]

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.shards)


def open_folder(path: str | Path) -> TokenFolder:
    """The folder's manifest and shards. Refuses (ValueError, one line) a folder that is not a
    complete tokenize output, and a listed shard whose recorded fingerprint is not the
    manifest's (a shard of another run put in its place)."""
    folder = as_path(path)
    manifest = read_manifest(folder)
    if manifest is None:
        raise NotADataset(f"{folder}: the manifest does not parse (damaged?); `vqserve verify {folder}`")
    if not manifest.get("complete"):
        raise NotADataset(f"{folder} is not complete (the run was interrupted): run the same "
                          "`vqserve tokenize` command again to finish it")
    listed = []
    for entry in manifest.get("shards", []):
        shard = folder / str(entry["name"])
        if not shard.is_file():
            raise NotADataset(f"{shard} is listed in the manifest but missing")
        info = shards.read_shard_info(shard)
        if info.fingerprint != manifest["fingerprint"]:
            raise NotADataset(f"{shard} was made by another run (fingerprint {info.fingerprint}, the "
                              f"manifest's {manifest['fingerprint']}); `vqserve verify {folder}`")
        listed.append((shard, int(entry["rows"])))
    return TokenFolder(folder, manifest, tuple(listed))


def open_folders(paths: str | Path | Sequence[str | Path]) -> tuple[list[TokenFolder], dict]:
    """Several folders as one dataset, refused where their tokens would not mean the same:
    a model learns nothing from a mix of two codebooks, or of exact and bf16 tokens."""
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    if not paths:
        raise ValueError("no token folder given")
    folders = [open_folder(p) for p in paths]
    identity = folder_identity(folders[0].manifest)
    for other in folders[1:]:
        theirs = folder_identity(other.manifest)
        if theirs != identity:
            raise ValueError(f"refusing to mix two token identities: {folders[0].path} holds "
                             f"{json.dumps(identity, sort_keys=True)}, {other.path} holds "
                             f"{json.dumps(theirs, sort_keys=True)}")
    return folders, identity


# ---- the plan: pure functions of counts and seeds -------------------------------------------
def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous slices of ``range(n)``, sizes differing by ≤ 1."""
    return index * n // parts, (index + 1) * n // parts


def epoch_shards(counts: Sequence[int], epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Shard indices in this epoch's order."""
    order = list(range(len(counts)))
    if shuffle:
        np.random.default_rng([seed, epoch]).shuffle(order)
    return order


def consumer_slice(total: int, rank: int, world_size: int, worker: int, workers: int,
                   even_ranks: bool) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the epoch's sequence that one worker of one rank reads."""
    if even_ranks:
        per_rank = total // world_size
        r0, r1 = rank * per_rank, (rank + 1) * per_rank
    else:
        r0, r1 = split(total, world_size, rank)
    w0, w1 = split(r1 - r0, workers, worker)
    return r0 + w0, r0 + w1


def pieces(counts: Sequence[int], order: Sequence[int], start: int, stop: int
           ) -> Iterator[tuple[int, int, int]]:
    """``(shard, first_row, stop_row)`` for the rows ``[start, stop)`` of the sequence the shards
    make in ``order``: only the shards that slice touches."""
    offset = 0
    for shard in order:
        n = counts[shard]
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            yield shard, lo - offset, hi - offset
        offset += n
        if offset >= stop:
            return


def buffer_shuffle(items: Iterator, size: int, rng: np.random.Generator) -> Iterator:
    """A shuffle buffer: hold ``size`` items, yield a random one as each new one arrives, then
    the rest in random order. Deterministic for a given ``rng``."""
    buffer: list = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        i = int(rng.integers(len(buffer)))
        buffer[i], item = item, buffer[i]
        yield item
    rng.shuffle(buffer)
    yield from buffer


# ---- reading rows -----------------------------------------------------------------------------
def read_rows(path: Path, first: int, stop: int, columns: Sequence[str] = (), pyramid: bool = False) -> list[dict]:
    """Rows ``[first, stop)`` of one shard: ``key``, ``tokens`` (the grid, in the stored index
    dtype; with ``pyramid``, the flat ``[L]`` as stored), ``grid_height``, ``grid_width`` and any
    other ``columns`` asked for."""
    if path.suffix != ".parquet":
        rows = shards.read_rows(path)[first:stop]
        keep = {"key", "tokens", "grid_height", "grid_width", *columns}
        return [{k: v for k, v in r.items() if k in keep} for r in rows]
    import pyarrow.parquet as pq

    wanted = list(dict.fromkeys(["key", "grid_height", "grid_width", *columns, "tokens"]))
    table = pq.read_table(readable(path), columns=wanted).slice(first, stop - first)
    tokens = table.column("tokens").combine_chunks()
    flat = tokens.values.to_numpy(zero_copy_only=False)
    offsets = tokens.offsets.to_numpy()
    other = {c: table.column(c).to_pylist() for c in wanted if c != "tokens"}
    rows = []
    for i in range(table.num_rows):
        h, w = other["grid_height"][i], other["grid_width"][i]
        grid = flat[offsets[i]:offsets[i + 1]]
        depth = grid.size // max(1, h * w)
        if not pyramid:
            grid = grid.reshape(h, w) if depth == 1 else grid.reshape(h, w, depth)
        rows.append({**{c: v[i] for c, v in other.items()}, "tokens": grid})
    return rows
