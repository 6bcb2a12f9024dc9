"""The LlamaGen family's declaration (``model/families/table.py`` reads it): ``vqserve import llamagen``."""

from __future__ import annotations

from vqserve.model.families.declaration import OUT, Arg, Declaration, ImportSpec, prose

IMPORT = ImportSpec(
    command="llamagen",
    help="a LlamaGen VQ-8 / VQ-16 .pt checkpoint",
    run="vqserve.model.families.llamagen.importer:run_import",
    description=prose("""
        Convert a LlamaGen VQ checkpoint (.pt) into config.json + model.safetensors."""),
    arguments=(
        Arg("checkpoint", metavar="CHECKPOINT", help="""
            LlamaGen .pt file, e.g. vq_ds16_c2i.pt or vq_ds8_c2i.pt"""),
        OUT,
        Arg("--config", choices=["vq-16", "vq-8"], default=None, help="""
            check the weights against this published architecture (VQ-16: ch_mult 1,1,2,2,4, factor
            16; VQ-8: 1,2,2,4, factor 8); default: inferred from the tensor shapes"""),
        Arg("--state-key", default=None, metavar="KEY", help="""
            which entry of the checkpoint holds the weights (default: 'model', as LlamaGen's
            sampling scripts load it, else 'ema' / 'state_dict'); pass 'ema' to import the EMA
            weights of a training checkpoint"""),
        Arg("--prefix", default=None, metavar="PREFIX", help="""
            import only the tensors whose names start with PREFIX (removed), for a tokenizer stored
            inside a larger model: Janus keeps LlamaGen's VQ-16 under 'gen_vision_model.' in a
            .safetensors shard"""),
    ),
    force_note=" (any other existing directory is never replaced)",
    usage="""
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
""")

DECLARATION = Declaration(families="vqserve.model.families.llamagen.family:LLAMAGEN", imports=(IMPORT,))
