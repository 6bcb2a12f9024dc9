"""The taming VQGAN family's declaration (``model/families/table.py`` reads it): ``vqserve import taming``."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ImportSpec, prose

IMPORT = ImportSpec(
    command="taming",
    help="a taming-transformers VQGAN or Meta's Chameleon VQGAN: .ckpt + its yaml",
    run="vqserve.model.families.taming.importer:run_import",
    description=prose("""
        Convert a taming-transformers VQGAN checkpoint (.ckpt) and the yaml published beside it
        (ImageNet f16-1024 / f16-16384, Meta's Chameleon vqgan.ckpt + vqgan.yaml) into config.json +
        model.safetensors. Every tensor is checked against the yaml before anything is written; the
        checkpoint is read with torch.load(weights_only=True), the yaml with yaml.safe_load. Indices
        equal taming's VectorQuantizer2 in fp32; docs/MODELS.md."""),
    arguments=(
        Arg("checkpoint", metavar="CHECKPOINT", help="""
            the .ckpt, e.g. vqgan.ckpt or last.ckpt"""),
        Arg("--config", metavar="YAML", default=None, help="""
            the model's yaml (model.params.ddconfig, n_embed, embed_dim), e.g. vqgan.yaml"""),
        OUT,
        Arg("--pixels", choices=["taming", "chameleon-transformers"], default=None, help="""
            how pixels are scaled before the encoder: taming (default; x/127.5-1, also Meta's
            Chameleon ImageTokenizer) or chameleon-transformers (transformers'
            ChameleonImageProcessor, x*0.0078-1: the tokens of vqserve's transformers-chameleon
            family); recorded in config.json and so in the served identity"""),
    ),
    usage="""
  vqserve import taming vqgan.ckpt --config vqgan.yaml --out models/chameleon-vqgan

taming-transformers VQGANs and Meta's Chameleon VQGAN come as a .ckpt and the yaml that
describes it.
""")

DECLARATION = Declaration(families="vqserve.model.families.taming.family:TAMING", imports=(IMPORT,))
