"""Print the vqserve version, torch build, devices and the runtimes available here.

Example:
  vqserve info
  vqserve info --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def collect() -> dict:
    """Gather facts cheaply: import only what is needed to report it."""
    import torch

    from vqserve import __version__

    facts: dict = {
        "vqserve": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "bf16_cpu": True,
        "cpu_threads": torch.get_num_threads(),
    }
    runtimes = {"eager": True, "torchscript": True, "pt2": hasattr(torch, "export")}
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime

        facts["onnxruntime"] = onnxruntime.__version__
        facts["onnxruntime_providers"] = onnxruntime.get_available_providers()
        runtimes["onnx"] = True
    else:
        runtimes["onnx"] = False
    facts["runtimes"] = runtimes
    try:
        from vqserve.model import default_tokenizer_available

        facts["default_tokenizer"] = default_tokenizer_available()
    except ImportError:
        facts["default_tokenizer"] = False
    return facts


def run(args: argparse.Namespace) -> int:
    facts = collect()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "none"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        print(f"{key:<{width}}  {value}")
    return 0
