"""The IBQ family's declaration (``model/families/table.py`` reads it): ``vqserve import ibq``
and ``vqserve import emu35`` (Emu3.5's VisionTokenizer is an IBQ model)."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ImportSpec, ema_weights, prose

IBQ_IMPORT = ImportSpec(
    command="ibq",
    help="an IBQ (TencentARC SEED-Voken) tokenizer, Lightning .ckpt",
    run="vqserve.model.families.ibq.importer:run_import",
    description=prose("""
        Convert an IBQ Lightning checkpoint (.ckpt) into config.json + model.safetensors. Read with
        torch.load(weights_only=True): tensors and plain values only, a pickle that holds more is
        refused. Indices equal IBQ's own (max of softmax(z . codebook), the lowest index among equal
        probabilities); docs/MODELS.md."""),
    arguments=(
        Arg("checkpoint", metavar="CHECKPOINT", help="""
            IBQ .ckpt, e.g. imagenet256_262144.ckpt (or a .safetensors state dict)"""),
        OUT,
        Arg("--config", default=None, metavar="NAME", choices=["imagenet-1024", "imagenet-8192", "imagenet-16384", "imagenet-262144", "pretrain-16384", "pretrain-262144"], help="""
            check the weights against this published configuration (imagenet-1024, -8192, -16384,
            -262144, pretrain-16384, -262144); default: inferred from the tensor shapes"""),
        ema_weights("IBQ"),
    ),
    usage="""
IBQ's (TencentARC/IBQ-Tokenizer-262144, ...) import the same way as Open-MAGVIT2's:

  vqserve import ibq imagenet256_262144.ckpt --out models/ibq-262144
""")

EMU35_IMPORT = ImportSpec(
    command="emu35",
    help="Emu3.5's VisionTokenizer (IBQ, 131,072 codes): config.yaml + model.ckpt",
    run="vqserve.model.families.ibq.emu35:run_import",
    description=prose("""
        Convert Emu3.5's VisionTokenizer (BAAI/Emu3.5-VisionTokenizer) into config.json +
        model.safetensors of the IBQ family. SOURCE is the downloaded folder, or its config.yaml and
        model.ckpt (or a .safetensors state dict). The config is read with yaml.safe_load and the
        weights with torch.load(weights_only=True): a pickle that holds more than weights is
        refused. Every tensor is checked against the architecture the config describes;
        docs/MODELS.md."""),
    arguments=(
        Arg("sources", nargs="+", metavar="SOURCE", help="""
            the downloaded Emu3.5-VisionTokenizer folder, or config.yaml model.ckpt"""),
        OUT,
        Arg("--config", choices=["emu3.5"], default=None, help="""
            check the config is the published one (131,072 x 256 codes, factor 16)"""),
    ),
    usage="""
  vqserve import emu35 Emu3.5-VisionTokenizer/ --out models/emu35-vision

Emu3.5's VisionTokenizer (BAAI/Emu3.5-VisionTokenizer: config.yaml and model.ckpt, read with
yaml.safe_load and torch.load(weights_only=True)); an IBQ model with 131,072 x 256 codes.
""")

DECLARATION = Declaration(families="vqserve.model.families.ibq.family:IBQ", imports=(IBQ_IMPORT, EMU35_IMPORT))
