"""The SBER-MoVQGAN family's declaration (``model/families/table.py`` reads it): ``vqserve import movqgan``."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ImportSpec, prose

IMPORT = ImportSpec(
    command="movqgan",
    help="an SBER-MoVQGAN 67M / 102M / 270M .ckpt (ai-forever)",
    run="vqserve.model.families.movqgan.importer:run_import",
    description=prose("""
        Convert an SBER-MoVQGAN checkpoint (movqgan_67M.ckpt, _102M, _270M) into config.json +
        model.safetensors, read with torch.load(weights_only=True). The architecture is the
        published model whose tensors the file has, or --config YAML (configs/movqgan_*.yaml).
        Indices equal MoVQGAN's VectorQuantizer2 in fp32; docs/MODELS.md."""),
    arguments=(
        Arg("checkpoint", metavar="CHECKPOINT", help="""
            e.g. movqgan_270M.ckpt"""),
        OUT,
        Arg("--config", metavar="YAML", default=None, help="""
            the training yaml (model.params.ddconfig, n_embed, embed_dim); default: the published
            model the tensors match"""),
        Arg("--preset", choices=["67M", "102M", "270M"], default=None, help="""
            check the weights are this published model's"""),
    ),
    usage="""
  vqserve import movqgan movqgan_270M.ckpt --out models/movqgan-270m

SBER-MoVQGAN (ai-forever/MoVQGAN) comes as a .ckpt alone.
""")

DECLARATION = Declaration(families="vqserve.model.families.movqgan.family:MOVQGAN", imports=(IMPORT,))
