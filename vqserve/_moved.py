"""Old import paths, kept working for one release after the layout step moved them.

The layout step gave every concept one home (``vqserve.core``, subpackages of ``export``,
``serve``, ``model``; ``vqserve.training``). Code that imports a module by its old name
still gets the very same module object, with a ``DeprecationWarning`` naming the new home,
until the next release removes this table. One finder answers for every old name, at the
end of ``sys.meta_path`` so it never shadows a real module; TorchServe archives built
before, whose handler imports old names, keep loading too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> its new home
MOVED: dict[str, str] = {
    "vqserve.identity": "vqserve.core.identity",
    "vqserve.images": "vqserve.core.images",
    "vqserve.lifetime": "vqserve.core.lifetime",
    "vqserve.machine": "vqserve.core.machine",
    "vqserve.shm": "vqserve.core.shm",
    "vqserve.model.atomic": "vqserve.core.files",
    "vqserve.model.rules": "vqserve.core.input_rules",
    "vqserve.export.info": "vqserve.core.runtime_info",
    "vqserve.model.training": "vqserve.training.trainer",
    "vqserve.model.data": "vqserve.training.data",
    "vqserve.model.datasets": "vqserve.training.datasets",
    "vqserve.model.precision_frontier": "vqserve.training.precision_frontier",
    "vqserve.model.bench": "vqserve.bench.quantizers",
    "vqserve.model.families.cosmos_import": "vqserve.model.families.cosmos.importer",
    "vqserve.model.families.cosmos_networks": "vqserve.model.families.cosmos.networks",
    "vqserve.model.families.cosmos_precision": "vqserve.model.families.cosmos.precision",
    "vqserve.model.families.ibq_import": "vqserve.model.families.ibq.importer",
    "vqserve.model.families.ibq_precision": "vqserve.model.families.ibq.precision",
    "vqserve.model.families.ibq_quantizer": "vqserve.model.quantizers.softmax_max",
    "vqserve.model.families.llamagen_import": "vqserve.model.families.llamagen.importer",
    "vqserve.model.families.llamagen_networks": "vqserve.model.families.llamagen.networks",
    "vqserve.model.families.llamagen_precision": "vqserve.model.families.llamagen.precision",
    "vqserve.model.families.llamagen_quantizer": "vqserve.model.quantizers.l2_nearest",
    "vqserve.model.families.magvit2_import": "vqserve.model.families.magvit2.importer",
    "vqserve.model.families.magvit2_networks": "vqserve.model.families.magvit2.networks",
    "vqserve.model.families.magvit2_precision": "vqserve.model.families.magvit2.precision",
    "vqserve.model.families.transformers_vq": "vqserve.model.families.transformers.family",
    "vqserve.model.families.transformers_quantizer": "vqserve.model.quantizers.squared_distance",
    "vqserve.model.families.diffusers_vq": "vqserve.model.families.diffusers.family",
    "vqserve.model.families.vqserve_native": "vqserve.model.families.native.family",
    "vqserve.model.families.codebook": "vqserve.model.quantizers.cdist",
    "vqserve.export.runtime": "vqserve.export.runtimes.loader",
    "vqserve.export.cuda_graphs": "vqserve.export.runtimes.cuda_graphs",
    "vqserve.export.synthetic": "vqserve.export.runtimes.synthetic",
    "vqserve.export.execution": "vqserve.export.runtimes.execution",
    "vqserve.export.determinism": "vqserve.export.runtimes.determinism",
    "vqserve.export.checks": "vqserve.core.input_rules",
    "vqserve.export.wrappers": "vqserve.export.formats.wrappers",
    "vqserve.export.torchscript": "vqserve.export.formats.torchscript",
    "vqserve.export.onnx_export": "vqserve.export.formats.onnx",
    "vqserve.export.pt2": "vqserve.export.formats.pt2",
    "vqserve.export.manifest": "vqserve.export.formats.manifest",
    "vqserve.export.inspect_graph": "vqserve.export.formats.inspect_graph",
    "vqserve.export.planner": "vqserve.export.plan",
    "vqserve.export.torchserve_handler": "vqserve.export.torchserve.handler",
    "vqserve.export.torchserve_server": "vqserve.export.torchserve.server",
    "vqserve.export.bench": "vqserve.bench.runtimes",
    "vqserve.export.plan_bench": "vqserve.bench.plan",
    "vqserve.serve.service_v1": "vqserve.serve.api.v1",
    "vqserve.serve.service_oip": "vqserve.serve.api.oip",
    "vqserve.serve.rawrequest": "vqserve.serve.api.rawrequest",
    "vqserve.serve.codec": "vqserve.serve.api.codec",
    "vqserve.serve.decoding": "vqserve.serve.api.decoding",
    "vqserve.serve.errors": "vqserve.serve.api.errors",
    "vqserve.serve.gates": "vqserve.serve.api.gates",
    "vqserve.serve.discovery": "vqserve.serve.api.discovery",
    "vqserve.serve.batcher": "vqserve.serve.engine.batcher",
    "vqserve.serve.model_threads": "vqserve.serve.engine.model_threads",
    "vqserve.serve.serving_plan": "vqserve.serve.engine.serving_plan",
    "vqserve.serve.planning": "vqserve.serve.engine.planning",
    "vqserve.serve.frontend": "vqserve.serve.split.frontend",
    "vqserve.serve.executor": "vqserve.serve.split.executor",
    "vqserve.serve.listeners": "vqserve.serve.grpc_listeners",
    "vqserve.serve.split.listeners": "vqserve.serve.grpc_listeners",
    "vqserve.serve.wire": "vqserve.serve.split.wire",
    "vqserve.serve.client": "vqserve.serve.clients",
    "vqserve.serve.client_batches": "vqserve.serve.clients.batches",
    "vqserve.serve.server": "vqserve.serve.launcher",
    "vqserve.data": "vqserve.offline.token_shards",
}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new_name}; the old name goes in the next "
                      "vqserve release", DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new_name)

    def exec_module(self, module) -> None:
        """The module is the new home's, already executed."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Answers only for the old names in :data:`MOVED`."""

    def find_spec(self, fullname, path=None, target=None):
        new_name = MOVED.get(fullname)
        if new_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new_name))


def install() -> None:
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
