"""The VAR family's declaration (``model/families/table.py`` reads it): ``vqserve import var``."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ImportSpec, prose

IMPORT = ImportSpec(
    command="var",
    help="FoundationVision VAR's multi-scale VQ-VAE (vae_ch160v4096z32.pth): pyramid tokens",
    run="vqserve.model.families.var.importer:run_import",
    description=prose("""
        Convert VAR's VQ-VAE state dict (a plain torch.save, read with
        torch.load(weights_only=True)) into config.json + model.safetensors. Its tokens are a
        pyramid: one flat sequence per image, coarse to fine (680 for 256x256 with scales
        1,2,3,4,5,6,8,10,13,16), VAR's own torch.cat(img_to_idxBl(x), 1). Served sizes follow VAR's
        rule (256, 512, 1024); docs/MODELS.md."""),
    arguments=(
        Arg("checkpoint", metavar="CHECKPOINT", help="""
            VAR's VAE state dict, e.g. vae_ch160v4096z32.pth"""),
        OUT,
        Arg("--scales", action="append", default=None, metavar="[SIZE:]S1,S2,...", help="""
            the scales the model was trained with for SIZE x SIZE images (default SIZE 256;
            repeatable), in place of VAR's rule for that size; the last scale must be the latent
            size (SIZE / 16 for the released VAE)"""),
    ),
    usage="""
  vqserve import var vae_ch160v4096z32.pth --out models/var-vae

FoundationVision VAR's VQ-VAE (FoundationVision/var on Hugging Face) is a plain state dict; its
tokens are a multi-scale pyramid [B, L] (680 per 256x256 image), not a grid.
""")

DECLARATION = Declaration(families="vqserve.model.families.var.family:VAR", imports=(IMPORT,))
