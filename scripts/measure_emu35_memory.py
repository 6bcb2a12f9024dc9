"""Peak memory per megapixel of an Emu3.5-size IBQ encode on CPU: the island's plan vs the original's.

The quantizer of Emu3.5's VisionTokenizer scores every position against 131,072 codes: as
the original writes it, a 1-megapixel image (4,096 positions at factor 16) holds 4,096 x
131,072 fp32 logits and as many probabilities (2 x 2.1 GB). ``SoftmaxMaxVQ`` writes the
probabilities over the logits (the same kernel, the same bits): one score tensor. This
measures, each case in a fresh process so one peak does not hide another:

* ``island``: the quantizer on random latents of an image of ``--megapixels``, the island's
  plan (``plan``) and the original's two tensors (``original``), and whether the indices agree;
* ``encode``: ``tokenizer.encode`` of a random image, the full-size architecture (random
  weights: SEED-Voken IBQ's ddconfig with Emu3.5's 131,072 x 256 codebook).

Peak = the highest resident set size seen (``/proc/self/statm`` sampled every 2 ms, and
``ru_maxrss``) minus the resident size just before the call: what the call adds. One
intra-op thread (how vqserve runs a model call)::

    python scripts/measure_emu35_memory.py --megapixels 0.25 1.0 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The highest RSS seen while the block runs (a sampling thread), in bytes above the start."""

    def __enter__(self):
        self.start, self.high, self.running = rss(), rss(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.high = max(self.high, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.high = max(self.high, rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        self.added = self.high - self.start


def side(megapixels: float) -> tuple[int, int]:
    """A 4:3 image of about ``megapixels``, both sides multiples of 16."""
    h = int((megapixels * 1e6 * 3 / 4) ** 0.5) // 16 * 16
    return h, int(h * 4 / 3) // 16 * 16


def one_case(kind: str, megapixels: float, original: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from vqserve.model.families.ibq.family import IbqConfig, IbqTokenizer
    from vqserve.model.quantizers.softmax_max import SoftmaxMaxVQ

    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, w = side(megapixels)
    if kind == "island":
        q = SoftmaxMaxVQ(131072, 256)
        q.embedding.normal_()
        z = torch.randn(1, h // 16, w // 16, 256)
        with torch.no_grad(), Peak() as peak:
            t0 = time.perf_counter()
            if original:  # the original's expression: logits, then a second tensor of probabilities
                logits = torch.einsum("b d h w, n d -> b n h w", z.permute(0, 3, 1, 2), q.embedding)
                indices = F.softmax(logits, dim=1).max(dim=1)[1]
                del logits
            else:
                indices = q(z)[1]
            seconds = time.perf_counter() - t0
        digest = int((indices.to(torch.int64) * torch.arange(indices.numel()).view(indices.shape)).sum())
    else:
        arch = IbqConfig(codebook_size=131072, codebook_dim=256, pixel_rule="emu3.5")
        tok = IbqTokenizer(arch).eval()
        tok.quantizer.embedding.normal_()  # a random codebook (the buffer starts at zeros)
        image = torch.randint(0, 256, (1, h, w, 3), dtype=torch.uint8)
        with torch.no_grad(), Peak() as peak:
            t0 = time.perf_counter()
            indices = tok.encode(image)
            seconds = time.perf_counter() - t0
        digest = int((indices.to(torch.int64) * torch.arange(indices.numel()).view(indices.shape)).sum())
    mp = h * w / 1e6
    return {"kind": kind, "plan": "original" if original else "island", "height": h, "width": w, "megapixels": mp,
            "peak_added_bytes": peak.added, "peak_added_gib_per_megapixel": peak.added / 2**30 / mp,
            "seconds": seconds, "indices_digest": digest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megapixels", type=float, nargs="+", default=[0.25, 1.0])
    parser.add_argument("--kinds", nargs="+", default=["island", "encode"], choices=["island", "encode"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--case", nargs=3, default=None, help=argparse.SUPPRESS)  # kind megapixels original
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(one_case(args.case[0], float(args.case[1]), args.case[2] == "1")))
        return 0
    rows = []
    for mp in args.megapixels:
        for kind in args.kinds:
            for original in ((False, True) if kind == "island" else (False,)):
                out = subprocess.run([sys.executable, __file__, "--case", kind, str(mp), "1" if original else "0"],
                                     capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{kind:6s} {row['plan']:8s} {row['width']}x{row['height']} "
                      f"({row['megapixels']:.2f} MP): +{row['peak_added_bytes'] / 2**30:.2f} GiB "
                      f"({row['peak_added_gib_per_megapixel']:.2f} GiB/MP), {row['seconds']:.1f} s, "
                      f"indices digest {row['indices_digest']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
