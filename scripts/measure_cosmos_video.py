"""Measure the Cosmos DV models' exactness figures (docs/MODELS.md): a measurement, not a test.

For each published architecture (DV4x8x8, DV8x8x8, DV8x16x16: ``video.PRESETS``, random
``deterministic_video_weights`` seed 0, since no trained weights are reachable here) on the
fixture script's sliding-window clips at ``--size``:

* ``fp32_equal_reference``: with ``--reference`` (a Cosmos-Tokenizer checkout outside the
  repository), vqserve's fp32 indices against ``CausalDiscreteVideoTokenizer.encode``, for the
  whole clip and for independent 17-frame windows;
* ``chunked_vs_whole``: 34 frames as two 17-frame windows against the first 33 frames in one
  causal pass: the token counts, and how many tokens of each latent frame agree;
* ``bf16`` / ``fp16``: the encoder a served bf16/fp16 runtime runs (``low_precision_encoder``:
  residual-branch convolutions in that dtype, the rest and the FSQ in fp32), tokens equal to
  fp32 per latent frame; with ``--reference`` also the reference's own bf16 path
  (``model.to(torch.bfloat16)``, as ``CausalVideoTokenizer`` runs by default) against its fp32;
* ``batch_invariant``: a batch of two clips against each alone.

    python scripts/measure_cosmos_video.py --reference /tmp/cosmos-ref --size 128 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_cosmos_video_fixtures import moving_clip, reference_model  # noqa: E402  (sibling scripts)

from vqserve.model.families.cosmos.video import (  # noqa: E402
    PRESETS,
    CosmosVideoTokenizer,
    deterministic_video_weights,
)
from vqserve.model.mixed_precision import low_precision_encoder  # noqa: E402


def per_frame_agreement(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Share of equal tokens in each latent frame (``[1, t, h, w]``), in percent."""
    return [round(100.0 * float((a[:, i] == b[:, i]).float().mean()), 2) for i in range(a.shape[1])]


def cast(tok: CosmosVideoTokenizer, dtype: torch.dtype) -> CosmosVideoTokenizer:
    """The encoder a served bf16/fp16 runtime runs (``low_precision_encoder``: the residual
    branches' convolutions in ``dtype``, the stream, resamplers and attention in fp32)."""
    low = copy.deepcopy(tok)
    low.encoder, _ = low_precision_encoder(low.encoder, dtype)
    return low


def low_precision(tok: CosmosVideoTokenizer, clip: torch.Tensor, whole: torch.Tensor, dtype: torch.dtype):
    try:
        return per_frame_agreement(cast(tok, dtype).encode(clip).cpu(), whole)
    except (NotImplementedError, RuntimeError) as exc:  # CPU: avg_pool3d has no bf16/fp16 kernel
        return f"not run: {str(exc).splitlines()[0]}"


def measure(name: str, size: int, ref, device: str) -> dict:
    arch = PRESETS[name]
    tok = CosmosVideoTokenizer(arch).eval().to(device)
    weights = deterministic_video_weights(arch, 0)
    tok.load_state_dict(weights)
    weights = {k: v.to(device) for k, v in weights.items()}
    clip = torch.from_numpy(moving_clip(34, size, size, start=3))[None]
    chunk17 = tok.token_layout.with_policy(chunk_frames=17)
    started = time.perf_counter()
    whole = tok.encode(clip[:, :33]).cpu()
    seconds = time.perf_counter() - started
    chunked = tok.encode(clip, chunk17).cpu()
    first = 1 + 16 // arch.temporal_compression
    out = {"clip": f"34 frames {size}x{size}", "tokens_whole33": list(whole.shape[1:]),
           "tokens_chunked2x17": list(chunked.shape[1:]), "distinct_codes_whole": int(whole.unique().numel()),
           "fp32_encode_seconds_33_frames": round(seconds, 2),
           "chunked_first_window_equal_whole": bool(torch.equal(chunked[:, :first], whole[:, :first])),
           # the second window restarts causality at frame 17; the whole pass's latent frame j >= 1
           # covers frames 8j-7..8j (Tc=8), the window's j covers 17+8j-7..17+8j: one frame later
           "chunked_second_window_vs_whole_same_latent_index_pct": per_frame_agreement(
               chunked[:, first:first + whole.shape[1] - first], whole[:, first:])}
    for label, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out[f"{label}_vs_fp32_per_latent_frame_pct"] = low_precision(tok, clip[:, :33], whole, dtype)
    both = tok.encode(torch.cat([clip[:, :17], clip[:, 17:34]]))
    out["batch_invariant"] = bool(torch.equal(both[:1], tok.encode(clip[:, :17])) and
                                  torch.equal(both[1:], tok.encode(clip[:, 17:34])))
    if ref is not None:
        model = reference_model(ref, arch, weights).to(device)

        def run(m, frames, dtype=torch.float32):
            with torch.no_grad():
                return m.encode(ref.utils.numpy2tensor(frames.numpy(), dtype=dtype, device=device))[0].to(torch.int64).cpu()

        ref_whole = run(model, clip[:, :33])
        ref_chunks = torch.cat([run(model, clip[:, s:s + 17]) for s in (0, 17)], 1)
        out["fp32_equal_reference_whole"] = bool(torch.equal(whole, ref_whole))
        out["fp32_equal_reference_chunked"] = bool(torch.equal(chunked, ref_chunks))
        try:
            ref_bf16 = run(copy.deepcopy(model).to(dtype=torch.bfloat16), clip[:, :33], torch.bfloat16)
            out["reference_bf16_vs_its_fp32_per_latent_frame_pct"] = per_frame_agreement(ref_bf16, ref_whole)
        except (NotImplementedError, RuntimeError) as exc:
            out["reference_bf16_vs_its_fp32_per_latent_frame_pct"] = f"not run: {str(exc).splitlines()[0]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, default=None, help="Cosmos-Tokenizer checkout (outside the repo)")
    parser.add_argument("--size", type=int, default=128, help="frame side (default 128)")
    parser.add_argument("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ref = None
    if args.reference is not None:
        from make_cosmos_fixtures import import_reference

        ref = import_reference(args.reference.resolve())
    result = {"torch": torch.__version__, "threads": args.threads, "device": args.device,
              "machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    for name in args.models:
        result[name] = measure(name, args.size, ref, args.device)
        print(name, json.dumps(result[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
