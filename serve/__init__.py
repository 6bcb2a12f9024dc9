"""vqserve.serve: the online server (gRPC v1 and Open Inference Protocol), in rooms:

* ``api/``: the protocol adapters (v1, OIP, health and reflection, interceptors, codecs);
* ``engine/``: the one serving path (engine, batcher, model threads, the plan it serves by,
  the model loaded in this process);
* ``split/``: the GPU-node layout (front-end processes, device executor, their pool and wire);
* ``clients/``: the Python clients;
* ``grpc_server``, ``launcher``, ``running``, ``config``, ``state``, ``metrics``, ``logs``,
  ``preflight``: one gRPC server, how processes are composed and run, and what they share;
  ``liveness``: when health says the model makes no progress.

The package itself is callable: ``vqserve.serve("default", port=0)`` starts the server in a
background thread of this process and returns it (:func:`vqserve.serve.launcher.serve_in_thread`),
the Python face of ``vqserve serve``.
"""

import sys
import types


class _CallableServe(types.ModuleType):
    """``vqserve.serve(...)``: the package, called, starts a server (``launcher.serve_in_thread``)."""

    def __call__(self, *args, **kwargs):
        # imported on call: a front-end process imports this package and must load no torch
        from vqserve.serve.launcher import serve_in_thread

        return serve_in_thread(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableServe
