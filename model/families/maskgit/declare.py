"""The MaskGIT-VQGAN family's declaration (``model/families/table.py`` reads it):
``vqserve import maskgit``, and the tensors and ``config.json`` class by which every other
import recognises its checkpoints and names this command."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ForeignMark, ImportSpec, prose

IMPORT = ImportSpec(
    command="maskgit",
    help="MaskGIT-VQGAN (open-muse's MaskGitVQGAN): config.json + pytorch_model.bin",
    run="vqserve.model.families.maskgit.importer:run_import",
    description=prose("""
        Convert openMUSE/maskgit-vqgan-imagenet-f16-256 (open-muse's port of Google's MaskGIT
        tokenizer) into config.json + model.safetensors. SOURCE is the downloaded folder, or its
        weights file (pytorch_model.bin, or a .safetensors) with config.json beside it. The weights
        are read with torch.load(weights_only=True); every config key and tensor is checked before
        anything is written. Indices equal MaskGitVQGAN's own in fp32; docs/MODELS.md."""),
    arguments=(
        Arg("source", metavar="SOURCE", help="""
            the downloaded folder, or its pytorch_model.bin (config.json beside it)"""),
        OUT,
        Arg("--config", choices=["imagenet-f16-256"], default=None, help="""
            check the config is the published architecture; default: whatever it describes"""),
    ),
    usage="""
  vqserve import maskgit maskgit-vqgan-imagenet-f16-256/ --out models/maskgit-vqgan

MaskGIT-VQGAN as open-muse released it (openMUSE/maskgit-vqgan-imagenet-f16-256: config.json and
pytorch_model.bin, read with torch.load(weights_only=True)); 1,024 codes, factor 16.
""")

DECLARATION = Declaration(
    families="vqserve.model.families.maskgit.family:MASKGIT", imports=(IMPORT,),
    foreign=(ForeignMark("maskgit", "MaskGIT-VQGAN state dict (open-muse's MaskGitVQGAN: "
                                    "decoder.up.N.upsample_conv, no quant_conv)",
                         tensors=("decoder.up.1.upsample_conv.weight", "encoder.mid.0.conv1.weight")),
             ForeignMark("maskgit", "open-muse's MaskGitVQGAN", config_class="MaskGitVQGAN")))
