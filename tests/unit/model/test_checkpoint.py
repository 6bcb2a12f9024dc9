"""Checkpoints: a directory of config.json + model.safetensors, reloaded exactly, no pickle."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_tokenizer
from vqserve.model import default_tokenizer_available, load_tokenizer, save_tokenizer
from vqserve.model.checkpoint import read_config


@pytest.mark.parametrize("quantizer", ["fsq", "lfq", "vq", "rfsq"])
def test_save_load_identical_outputs(tmp_path, quantizer):
    tok = make_tokenizer(quantizer=quantizer, lfq_dim=8, vq_codebook_size=64, vq_dim=4)
    path = save_tokenizer(tok, tmp_path / "ckpt", extra={"step": 7})
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_tokenizer(path)
    images = torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8)
    assert torch.equal(loaded.encode(images), tok.encode(images))
    assert torch.equal(loaded.decode(tok.encode(images)), tok.decode(tok.encode(images)))
    config, meta = read_config(path)
    assert config == tok.config and meta == {"step": 7}


def test_checkpoint_dir_has_normal_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = save_tokenizer(make_tokenizer(), tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755  # not mkdtemp's private 0700


def test_files_are_not_pickles(tmp_path):
    path = save_tokenizer(make_tokenizer(), tmp_path / "ckpt")
    raw = (path / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    assert "encoder.conv_in.weight" in header
    assert raw[:2] != b"PK"  # not torch.save's zip container
    assert raw[0] != 0x80  # not a pickle stream (PROTO opcode)


def test_overwrite_is_atomic_and_leaves_no_temp_dirs(tmp_path):
    save_tokenizer(make_tokenizer(seed=0), tmp_path / "ckpt")
    save_tokenizer(make_tokenizer(seed=1), tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    images = torch.randint(0, 256, (1, 16, 16, 3), dtype=torch.uint8)
    assert torch.equal(load_tokenizer(tmp_path / "ckpt").encode(images), make_tokenizer(seed=1).encode(images))


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_tokenizer(tmp_path / "empty")
    path = save_tokenizer(make_tokenizer(), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["channels"] = [16, 32, 16]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not match config.json"):
        load_tokenizer(path)
    cfg["format"] = "something-else"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a vqserve tokenizer config"):
        load_tokenizer(path)


@pytest.mark.parametrize("damage, file, says", [
    (lambda b: b"junk\n", "model.safetensors", "not a readable safetensors file (Error while deserializing header"),
    (lambda b: b[:len(b) // 2], "model.safetensors", "not a readable safetensors file (Error while deserializing header"),
    (lambda b: b"\x80\x02}q\x00.", "model.safetensors", "not a readable safetensors file"),  # a pickle: never run
    (lambda b: b"{bad json", "config.json", "not readable JSON (Expecting property name"),
    (lambda b: b"[1, 2]", "config.json", "holds a JSON list, not an object"),
])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(damage, file, says, tmp_path, capsys):
    # before: "SafetensorError: Error while deserializing header: header too small (unexpected;
    # ...)" and a JSON error with no file named, from serve, tokenize, plan, export alike
    path = save_tokenizer(make_tokenizer(), tmp_path / "ckpt")
    (path / file).write_bytes(damage((path / file).read_bytes()))
    with pytest.raises(ValueError) as err:
        load_tokenizer(path)
    line = str(err.value)
    assert line.startswith(f"{path / file}: {says}") and "\n" not in line, line
    assert line.endswith("copy it again, or save it again with `vqserve train` (which writes config and weights together)")
    from vqserve.cli import main

    assert main(["tokenize", str(tmp_path), "--out", str(tmp_path / "tokens"), "--model", str(path)]) == 2
    assert capsys.readouterr().err.strip().endswith(line)
    assert not (tmp_path / "tokens").exists()


@pytest.mark.parametrize("argv", [
    ["eval", "--model", "synthetic:0", "--images", "{tmp}", "--out", "{tmp}/eval"],
    ["export", "--model", "synthetic:200", "--format", "onnx", "--out", "{tmp}/onnx"],
    ["train", "--init-from", "synthetic:0", "--steps", "1", "--out", "{tmp}/run"],
])
def test_the_stand_in_where_a_network_is_needed_is_named_as_such(argv, tmp_path, capsys):
    # before: "model 'synthetic:0' does not exist", though serve and tokenize take it
    from vqserve.cli import main

    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    line = capsys.readouterr().err.strip()
    assert "is the simulated accelerator (serve, tokenize, plan and bench take it): it has no network" in line
    assert "\n" not in line and list(tmp_path.iterdir()) == []


def test_the_shipped_names_are_the_same_for_the_cli_and_the_loader():
    from vqserve.commands.common import PACKAGED_MODEL_NAMES
    from vqserve.model.checkpoint import PACKAGED_MODELS, packaged_model_dir, resolve_model_path

    assert PACKAGED_MODEL_NAMES == PACKAGED_MODELS == ("default", "dithered")
    with pytest.raises(ValueError, match="no shipped tokenizer is called 'v4'"):
        packaged_model_dir("v4")
    with pytest.raises(FileNotFoundError, match="'default', 'dithered' or a checkpoint directory"):
        resolve_model_path("v4")


@pytest.mark.skipif(not default_tokenizer_available(), reason="model/ weights absent in this checkout")
def test_dithered_is_the_shipped_dithered_tokenizer_with_the_same_network():
    tok, dithered = load_tokenizer("default"), load_tokenizer("dithered")
    assert tok.config.dither == "none" and dithered.config.dither == "bayer4"
    assert tok.config == dataclasses.replace(dithered.config, dither="none")
    from vqserve.commands.common import UsageError, check_model_exists, model_ref

    check_model_exists("dithered")      # a name, not a path: accepted before anything loads
    assert model_ref("dithered") == "dithered"   # and recorded as such in manifests
    with pytest.raises(UsageError, match="`dithered`"):
        check_model_exists("dithred")


def test_default_resolves_or_says_why():
    if default_tokenizer_available():
        tok = load_tokenizer("default")
        assert tok.factor == 8 and tok.codebook_size >= 1000
    else:
        with pytest.raises(FileNotFoundError, match="default tokenizer weights are not in this install"):
            load_tokenizer("default")


@pytest.mark.parametrize("storage", ["fp16", "bf16"])
@pytest.mark.parametrize("quantizer", ["fsq", "vq"])
def test_16_bit_network_storage_halves_the_file_and_loads_as_fp32(tmp_path, quantizer, storage):
    tok = make_tokenizer(quantizer=quantizer, **({"vq_codebook_size": 64, "vq_dim": 4} if quantizer == "vq" else {}))
    half_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[storage]
    full = save_tokenizer(tok, tmp_path / "fp32")
    half = save_tokenizer(tok, tmp_path / storage, network_storage=storage)
    assert (half / "model.safetensors").stat().st_size < 0.6 * (full / "model.safetensors").stat().st_size
    stored = load_file(str(half / "model.safetensors"))
    assert stored["encoder.conv_in.weight"].dtype == half_dtype
    if quantizer == "vq":  # the quantizer's state is the fp32 island: never rounded
        assert stored["quantizer.embed"].dtype == torch.float32
        assert torch.equal(stored["quantizer.embed"], tok.state_dict()["quantizer.embed"])
    back = load_tokenizer(half)
    assert back.encoder.conv_in.weight.dtype == torch.float32
    # exactly the rounded weights, nothing else
    want = tok.encoder.conv_in.weight.detach().to(half_dtype).float()
    assert torch.equal(back.encoder.conv_in.weight, want)
    assert json.loads((half / "config.json").read_text())["meta"]["network_storage"] == storage
    with pytest.raises(ValueError, match="network_storage"):
        save_tokenizer(tok, tmp_path / "x", network_storage="int8")
