"""core/identity.py: one identity, four views, each the exact keys files already written carry."""

from vqserve.core.identity import folder_identity, recorded_identity, run_identity, same_tokens
from vqserve.core.runtime_info import RuntimeInfo

INFO = RuntimeInfo(backend="onnx", dtype="fp32", device="cuda:1", quantizer="fsq", codebook_size=64000, factor=8,
                   index_dtype="uint16", model_hash="f" * 64, source_hash="s" * 64, exact=True)


def test_the_served_view_names_files_source_dtype_backend_and_exactness():
    assert INFO.identity() == {"model_hash": "f" * 64, "source_hash": "s" * 64, "dtype": "fp32",
                               "backend": "onnx", "exact": True}


def test_a_tokenize_run_names_exact_tokens_by_their_checkpoint_and_others_by_their_files():
    info = INFO.to_dict()
    assert run_identity(info) == {"source_hash": "s" * 64, "dtype": "fp32", "exact": True, "device": "cuda"}
    lower = {**info, "exact": False, "dtype": "bf16"}
    assert run_identity(lower) == {"hash": "f" * 64, "backend": "onnx", "dtype": "bf16", "device": "cuda"}


def test_a_folder_is_named_without_its_device():
    manifest = {"model": {**INFO.identity(), "device": "cuda"}}
    assert folder_identity(manifest) == {"exact": True, "source_hash": "s" * 64, "dtype": "fp32"}


def test_the_recorded_view_keeps_the_model_fields_of_model_info_only():
    info = {**INFO.identity(), "codebook_size": 64000, "factor": 8, "max_pixels": 1 << 20, "device": "cuda"}
    recorded = recorded_identity(info)
    assert "max_pixels" not in recorded and "device" not in recorded
    assert recorded["codebook_size"] == 64000 and same_tokens(recorded, INFO)
