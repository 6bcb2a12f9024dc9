"""Convert a tokenizer checkpoint from the field into a vqserve model directory, once.

  vqserve import llamagen CHECKPOINT --out DIR [--config vq-16|vq-8] [--state-key KEY]
                          [--prefix PREFIX] [--force]

LlamaGen (github.com/FoundationVision/LlamaGen) publishes its VQ tokenizers as PyTorch
pickles; download one yourself, e.g. vq_ds16_c2i.pt or vq_ds8_c2i.pt from the
FoundationVision/LlamaGen repository on Hugging Face. The file is read with
torch.load(weights_only=True): tensors and plain values only, never code; a pickle that
names anything else is refused (a .safetensors CHECKPOINT is read as such). DIR gets
config.json + model.safetensors, written
atomically; every later command reads only those (no pickle again):

  vqserve import llamagen vq_ds16_c2i.pt --out models/llamagen-vq16
  vqserve serve --model models/llamagen-vq16
  vqserve export --model models/llamagen-vq16 --format onnx --out artifacts/llamagen-onnx

Indices equal LlamaGen's own code in fp32; its nearest-code search runs in fp32 whatever
dtype the networks run in (docs/MODELS.md). A diffusers VQModel directory needs no import:
pass it to --model as it is.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(parser: argparse.ArgumentParser) -> None:
    families = parser.add_subparsers(dest="family", metavar="FAMILY", required=True,
                                     parser_class=type(parser))
    llamagen = families.add_parser(
        "llamagen", help="a LlamaGen VQ-8 / VQ-16 .pt checkpoint",
        description="Convert a LlamaGen VQ checkpoint (.pt) into config.json + model.safetensors.",
        formatter_class=parser.formatter_class)
    llamagen.add_argument("checkpoint", metavar="CHECKPOINT",
                          help="LlamaGen .pt file, e.g. vq_ds16_c2i.pt or vq_ds8_c2i.pt")
    llamagen.add_argument("--out", required=True, metavar="DIR",
                          help="model directory to create; it must not exist yet")
    llamagen.add_argument("--config", choices=["vq-16", "vq-8"], default=None,
                          help="check the weights against this published architecture (VQ-16: ch_mult "
                               "1,1,2,2,4, factor 16; VQ-8: 1,2,2,4, factor 8); default: inferred "
                               "from the tensor shapes")
    llamagen.add_argument("--state-key", default=None, metavar="KEY",
                          help="which entry of the checkpoint holds the weights (default: 'model', as "
                               "LlamaGen's sampling scripts load it, else 'ema' / 'state_dict'); "
                               "pass 'ema' to import the EMA weights of a training checkpoint")
    llamagen.add_argument("--prefix", default=None, metavar="PREFIX",
                          help="import only the tensors whose names start with PREFIX (removed), for a "
                               "tokenizer stored inside a larger model: Janus keeps LlamaGen's VQ-16 "
                               "under 'gen_vision_model.' in a .safetensors shard")
    llamagen.add_argument("--force", action="store_true",
                          help="replace DIR if it is an earlier `vqserve import llamagen` output "
                               "(any other existing directory is never replaced)")
    llamagen.add_argument("--quiet", action="store_true", help="print nothing on success")
    llamagen.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on errors, also print the Python traceback")


def run(args: argparse.Namespace) -> int:
    from vqserve.model.checkpoint import load_tokenizer
    from vqserve.model.families.llamagen_import import import_llamagen

    # a checkpoint that cannot be imported raises ValueError: one line, exit status 2
    out, arch = import_llamagen(args.checkpoint, args.out, preset=args.config,
                                state_key=args.state_key, force=args.force, prefix=args.prefix)
    tokenizer = load_tokenizer(out)  # the written directory loads through the family registry
    if not args.quiet:
        print(f"imported LlamaGen VQ (factor {arch.factor}, {arch.codebook_size} codes x {arch.codebook_dim}, "
              f"{sum(p.numel() for p in tokenizer.parameters()) / 1e6:.1f}M parameters) -> {out}\n"
              f"serve it:  vqserve serve --model {out}", file=sys.stderr)
    return 0
