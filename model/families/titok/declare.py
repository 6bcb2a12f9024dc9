"""The TiTok family's declaration (``model/families/table.py`` reads it): ``vqserve import
titok``, and the tensors by which every other import recognises a TiTok state dict and names
this command. (A released folder also serves as it is: ``family.TITOK`` detects it.)"""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ForeignMark, ImportSpec, prose

# sorted(family.PRESETS), spelled out here so that the parser stays torch-free
# (tests/unit/model/test_titok_family.py checks they agree)
PRESET_NAMES = ("b64", "bl128_vq8k", "bl64_vq8k", "l32", "s128", "sl256_vq8k")

IMPORT = ImportSpec(
    command="titok",
    help="TiTok 1-D tokenizer (bytedance/1d-tokenizer VQ): config.json + model.safetensors",
    run="vqserve.model.families.titok.importer:run_import",
    description=prose("""
        Convert a released TiTok VQ tokenizer folder (yucornetto/tokenizer_titok_l32_imagenet,
        b64, s128, bl64/bl128/sl256_vq8k) into config.json + model.safetensors. Its tokens are a
        1-D sequence [B,L] for 256x256 images; indices equal TiTok's own in fp32; docs/MODELS.md."""),
    arguments=(
        Arg("source", metavar="FOLDER", help="the downloaded folder (config.json + model.safetensors)"),
        OUT,
        Arg("--config", choices=list(PRESET_NAMES), default=None, help="""
            check the config is this published architecture; default: whatever it describes"""),
    ),
    usage="""
  vqserve import titok tokenizer_titok_l32_imagenet/ --out models/titok-l32

TiTok's VQ tokenizers as released (yucornetto/tokenizer_titok_*: config.json and model.safetensors;
the folder also serves as it is); 1-D sequence tokens, 256x256 images.
""")

DECLARATION = Declaration(
    families="vqserve.model.families.titok.family:TITOK", imports=(IMPORT,),
    foreign=(ForeignMark("titok", "TiTok state dict (bytedance/1d-tokenizer: latent_tokens, a ViT encoder "
                                  "and decoder)",
                         tensors=("latent_tokens", "encoder.latent_token_positional_embedding")),))
