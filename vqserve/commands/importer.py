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

  vqserve import magvit2 imagenet_256_L.ckpt --out models/open-magvit2-256

Open-MAGVIT2 (TencentARC SEED-Voken) publishes Lightning .ckpt files on Hugging Face
(TencentARC/Open-MAGVIT2-Tokenizer-256-resolution, ...); read the same way, EMA weights by
default (as its own evaluation scripts run them). IBQ's (TencentARC/IBQ-Tokenizer-262144, ...)
import the same way:

  vqserve import ibq imagenet256_262144.ckpt --out models/ibq-262144

  vqserve import cosmos pretrained_ckpts/Cosmos-0.1-Tokenizer-DI8x8 --out models/cosmos-di8x8

NVIDIA Cosmos-Tokenizer DI8x8 / DI16x16 (nvidia/Cosmos-0.1-Tokenizer-DI8x8, -DI16x16 on
Hugging Face) ship as TorchScript .jit files; only their tensors are read, nothing in them runs.

  vqserve import var vae_ch160v4096z32.pth --out models/var-vae

FoundationVision VAR's VQ-VAE (FoundationVision/var on Hugging Face) is a plain state dict; its
tokens are a multi-scale pyramid [B, L] (680 per 256x256 image), not a grid.
  vqserve import showo magvitv2/ --out models/showo-magvitv2

Show-o / MMaDA's MAGVIT-v2 (showlab/magvitv2 on Hugging Face: config.json and
pytorch_model.safetensors; LFQ 13 bits, most significant bit first).

  vqserve import emu35 Emu3.5-VisionTokenizer/ --out models/emu35-vision

Emu3.5's VisionTokenizer (BAAI/Emu3.5-VisionTokenizer: config.yaml and model.ckpt, read with
yaml.safe_load and torch.load(weights_only=True)); an IBQ model with 131,072 x 256 codes.
  vqserve import taming vqgan.ckpt --config vqgan.yaml --out models/chameleon-vqgan
  vqserve import movqgan movqgan_270M.ckpt --out models/movqgan-270m

taming-transformers VQGANs and Meta's Chameleon VQGAN come as a .ckpt and the yaml that
describes it; SBER-MoVQGAN (ai-forever/MoVQGAN) as a .ckpt alone.

  vqserve import maskgit maskgit-vqgan-imagenet-f16-256/ --out models/maskgit-vqgan

MaskGIT-VQGAN as open-muse released it (openMUSE/maskgit-vqgan-imagenet-f16-256: config.json and
pytorch_model.bin, read with torch.load(weights_only=True)); 1,024 codes, factor 16.

  vqserve import titok tokenizer_titok_l32_imagenet/ --out models/titok-l32

TiTok's VQ tokenizers as released (yucornetto/tokenizer_titok_*: config.json and model.safetensors;
the folder also serves as it is); 1-D sequence tokens, 256x256 images.
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
    _add_out(llamagen)
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
    _add_force_quiet_debug(llamagen, "llamagen", " (any other existing directory is never replaced)")
    _add_magvit2(families, parser)
    _add_cosmos(families, parser)
    _add_var(families, parser)
    _add_showo(families, parser)
    _add_emu35(families, parser)
    _add_taming(families, parser)
    _add_movqgan(families, parser)
    _add_maskgit(families, parser)
    _add_titok(families, parser)


def _add_magvit2(families, parser: argparse.ArgumentParser) -> None:
    magvit2 = families.add_parser(
        "magvit2", help="an Open-MAGVIT2 (TencentARC SEED-Voken) LFQ tokenizer, Lightning .ckpt",
        description="Convert an Open-MAGVIT2 Lightning checkpoint (.ckpt) into config.json + model.safetensors. "
                    "Read with torch.load(weights_only=True): tensors and plain values only, a pickle that holds "
                    "more is refused. Indices equal Open-MAGVIT2's own (LFQ, channel k = bit k); docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    magvit2.add_argument("checkpoint", metavar="CHECKPOINT",
                         help="Open-MAGVIT2 .ckpt, e.g. imagenet_256_L.ckpt (or a .safetensors state dict)")
    _add_out(magvit2)
    magvit2.add_argument("--config", choices=["imagenet-256", "imagenet-128", "pretrain-262144", "pretrain-16384"],
                         default=None, help="check the weights against this published architecture; default: "
                                            "inferred from the tensor shapes")
    _add_lightning_weights(magvit2, "Open-MAGVIT2")
    _add_force_quiet_debug(magvit2, "magvit2")
    magvit2.set_defaults(_import=_run_magvit2)
    _add_ibq(families, parser)


