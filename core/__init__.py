"""vqserve.core: the torch-free ground floor every other room stands on.

Standard library, numpy and Pillow only: what front-end processes, clients and decode
workers need without loading torch. One home per concept:

* ``runtime_info``: what a runtime is (``RuntimeInfo``, the ``Runtime`` interface);
* ``identity``: which tokens a runtime makes (``same_tokens``), the rule every reader applies;
* ``input_rules``: the input rules, in one wording, for the model, every runtime and the server;
* ``files``: atomic writes of directories (stage beside, rename);
* ``images``: image bytes -> the uint8 RGB pixels a tokenizer sees (the one preprocessing);
* ``machine``: CPU, cores and memory this process may use;
* ``shm``: pixels between processes through one shared arena;
* ``lifetime``: helper processes that never outlive their parent, signals as flags.

An import-linter contract keeps torch out of this package.
"""
