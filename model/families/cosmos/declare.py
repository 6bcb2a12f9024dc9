"""The Cosmos-Tokenizer family's declaration (``model/families/table.py`` reads it): ``vqserve import cosmos``."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ImportSpec, prose

IMPORT = ImportSpec(
    command="cosmos",
    help="NVIDIA Cosmos-Tokenizer DI8x8 / DI16x16 and DV4x8x8 / DV8x8x8 / DV8x16x16 (FSQ): the published .jit files",
    run="vqserve.model.families.cosmos.importer:run_import",
    description=prose("""
        Convert a Cosmos-Tokenizer DI model into config.json + model.safetensors. SOURCE is the
        folder downloaded from nvidia/Cosmos-0.1-Tokenizer-DI8x8 (or -DI16x16), or its encoder.jit
        and decoder.jit, or autoencoder.jit; a state dict (.pt, torch.load(weights_only=True)) or
        .safetensors in Cosmos's names also works. TorchScript files are read without being run:
        only their tensors are taken, and an archive whose pickle names anything but TorchScript
        modules and tensors is refused. Indices equal Cosmos's own FSQ in fp32; docs/MODELS.md.
        A DV (video) model's compression is not in its tensors: name it with --config."""),
    arguments=(
        Arg("sources", nargs="+", metavar="SOURCE", help="""
            the downloaded model folder, or encoder.jit decoder.jit, or autoencoder.jit"""),
        OUT,
        Arg("--config", choices=["DI8x8", "DI16x16", "DV4x8x8", "DV8x8x8", "DV8x16x16"], default=None, help="""
            DI: check the weights against this published architecture (default: inferred from the
            tensor shapes); DV: required, the compression the tensors cannot show"""),
        Arg("--chunk-frames", type=int, default=None, metavar="N", help="""
            DV: encode clips as independent N-frame windows (N = 1 + k*T; 17 as Cosmos's
            CausalVideoTokenizer, 33 as its AR stack); default 0, the whole clip in one pass.
            Part of the model's identity"""),
        Arg("--pad", choices=["none", "cosmos"], default=None, help="""
            DV: none (default) refuses clips off the frame rule; cosmos pads them as NVIDIA's
            pad_video_batch (zeros to a multiple of 16, first/last frames repeated)"""),
    ),
    usage="""
  vqserve import cosmos pretrained_ckpts/Cosmos-0.1-Tokenizer-DI8x8 --out models/cosmos-di8x8
  vqserve import cosmos pretrained_ckpts/Cosmos-1.0-Tokenizer-DV8x16x16 --config DV8x16x16 --out models/dv8x16x16

NVIDIA Cosmos-Tokenizer DI8x8 / DI16x16 (nvidia/Cosmos-0.1-Tokenizer-DI8x8, -DI16x16 on
Hugging Face) ship as TorchScript .jit files; only their tensors are read, nothing in them runs.
""")

DECLARATION = Declaration(families="vqserve.model.families.cosmos.video:FAMILIES", imports=(IMPORT,))
