"""vqserve.training: what makes and studies a tokenizer, never what serves one.

* ``trainer``: the training loop (mixed precision through the one precision policy, resumable);
  ``config`` what a run is asked to do, ``losses`` its loss terms and schedules, ``outputs``
  the metrics log and plots it writes;
* ``data``: image folders and built-in photographs as training batches;
* ``datasets``: the pinned Debian/pip package photographs (training, selection, test roles);
* ``precision_frontier``: the speed / agreement frontier of low-precision encoder policies.

Nothing the server, the batch tokenizer or an export imports lives here (an import-linter
contract); ``vqserve train`` and ``vqserve eval`` are its commands.
"""