def _run_magvit2(args: argparse.Namespace) -> int:
    from vqserve.model.families.magvit2.importer import import_magvit2

    out, arch, used = import_magvit2(args.checkpoint, args.out, preset=args.config, weights=args.weights,
                                     force=args.force)
    return _report(out, f"Open-MAGVIT2 ({used} weights; factor {arch.factor}, LFQ {arch.z_channels} bits = "
                        f"{arch.codebook_size:,} codes", args.quiet)


def _add_ibq(families, parser: argparse.ArgumentParser) -> None:
    ibq = families.add_parser(
        "ibq", help="an IBQ (TencentARC SEED-Voken) tokenizer, Lightning .ckpt",
        description="Convert an IBQ Lightning checkpoint (.ckpt) into config.json + model.safetensors. Read with "
                    "torch.load(weights_only=True): tensors and plain values only, a pickle that holds more is "
                    "refused. Indices equal IBQ's own (max of softmax(z . codebook), the lowest index among "
                    "equal probabilities); docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    ibq.add_argument("checkpoint", metavar="CHECKPOINT",
                     help="IBQ .ckpt, e.g. imagenet256_262144.ckpt (or a .safetensors state dict)")
    _add_out(ibq)
    ibq.add_argument("--config", default=None, metavar="NAME",
                     choices=["imagenet-1024", "imagenet-8192", "imagenet-16384", "imagenet-262144",
                              "pretrain-16384", "pretrain-262144"],
                     help="check the weights against this published configuration (imagenet-1024, -8192, -16384, "
                          "-262144, pretrain-16384, -262144); default: inferred from the tensor shapes")
    _add_lightning_weights(ibq, "IBQ")
    _add_force_quiet_debug(ibq, "ibq")
    ibq.set_defaults(_import=_run_ibq)


def _run_ibq(args: argparse.Namespace) -> int:
    from vqserve.model.families.ibq.importer import import_ibq

    out, arch, used = import_ibq(args.checkpoint, args.out, preset=args.config, weights=args.weights,
                                 force=args.force)
    return _report(out, f"IBQ ({used} weights; factor {arch.factor}, {arch.codebook_size:,} codes x "
                        f"{arch.codebook_dim}", args.quiet)


