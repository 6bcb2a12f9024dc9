"""Export a tokenizer to TorchScript, ONNX or torch.export, with the quantizer kept in fp32.

Writes encode and decode graphs (uint8 NHWC pixels in -> indices out; indices in -> uint8
pixels out; dynamic batch, height and width) and a manifest.json recording format, dtype,
sha256 of each file and the parity measured against the fp32 eager model on real
photographs. An export whose index agreement falls below --min-agreement (default 100%
for fp32, 99% otherwise), or whose decode drifts below --min-decode-psnr from the fp32
decode, fails (exit 2) and leaves nothing under --out.

Examples:
  vqserve export --model default --format onnx --dtype fp32 --out artifacts/onnx-fp32
  vqserve export --model default --format pt2 --dtype bf16 --out artifacts/pt2-bf16
  vqserve export --model runs/tok --format torchscript --dtype bf16 --min-agreement 0.97 --out out/ts

What runs where: onnx supports fp32 and fp16 (bf16 is refused: no onnxruntime kernels);
onnxruntime's CPU provider runs fp16 graphs in fp32, so fp16 parity measured on CPU is not
fp16 parity. torchscript and pt2 support fp32, bf16 and fp16 (fp16 is slow on CPUs).

--format torchserve writes TorchServe model archives instead (vqserve-encode.mar,
vqserve-decode.mar, an example config.properties, manifest.json; docs/TORCHSERVE.md):
  vqserve export --model default --format torchserve --batch-size 8 --max-batch-delay-ms 5 --out ts/
  vqserve export --model artifacts/onnx-fp32 --format torchserve --out ts-onnx/
--model may then also be an artifact directory; --backend picks the runtime inside the archive.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (the shipped tokenizer), 'dithered' (the shipped dithered one) or a model directory (vqserve checkpoint, "
                        "diffusers VQModel, imported LlamaGen: docs/MODELS.md)")
    parser.add_argument("--format", required=True, choices=["torchscript", "onnx", "pt2", "torchserve"],
                        dest="fmt", help="artifact format (torchserve: TorchServe model archives)")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                        help="dtype of the encoder/decoder networks (the quantizer is always fp32; "
                             "default fp32, or an artifact's own dtype for --format torchserve)")
    parser.add_argument("--out", required=True, help="artifact directory to write (replaced only on success)")
    parser.add_argument("--min-agreement", type=float, default=None,
                        help="fail when index agreement with fp32 eager is below this fraction "
                             "(default: 1.0 for fp32, 0.99 for bf16/fp16)")
    parser.add_argument("--min-decode-psnr", type=float, default=30.0,
                        help="fail when the decode of eager's tokens is further than this PSNR (dB) "
                             "from eager fp32's decode (default 30; catches fp16 overflow)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda[:N] or auto: where to export and measure parity (default cpu); "
                             "for torchserve, where the handler runs (default auto: the GPU "
                             "TorchServe assigns to the worker, else cpu)")
    parser.add_argument("--parity-size", type=int, default=128, help="side of the validation tiles (default 128)")
    parser.add_argument("--parity-count", type=int, default=0,
                        help="number of validation tiles (default 0: all of them, 18 at 128px)")
    stream = parser.add_mutually_exclusive_group()
    stream.add_argument("--fp32-stream", dest="fp32_stream", action="store_true", default=None,
                        help="run only the encoder's residual-branch convolutions in --dtype; keep "
                             "its residual stream, norms, stem, downsample and final projection in "
                             "fp32 (default: on for bf16 and fp16; on whole photos it lifts token "
                             "agreement from ~97.8%% to ~99.3%% in bf16 and ~99.73%% to ~99.91%% in fp16)")
    stream.add_argument("--no-fp32-stream", dest="fp32_stream", action="store_false",
                        help="cast the whole encoder to --dtype")
    parser.add_argument("--opset", type=int, default=None,
                        help="ONNX opset for --format onnx (default 18); one the exporter cannot "
                             "write faithfully (here below 18 or above onnxscript's converter "
                             "range) is refused before export, and the written files are checked")
    ts = parser.add_argument_group("torchserve (--format torchserve only)")
    ts.add_argument("--backend", default="auto", choices=["auto", "eager", "torchscript", "onnx", "pt2"],
                    help="runtime inside the archive: auto (eager for a checkpoint, the artifact's "
                         "format for an artifact directory), eager, or an export format (the "
                         "checkpoint is exported first, parity-checked)")
    ts.add_argument("--batch-size", type=int, default=8,
                    help="TorchServe batch size the archives default to (default 8)")
    ts.add_argument("--max-batch-delay-ms", type=int, default=5,
                    help="TorchServe max batch delay the archives default to (default 5 ms)")
    parser.add_argument("--allow-batch-variance", action="store_true",
                        help="write the artifact even if its tokens change with the batch on "
                             "this device (refused by default; the manifest's 'determinism' says so)")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    from vqserve.export.exporter import export_model

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[export] {msg}", file=sys.stderr, flush=True)

    if args.fmt == "torchserve":
        return _run_torchserve(args, log)
    try:
        manifest = export_model(args.model, args.fmt, args.dtype or "fp32", args.out,
                                min_agreement=args.min_agreement, device=args.device or "cpu",
                                parity_size=args.parity_size, parity_count=args.parity_count,
                                opset=args.opset, fp32_stream=args.fp32_stream,
                                min_decode_psnr=args.min_decode_psnr,
                                allow_batch_variance=args.allow_batch_variance, log=log)
    except ImportError as exc:  # a missing optional dependency (scikit-image, onnx...)
        print(f"vqserve export: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    p = manifest["parity"]
    print(f"wrote {args.out}: {manifest['format']} {manifest['dtype']} "
          f"({manifest['encode']}, {manifest['decode']}, manifest.json)")
    print(f"index agreement with fp32 eager: {p['index_agreement']:.4%} of {p['positions']} tokens "
          f"(required {p['min_agreement']:.2%}); codebook utilization {p['codebook_utilization']:.3f}; "
          f"PSNR {p['psnr_db']} dB (eager fp32 {p['reference_psnr_db']} dB)")
    if "note" in p:
        print(f"note: {p['note']}")
    if "determinism" in manifest:
        from vqserve.core.certificate import Certificate

        print(Certificate(**manifest["determinism"]).summary())
    return 0


def _run_torchserve(args: argparse.Namespace, log) -> int:
    """``--format torchserve``: two TorchServe archives around the same runtime."""
    from vqserve.export.torchserve.archives import build_archives

    try:
        manifest = build_archives(args.model, args.out, backend=args.backend, dtype=args.dtype,
                                  batch_size=args.batch_size,
                                  max_batch_delay_ms=args.max_batch_delay_ms,
                                  device=args.device or "auto", log=log,
                                  export_options=dict(
                                      min_agreement=args.min_agreement, parity_size=args.parity_size,
                                      parity_count=args.parity_count, opset=args.opset,
                                      fp32_stream=args.fp32_stream,
                                      min_decode_psnr=args.min_decode_psnr))
    except (ImportError, RuntimeError) as exc:  # torch-model-archiver missing or failing
        print(f"vqserve export: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    names = ", ".join(a["file"] for a in manifest["archives"].values())
    print(f"wrote {args.out}: {names}, config.properties, manifest.json "
          f"({manifest['backend']} {manifest['dtype']}, model sha256 {manifest['model_hash'][:16]}..., "
          f"batch size {args.batch_size}, max batch delay {args.max_batch_delay_ms} ms)")
    return 0
