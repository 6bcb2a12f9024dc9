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
