"""Token shards as PyTorch training data: ``TokenShards`` and the loader that knows its place.

``vqserve tokenize`` writes a folder of shards; a training job wants a stream of token grids,
split across ranks and DataLoader workers, shuffled, epoch after epoch, and resumable from a
checkpoint without seeing a row twice or missing one. This module is that stream::

    from vqserve.offline.token_shards import TokenShards

    data = TokenShards("tokens/", rank=rank, world_size=world, shuffle=True, seed=0)
    loader = data.loader(batch_size=64, num_workers=4)
    if resume:
        loader.load_state_dict(checkpoint["data"])
    for epoch in range(loader.epoch, epochs):
        for batch in loader:                       # batch["tokens"]: int64 [64, h, w]
            ...
            checkpoint = {"data": loader.state_dict(), ...}

The order (which rows, which worker, which shuffle) is planned by :mod:`vqserve.offline.reader`
from seeds alone. Progress is counted where batches reach the training loop: by the
dataset itself when it is iterated in this process, by :class:`TokenLoader` when DataLoader
workers read it (a worker's copy of the dataset cannot tell the main process what was
consumed, so a plain ``DataLoader`` with workers cannot checkpoint mid-epoch).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from vqserve.core.token_layout import PYRAMID, TokenLayout
from vqserve.offline import reader

STATE_VERSION = 1
_WORKER = "__worker__"   # tags each row with the worker that read it (removed before collate)


class TokenShards(IterableDataset):
    """The rows of one or more ``vqserve tokenize`` output folders, one dict per row:
    ``key`` (str), ``tokens`` (the grid as an int64 tensor ``[h, w]``, ``[h, w, Q]`` for
    residual quantizers; for a multi-scale pyramid (VAR) the flat int64 ``[L]``, coarse to fine,
    with ``scales``, an int64 ``[S, 2]`` of each scale's ``(h, w)``, to split it),
    ``grid_height``, ``grid_width``, and any ``columns`` asked for (``source``, ``height``,
    ``width``, ``orig_height``, ...).

    * ``rank`` / ``world_size``: this process's share (disjoint, together every row);
      ``even_ranks=True`` gives every rank ``N // world_size`` rows (the last few of each
      epoch's order are left out) so that no rank waits for another's extra batch.
    * ``shuffle`` / ``seed``: shard order per epoch from ``(seed, epoch)``, then a shuffle
      buffer of ``buffer_size`` rows. Without ``shuffle`` rows come in manifest order.
    * ``crop=(h, w)``: a random ``h x w`` window of each grid, at offsets that are multiples
      of the model's token period (4 for a ``bayer4``-dithered model, whose codes depend on
      their position modulo 4; else 1), so a crop never changes what a token means.
    * Folders must hold tokens of one identity (same checkpoint's exact tokens, or the same
      files, backend and dtype): ``identity`` says which; a mix is refused.
    """

    def __init__(self, path: str | Path | Sequence[str | Path], rank: int = 0, world_size: int = 1,
                 shuffle: bool = False, seed: int = 0, buffer_size: int = 1024,
                 crop: tuple[int, int] | None = None, even_ranks: bool = False,
                 columns: Sequence[str] = ()):
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        if crop is not None and (len(crop) != 2 or min(crop) < 1):
            raise ValueError(f"crop must be (height, width) in tokens, both >= 1, got {crop!r}")
        self.folders, self.identity = reader.open_folders(path)
        self.manifest = self.folders[0].manifest
        self.rank, self.world_size, self.even_ranks = rank, world_size, even_ranks
        self.shuffle, self.seed, self.buffer_size = shuffle, seed, buffer_size
        self.crop = tuple(crop) if crop else None
        self.columns = tuple(columns)
        self.period = 4 if self.manifest["model"].get("dither") == "bayer4" else 1
        # the token shape: a pyramid's rows are flat [L], each with its ``scales`` [S, 2]
        self.layout = TokenLayout.from_info(self.manifest["model"])
        if self.crop and not self.layout.is_grid:
            raise ValueError(f"crop takes a window of a token grid; these tokens are {self.layout.noun}, "
                             "which has no such window")
        self._files = [shard for f in self.folders for shard in f.shards]
        self.total_rows = sum(n for _, n in self._files)
        self.epoch = 0
        self._consumed: list[int] = [0]   # rows yielded per worker slot this epoch
        self._workers = 1                 # worker slots the consumed counts refer to
        self._loader_driven = False       # set by TokenLoader: it counts, workers only read

    # -- what a consumer reads --------------------------------------------------------------
    def __len__(self) -> int:
        """Rows of this rank in one epoch."""
        start, stop = reader.consumer_slice(self.total_rows, self.rank, self.world_size, 0, 1,
                                            self.even_ranks)
        return stop - start

    def rows_of(self, worker: int, workers: int, epoch: int | None = None) -> Iterator[dict]:
        """One worker's whole stream for an epoch, from its first row (no skipping)."""
        epoch = self.epoch if epoch is None else epoch
        counts = [n for _, n in self._files]
        order = reader.epoch_shards(counts, epoch, self.seed, self.shuffle)
        start, stop = reader.consumer_slice(self.total_rows, self.rank, self.world_size, worker,
                                            workers, self.even_ranks)
        rng = np.random.default_rng([self.seed, epoch, self.rank, worker, workers])
        rows = (row for shard, lo, hi in reader.pieces(counts, order, start, stop)
                for row in reader.read_rows(self._files[shard][0], lo, hi, self.columns,
                                            pyramid=not self.layout.is_grid))
        if self.shuffle:
            rows = reader.buffer_shuffle(rows, self.buffer_size, rng)
        for row in rows:
            yield self._finish(row, rng)

    def _finish(self, row: dict, rng: np.random.Generator) -> dict:
        grid = row["tokens"]
        if self.crop:
            ch, cw = self.crop
            h, w = grid.shape[:2]
            if ch > h or cw > w:
                raise ValueError(f"row {row['key']!r} has a {h}x{w} token grid, smaller than "
                                 f"crop={self.crop}")
            top = int(rng.integers((h - ch) // self.period + 1)) * self.period
            left = int(rng.integers((w - cw) // self.period + 1)) * self.period
            grid = grid[top:top + ch, left:left + cw]
            row["grid_height"], row["grid_width"] = ch, cw
        row["tokens"] = torch.from_numpy(np.ascontiguousarray(grid, dtype=np.int64))
        if self.layout.kind == PYRAMID:  # coarse to fine: split with tokens[start:end] per scale
            row["scales"] = torch.tensor(self.layout.schedule_of(tuple(grid.shape)), dtype=torch.int64)
        return row

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        if info is None and not self._loader_driven:  # iterated here: this object counts
            yield from self._iterate_here()
            return
        if info is not None and not self._loader_driven:
            warnings.warn("TokenShards in DataLoader workers: use TokenShards.loader(...) for a "
                          "state_dict that resumes mid-epoch (the workers' copies cannot count)",
                          stacklevel=2)
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        skip = self._consumed[worker] if len(self._consumed) == workers else 0
        for i, row in enumerate(self.rows_of(worker, workers)):
            if i >= skip:
                if self._loader_driven:
                    row[_WORKER] = worker
                yield row

    def _iterate_here(self) -> Iterator[dict]:
        if self._workers != 1:
            raise ValueError(f"this state was saved with {self._workers} DataLoader workers: iterate "
                             f"through .loader(num_workers={self._workers})")
        for i, row in enumerate(self.rows_of(0, 1)):
            if i >= self._consumed[0]:
                self._consumed[0] = i + 1
                yield row
        self.set_epoch(self.epoch + 1)

    # -- epochs and checkpoints -----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first row (a new shuffle order)."""
        self.epoch, self._consumed = int(epoch), [0] * self._workers

    def state_dict(self) -> dict:
        """Where this rank is: the epoch and the rows each worker slot has delivered, with the
        settings the positions only make sense under."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "workers": self._workers,
                "consumed": list(self._consumed), **self._settings()}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` left off. Refuses (ValueError) a state from another
        dataset, seed, rank split or shuffle, where positions would point at other rows."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"not a TokenShards state (version {state.get('version')!r})")
        differ = [k for k, v in self._settings().items() if state.get(k) != v]
        if differ:
            raise ValueError("this state belongs to another setup (" + ", ".join(
                f"{k}: {state.get(k)!r} there, {self._settings()[k]!r} here" for k in differ) + ")")
        self.epoch, self._workers = int(state["epoch"]), int(state["workers"])
        self._consumed = [int(c) for c in state["consumed"]]

    def _settings(self) -> dict:
        return {"identity": self.identity, "total_rows": self.total_rows, "rank": self.rank,
                "world_size": self.world_size, "even_ranks": self.even_ranks,
                "shuffle": self.shuffle, "seed": self.seed, "buffer_size": self.buffer_size,
                "crop": list(self.crop) if self.crop else None}

    def loader(self, batch_size: int = 1, num_workers: int = 0,
               collate_fn: Callable | None = None, **kwargs) -> TokenLoader:
        """A DataLoader over this dataset whose ``state_dict()`` resumes mid-epoch."""
        return TokenLoader(self, batch_size=batch_size, num_workers=num_workers,
                           collate_fn=collate_fn, **kwargs)


class _TaggedCollate:
    """Runs in the worker: strips the worker tag, collates, and returns the tag beside the
    batch so the main process knows whose rows it counts (a module-level class: picklable)."""

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn

    def __call__(self, rows: list[dict]) -> tuple[int, int, object]:
        worker = rows[0].pop(_WORKER, 0)
        for row in rows[1:]:
            row.pop(_WORKER, None)
        return worker, len(rows), self.collate_fn(rows)


class TokenLoader(DataLoader):
    """A DataLoader for :class:`TokenShards` that counts, in the main process, the rows of each
    worker that reached the training loop. ``state_dict()`` is the dataset's state with those
    counts, so a resumed loader's workers each skip exactly what was consumed. The same
    ``num_workers`` must be used to resume (the rows a worker reads depend on it).
    Persistent workers are refused: they would keep last epoch's copy of the dataset."""

    def __init__(self, dataset: TokenShards, batch_size: int = 1, num_workers: int = 0,
                 collate_fn: Callable | None = None, **kwargs):
        for bad in ("sampler", "batch_sampler", "shuffle"):
            if kwargs.get(bad):
                raise ValueError(f"{bad}= does not apply: TokenShards orders its own rows "
                                 "(TokenShards(shuffle=True, seed=...))")
        if kwargs.get("persistent_workers"):
            raise ValueError("persistent_workers=True would keep each worker's copy of the dataset "
                             "from one epoch to the next; TokenLoader starts them per epoch")
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers,
                         collate_fn=_TaggedCollate(collate_fn or default_collate), **kwargs)
        self._adopt_worker_slots()

    def _adopt_worker_slots(self) -> None:
        """The dataset counts per worker of this loader; a position saved under another number
        of workers cannot be mapped (each worker's rows depend on how many there are)."""
        data: TokenShards = self.dataset
        slots = max(1, self.num_workers)
        if data._workers != slots:
            if any(data._consumed):
                raise ValueError(f"this state was saved with {data._workers} worker(s); resume with "
                                 f"num_workers={data._workers if data._workers > 1 else 0}")
            data._workers, data._consumed = slots, [0] * slots

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def __iter__(self) -> Iterator:
        data: TokenShards = self.dataset
        self._adopt_worker_slots()
        data._loader_driven = True
        try:
            for worker, rows, batch in super().__iter__():
                data._consumed[worker] += rows
                yield batch
        finally:
            data._loader_driven = False
        data.set_epoch(data.epoch + 1)

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        slots = max(1, self.num_workers)
        if int(state.get("workers", slots)) != slots:
            raise ValueError(f"this state was saved with {state.get('workers')} worker(s); resume "
                             f"with num_workers={state.get('workers') if state.get('workers', 1) > 1 else 0}")
        self.dataset.load_state_dict(state)
