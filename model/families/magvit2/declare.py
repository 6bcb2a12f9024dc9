"""The Open-MAGVIT2 family's declaration (``model/families/table.py`` reads it): ``vqserve import magvit2``."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ImportSpec, ema_weights, prose

IMPORT = ImportSpec(
    command="magvit2",
    help="an Open-MAGVIT2 (TencentARC SEED-Voken) LFQ tokenizer, Lightning .ckpt",
    run="vqserve.model.families.magvit2.importer:run_import",
    description=prose("""
        Convert an Open-MAGVIT2 Lightning checkpoint (.ckpt) into config.json + model.safetensors.
        Read with torch.load(weights_only=True): tensors and plain values only, a pickle that holds
        more is refused. Indices equal Open-MAGVIT2's own (LFQ, channel k = bit k); docs/MODELS.md."""),
    arguments=(
        Arg("checkpoint", metavar="CHECKPOINT", help="""
            Open-MAGVIT2 .ckpt, e.g. imagenet_256_L.ckpt (or a .safetensors state dict)"""),
        OUT,
        Arg("--config", choices=["imagenet-256", "imagenet-128", "pretrain-262144", "pretrain-16384"], default=None, help="""
            check the weights against this published architecture; default: inferred from the tensor
            shapes"""),
        ema_weights("Open-MAGVIT2"),
    ),
    usage="""
  vqserve import magvit2 imagenet_256_L.ckpt --out models/open-magvit2-256

Open-MAGVIT2 (TencentARC SEED-Voken) publishes Lightning .ckpt files on Hugging Face
(TencentARC/Open-MAGVIT2-Tokenizer-256-resolution, ...); read the same way, EMA weights by
default (as its own evaluation scripts run them).
""")

DECLARATION = Declaration(families="vqserve.model.families.magvit2.family:MAGVIT2", imports=(IMPORT,))