def _add_cosmos(families, parser: argparse.ArgumentParser) -> None:
    cosmos = families.add_parser(
        "cosmos", help="NVIDIA Cosmos-Tokenizer DI8x8 / DI16x16 (FSQ): the published .jit files",
        description="Convert a Cosmos-Tokenizer DI model into config.json + model.safetensors. SOURCE is the "
                    "folder downloaded from nvidia/Cosmos-0.1-Tokenizer-DI8x8 (or -DI16x16), or its encoder.jit "
                    "and decoder.jit, or autoencoder.jit; a state dict (.pt, torch.load(weights_only=True)) or "
                    ".safetensors in Cosmos's names also works. TorchScript files are read without being run: "
                    "only their tensors are taken, and an archive whose pickle names anything but TorchScript "
                    "modules and tensors is refused. Indices equal Cosmos's own FSQ in fp32; docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    cosmos.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="the downloaded model folder, or encoder.jit decoder.jit, or autoencoder.jit")
    _add_out(cosmos)
    cosmos.add_argument("--config", choices=["DI8x8", "DI16x16"], default=None,
                        help="check the weights against this published architecture; default: inferred "
                             "from the tensor shapes")
    _add_force_quiet_debug(cosmos, "cosmos")
    cosmos.set_defaults(_import=_run_cosmos)


def _run_cosmos(args: argparse.Namespace) -> int:
    from vqserve.model.families.cosmos.importer import import_cosmos

    out, arch = import_cosmos(args.sources, args.out, preset=args.config, force=args.force)
    return _report(out, f"Cosmos DI (factor {arch.factor}, FSQ {arch.levels} = {arch.codebook_size:,} codes",
                   args.quiet)


def _add_var(families, parser: argparse.ArgumentParser) -> None:
    var = families.add_parser(
        "var", help="FoundationVision VAR's multi-scale VQ-VAE (vae_ch160v4096z32.pth): pyramid tokens",
        description="Convert VAR's VQ-VAE state dict (a plain torch.save, read with torch.load(weights_only=True)) "
                    "into config.json + model.safetensors. Its tokens are a pyramid: one flat sequence per image, "
                    "coarse to fine (680 for 256x256 with scales 1,2,3,4,5,6,8,10,13,16), VAR's own "
                    "torch.cat(img_to_idxBl(x), 1). Served sizes follow VAR's rule (256, 512, 1024); "
                    "docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    var.add_argument("checkpoint", metavar="CHECKPOINT", help="VAR's VAE state dict, e.g. vae_ch160v4096z32.pth")
    _add_out(var)
    var.add_argument("--scales", action="append", default=None, metavar="[SIZE:]S1,S2,...",
                     help="the scales the model was trained with for SIZE x SIZE images (default SIZE 256; "
                          "repeatable), in place of VAR's rule for that size; the last scale must be the "
                          "latent size (SIZE / 16 for the released VAE)")
    _add_force_quiet_debug(var, "var")
    var.set_defaults(_import=_run_var)


def _run_var(args: argparse.Namespace) -> int:
    from vqserve.model.families.var.importer import import_var, parse_scales

    scales = dict(parse_scales(text) for text in args.scales) if args.scales else None
    out, arch = import_var(args.checkpoint, args.out, scales=scales, force=args.force)
    sizes = ", ".join(f"{s[-1] * arch.factor}" for s in arch.schedules)
    return _report(out, f"VAR (factor {arch.factor}, {arch.vocab_size:,} codes x {arch.z_channels}, pyramid "
                        f"tokens for {sizes} pixel images", args.quiet)
def _add_showo(families, parser: argparse.ArgumentParser) -> None:
    showo = families.add_parser(
        "showo", help="Show-o / MMaDA's MAGVIT-v2 (showlab/magvitv2): config.json + pytorch_model.safetensors",
        description="Convert showlab/magvitv2 (Show-o, MMaDA) into config.json + model.safetensors. SOURCE is the "
                    "downloaded folder, or its config.json and pytorch_model.safetensors. Safetensors only: nothing "
                    "is unpickled. Every tensor is checked by name and shape, and the LFQ buffers against Show-o's "
                    "index convention (13 bits, most significant bit first); docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    showo.add_argument("sources", nargs="+", metavar="SOURCE",
                       help="the downloaded showlab/magvitv2 folder, or config.json pytorch_model.safetensors")
    _add_out(showo)
    showo.add_argument("--config", choices=["magvitv2"], default=None,
                       help="check the weights against the published architecture; default: inferred from the "
                            "tensor shapes")
    _add_force_quiet_debug(showo, "showo")
    showo.set_defaults(_import=_run_showo)


def _run_showo(args: argparse.Namespace) -> int:
    from vqserve.model.families.showo.importer import import_showo

    out, arch = import_showo(args.sources, args.out, preset=args.config, force=args.force)
    return _report(out, f"Show-o MAGVIT-v2 (factor {arch.factor}, LFQ {arch.z_channels} bits = "
                        f"{arch.codebook_size:,} codes, most significant bit first", args.quiet)


def _add_emu35(families, parser: argparse.ArgumentParser) -> None:
    emu35 = families.add_parser(
        "emu35", help="Emu3.5's VisionTokenizer (IBQ, 131,072 codes): config.yaml + model.ckpt",
        description="Convert Emu3.5's VisionTokenizer (BAAI/Emu3.5-VisionTokenizer) into config.json + "
                    "model.safetensors of the IBQ family. SOURCE is the downloaded folder, or its config.yaml and "
                    "model.ckpt (or a .safetensors state dict). The config is read with yaml.safe_load and the "
                    "weights with torch.load(weights_only=True): a pickle that holds more than weights is refused. "
                    "Every tensor is checked against the architecture the config describes; docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    emu35.add_argument("sources", nargs="+", metavar="SOURCE",
                       help="the downloaded Emu3.5-VisionTokenizer folder, or config.yaml model.ckpt")
    _add_out(emu35)
    emu35.add_argument("--config", choices=["emu3.5"], default=None,
                       help="check the config is the published one (131,072 x 256 codes, factor 16)")
    _add_force_quiet_debug(emu35, "emu35")
    emu35.set_defaults(_import=_run_emu35)


def _run_emu35(args: argparse.Namespace) -> int:
    from vqserve.model.families.ibq.emu35 import import_emu35

    out, arch = import_emu35(args.sources, args.out, preset=args.config, force=args.force)
    return _report(out, f"Emu3.5 VisionTokenizer (IBQ; factor {arch.factor}, {arch.codebook_size:,} codes x "
                        f"{arch.codebook_dim}", args.quiet)


def _add_taming(families, parser: argparse.ArgumentParser) -> None:
    taming = families.add_parser(
        "taming", help="a taming-transformers VQGAN or Meta's Chameleon VQGAN: .ckpt + its yaml",
        description="Convert a taming-transformers VQGAN checkpoint (.ckpt) and the yaml published beside it "
                    "(ImageNet f16-1024 / f16-16384, Meta's Chameleon vqgan.ckpt + vqgan.yaml) into config.json "
                    "+ model.safetensors. Every tensor is checked against the yaml before anything is written; "
                    "the checkpoint is read with torch.load(weights_only=True), the yaml with yaml.safe_load. "
                    "Indices equal taming's VectorQuantizer2 in fp32; docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    taming.add_argument("checkpoint", metavar="CHECKPOINT", help="the .ckpt, e.g. vqgan.ckpt or last.ckpt")
    taming.add_argument("--config", metavar="YAML", default=None,
                        help="the model's yaml (model.params.ddconfig, n_embed, embed_dim), e.g. vqgan.yaml")
    _add_out(taming)
    taming.add_argument("--pixels", choices=["taming", "chameleon-transformers"], default=None,
                        help="how pixels are scaled before the encoder: taming (default; x/127.5-1, also "
                             "Meta's Chameleon ImageTokenizer) or chameleon-transformers (transformers' "
                             "ChameleonImageProcessor, x*0.0078-1: the tokens of vqserve's transformers-chameleon "
                             "family); recorded in config.json and so in the served identity")
    _add_force_quiet_debug(taming, "taming")
    taming.set_defaults(_import=_run_taming)


def _run_taming(args: argparse.Namespace) -> int:
    from vqserve.model.families.taming.importer import import_taming

    out, arch = import_taming(args.checkpoint, args.out, args.config, pixels=args.pixels, force=args.force)
    return _report(out, f"taming VQGAN (factor {arch.factor}, {arch.codebook_size:,} codes x {arch.codebook_dim}, "
                        f"pixels {arch.pixels}", args.quiet)


def _add_movqgan(families, parser: argparse.ArgumentParser) -> None:
    movqgan = families.add_parser(
        "movqgan", help="an SBER-MoVQGAN 67M / 102M / 270M .ckpt (ai-forever)",
        description="Convert an SBER-MoVQGAN checkpoint (movqgan_67M.ckpt, _102M, _270M) into config.json + "
                    "model.safetensors, read with torch.load(weights_only=True). The architecture is the "
                    "published model whose tensors the file has, or --config YAML (configs/movqgan_*.yaml). "
                    "Indices equal MoVQGAN's VectorQuantizer2 in fp32; docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    movqgan.add_argument("checkpoint", metavar="CHECKPOINT", help="e.g. movqgan_270M.ckpt")
    _add_out(movqgan)
    movqgan.add_argument("--config", metavar="YAML", default=None,
                         help="the training yaml (model.params.ddconfig, n_embed, embed_dim); default: the "
                              "published model the tensors match")
    movqgan.add_argument("--preset", choices=["67M", "102M", "270M"], default=None,
                         help="check the weights are this published model's")
    _add_force_quiet_debug(movqgan, "movqgan")
    movqgan.set_defaults(_import=_run_movqgan)


def _run_movqgan(args: argparse.Namespace) -> int:
    from vqserve.model.families.movqgan.importer import import_movqgan

    out, arch = import_movqgan(args.checkpoint, args.out, args.config, preset=args.preset, force=args.force)
    return _report(out, f"SBER-MoVQGAN (factor {arch.factor}, {arch.codebook_size:,} codes x {arch.codebook_dim}",
                   args.quiet)


def _add_maskgit(families, parser: argparse.ArgumentParser) -> None:
    maskgit = families.add_parser(
        "maskgit", help="MaskGIT-VQGAN (open-muse's MaskGitVQGAN): config.json + pytorch_model.bin",
        description="Convert openMUSE/maskgit-vqgan-imagenet-f16-256 (open-muse's port of Google's MaskGIT "
                    "tokenizer) into config.json + model.safetensors. SOURCE is the downloaded folder, or its "
                    "weights file (pytorch_model.bin, or a .safetensors) with config.json beside it. The weights are "
                    "read with torch.load(weights_only=True); every config key and tensor is checked before "
                    "anything is written. Indices equal MaskGitVQGAN's own in fp32; docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    maskgit.add_argument("source", metavar="SOURCE",
                         help="the downloaded folder, or its pytorch_model.bin (config.json beside it)")
    _add_out(maskgit)
    maskgit.add_argument("--config", choices=["imagenet-f16-256"], default=None,
                         help="check the config is the published architecture; default: whatever it describes")
    _add_force_quiet_debug(maskgit, "maskgit")
    maskgit.set_defaults(_import=_run_maskgit)


def _run_maskgit(args: argparse.Namespace) -> int:
    from vqserve.model.families.maskgit.importer import import_maskgit

    out, arch = import_maskgit(args.source, args.out, preset=args.config, force=args.force)
    return _report(out, f"MaskGIT-VQGAN (factor {arch.factor}, {arch.num_embeddings:,} codes x "
                        f"{arch.quantized_embed_dim}, pixels {arch.pixels}", args.quiet)


def _add_titok(families, parser: argparse.ArgumentParser) -> None:
    from vqserve.model.families.titok.family import PRESETS

    titok = families.add_parser(
        "titok", help="TiTok 1-D tokenizer (bytedance/1d-tokenizer VQ): config.json + model.safetensors",
        description="Convert a released TiTok VQ tokenizer folder (yucornetto/tokenizer_titok_l32_imagenet, "
                    "b64, s128, bl64/bl128/sl256_vq8k) into config.json + model.safetensors. Its tokens are a 1-D "
                    "sequence [B,L] for 256x256 images; indices equal TiTok's own in fp32; docs/MODELS.md.",
        formatter_class=parser.formatter_class)
    titok.add_argument("source", metavar="FOLDER", help="the downloaded folder (config.json + model.safetensors)")
    _add_out(titok)
    titok.add_argument("--config", choices=sorted(PRESETS), default=None,
                       help="check the config is this published architecture; default: whatever it describes")
    _add_force_quiet_debug(titok, "titok")
    titok.set_defaults(_import=_run_titok)


def _run_titok(args: argparse.Namespace) -> int:
    from vqserve.model.families.titok.importer import import_titok

    out, arch = import_titok(args.source, args.out, preset=args.config, force=args.force)
    return _report(out, f"TiTok ({arch.num_latent_tokens} tokens per {arch.image_size}x{arch.image_size} image, "
                        f"{arch.codebook_size:,} codes x {arch.token_size}", args.quiet)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_import", None) is not None:  # families that name their own runner
        return args._import(args)
    from vqserve.model.families.llamagen.importer import import_llamagen

    # a checkpoint that cannot be imported raises ValueError: one line, exit status 2
    out, arch = import_llamagen(args.checkpoint, args.out, preset=args.config,
                                state_key=args.state_key, force=args.force, prefix=args.prefix)
    return _report(out, f"LlamaGen VQ (factor {arch.factor}, {arch.codebook_size} codes x {arch.codebook_dim}",
                   args.quiet)


def _add_out(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--out", required=True, metavar="DIR", help="model directory to create; it must not exist yet")


def _add_lightning_weights(sub: argparse.ArgumentParser, project: str) -> None:
    """``--weights`` of the SEED-Voken Lightning checkpoints (Open-MAGVIT2, IBQ), which hold
    both the trained and the EMA weights."""
    sub.add_argument("--weights", choices=["auto", "ema", "raw"], default="auto",
                     help=f"auto (default): the EMA weights when the checkpoint has them, as {project}'s "
                          "evaluation and reconstruction scripts use them (ema_scope); raw: the trained weights")


def _add_force_quiet_debug(sub: argparse.ArgumentParser, family: str, note: str = "") -> None:
    """The options every import shares, after its own: ``--force`` replaces only an earlier
    import of the same family (the importer checks), ``--quiet``, ``--debug``."""
    sub.add_argument("--force", action="store_true",
                     help=f"replace DIR if it is an earlier `vqserve import {family}` output{note}")
    sub.add_argument("--quiet", action="store_true", help="print nothing on success")
    sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                     help="on errors, also print the Python traceback")


def _report(out, summary: str, quiet: bool) -> int:
    """Load the written directory through the family registry (so a directory that would not
    serve fails here, not later) and say what was imported: ``summary`` is the family's facts."""
    from vqserve.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(out)
    if not quiet:
        print(f"imported {summary}, {sum(p.numel() for p in tokenizer.parameters()) / 1e6:.1f}M parameters) "
              f"-> {out}\nserve it:  vqserve serve --model {out}", file=sys.stderr)
    return 0
