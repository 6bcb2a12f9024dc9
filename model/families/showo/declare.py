"""The Show-o MAGVIT-v2 family's declaration (``model/families/table.py`` reads it):
``vqserve import showo``, and the ``config.json`` class by which other imports send its
checkpoints here."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ForeignMark, ImportSpec, prose

IMPORT = ImportSpec(
    command="showo",
    help="Show-o / MMaDA's MAGVIT-v2 (showlab/magvitv2): config.json + pytorch_model.safetensors",
    run="vqserve.model.families.showo.importer:run_import",
    description=prose("""
        Convert showlab/magvitv2 (Show-o, MMaDA) into config.json + model.safetensors. SOURCE is the
        downloaded folder, or its config.json and pytorch_model.safetensors. Safetensors only:
        nothing is unpickled. Every tensor is checked by name and shape, and the LFQ buffers against
        Show-o's index convention (13 bits, most significant bit first); docs/MODELS.md."""),
    arguments=(
        Arg("sources", nargs="+", metavar="SOURCE", help="""
            the downloaded showlab/magvitv2 folder, or config.json pytorch_model.safetensors"""),
        OUT,
        Arg("--config", choices=["magvitv2"], default=None, help="""
            check the weights against the published architecture; default: inferred from the tensor
            shapes"""),
    ),
    usage="""
  vqserve import showo magvitv2/ --out models/showo-magvitv2

Show-o / MMaDA's MAGVIT-v2 (showlab/magvitv2 on Hugging Face: config.json and
pytorch_model.safetensors; LFQ 13 bits, most significant bit first).
""")

DECLARATION = Declaration(
    families="vqserve.model.families.showo.family:SHOWO", imports=(IMPORT,),
    foreign=(ForeignMark("showo", "Show-o's MAGVITv2", config_class="MAGVITv2"),))
