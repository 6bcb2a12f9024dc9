"""Quantizer benchmarks (not tests): throughput against vector-quantize-pytorch, and the
cost of the fp32 island inside a bf16 tokenizer encode.

Machines here are shared and noisy, so every figure is a ratio of two measurements taken
side by side in one run, interleaved, with the median of several repeats.

    vqserve bench quantizers [--tokens 262144] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vqserve.model import (
    FSQ,
    LFQ,
    Tokenizer,
    TokenizerConfig,
    default_tokenizer_available,
    load_tokenizer,
)
from vqserve.model.precision import cast_to


def _median_seconds(fns: dict[str, Callable[[], object]], repeats: int, inner: int) -> dict[str, float]:
    """Interleave the candidates so drift hits all of them alike; median per call."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_quantizers(tokens: int, repeats: int) -> list[dict]:
    try:
        from vector_quantize_pytorch import FSQ as OracleFSQ
        from vector_quantize_pytorch import LFQ as OracleLFQ
    except ImportError as exc:  # a test extra, not a runtime dependency
        raise SystemExit("vqserve bench quantizers needs vector-quantize-pytorch: "
                         "pip install 'vqserve[test]'") from exc

    rows = []
    cases = [
        ("FSQ [8,5,5,5]", FSQ([8, 5, 5, 5]), OracleFSQ([8, 5, 5, 5]), 4),
        ("FSQ [8,8,8,5,5,5]", FSQ([8, 8, 8, 5, 5, 5]), OracleFSQ([8, 8, 8, 5, 5, 5]), 6),
        ("LFQ dim 16", LFQ(16).eval(), OracleLFQ(dim=16).eval(), 16),
    ]
    for label, ours, theirs, dim in cases:
        for dtype in (torch.float32, torch.bfloat16):
            z = (torch.randn(1, tokens, dim) * 2).to(dtype)
            with torch.inference_mode():
                t = _median_seconds({"ours": lambda q=ours, z=z: q(z), "oracle": lambda q=theirs, z=z: q(z)},
                                    repeats, inner=3)
            rows.append({"case": label, "dtype": str(dtype).replace("torch.", ""),
                         "ours_Mtok_s": tokens / t["ours"] / 1e6,
                         "oracle_Mtok_s": tokens / t["oracle"] / 1e6,
                         "speed_ratio": t["oracle"] / t["ours"]})
    return rows


def bench_island(size: int, batch: int, repeats: int) -> dict:
    """Share of a bf16 encode spent in the fp32 quantizer (the island's whole cost)."""
    tok = load_tokenizer("default") if default_tokenizer_available() else Tokenizer(TokenizerConfig()).eval()
    tok = tok.to(torch.bfloat16).to(memory_format=torch.channels_last)
    images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8)
    with torch.inference_mode():
        x = cast_to(images.permute(0, 3, 1, 2).float() / 127.5 - 1, torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        latents = tok.encode_latents(x)
        t = _median_seconds({
            "encoder": lambda: tok.encode_latents(x),
            "quantizer": lambda: tok.quantize(latents),
        }, repeats, inner=1)
    total = t["encoder"] + t["quantizer"]
    return {"image": f"{batch}x{size}x{size}", "encoder_ms": t["encoder"] * 1e3,
            "quantizer_ms": t["quantizer"] * 1e3, "island_percent": 100 * t["quantizer"] / total,
            "model": "default" if default_tokenizer_available() else "untrained default-shaped"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vqserve bench quantizers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=262_144, help="latent positions per call")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats (median)")
    parser.add_argument("--size", type=int, default=256, help="image side for the island benchmark")
    parser.add_argument("--batch", type=int, default=8, help="images per encode for the island benchmark")
    args = parser.parse_args(argv)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratios > 1 mean vqserve is faster")
    print(f"{'case':<20}{'dtype':<10}{'vqserve Mtok/s':>16}{'vq-pytorch Mtok/s':>19}{'ratio':>8}")
    for row in bench_quantizers(args.tokens, args.repeats):
        print(f"{row['case']:<20}{row['dtype']:<10}{row['ours_Mtok_s']:>16.2f}"
              f"{row['oracle_Mtok_s']:>19.2f}{row['speed_ratio']:>8.2f}")
    island = bench_island(args.size, args.batch, args.repeats)
    print(f"\nfp32 island inside a bf16 encode ({island['model']}, {island['image']}): "
          f"encoder {island['encoder_ms']:.1f} ms, quantizer {island['quantizer_ms']:.2f} ms "
          f"= {island['island_percent']:.2f}% of encode time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
