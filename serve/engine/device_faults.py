"""What a failed model call means for the serving process: its requests, or the process.

Most failures belong to the requests of the call (a model that refuses an input: the
batcher isolates the culprit and fails it alone). Two kinds of CUDA failure do not:

- **out of memory** on one call (``torch.OutOfMemoryError``, "CUDA out of memory", ONNX
  Runtime's "CUDA failure 2: out of memory"): the device is fine, this call was too big for
  what was free at that moment. The call's requests fail with RESOURCE_EXHAUSTED
  (:class:`DeviceOutOfMemory`: retry with backoff, or send fewer pixels) and the server keeps
  serving; running each request alone again would only repeat the allocation.
- **a poisoned context** (a device-side assert, an illegal memory access, a launch failure,
  an uncorrectable ECC error, a device that fell off the bus): CUDA errors are sticky, every
  later call on the context fails the same way, and nothing but a new process recovers. A
  server that went on would answer every request with INTERNAL while its health said
  SERVING. So the process logs ONE line (event ``device_poisoned``) and exits with
  :data:`POISONED_EXIT_STATUS` at once, without a drain that would run more calls on the
  broken context; the orchestrator starts it again (Kubernetes restarts the container, the
  front-end processes end with it, clients in flight see UNAVAILABLE and retry elsewhere).

Both are recognised by the exception's type name and text, the way torch and ONNX Runtime
report them, so this module needs no torch (front-end processes import the batcher's errors).
"""

from __future__ import annotations

import logging
import os

from vqserve.serve.error_codes import DeviceOutOfMemory  # its home, with its status code
from vqserve.serve.logs import event

# EX_SOFTWARE (sysexits.h): not a usage error, not a clean stop; anything non-zero restarts a pod
POISONED_EXIT_STATUS = 70

# The CUDA runtime's texts (cudaGetErrorString) of the errors that leave a context unusable,
# as torch ("CUDA error: <text>") and ONNX Runtime ("CUDA failure 700: <text>") quote them,
# with the enum names some libraries print instead.
_POISONED = (
    "device-side assert triggered", "illegal memory access", "unspecified launch failure",
    "illegal instruction", "misaligned address", "invalid program counter", "hardware stack error",
    "uncorrectable ecc error", "launch timed out and was terminated", "fallen off the bus",
    "gpu is lost", "device has been lost", "cuda error: unknown error",
    "cudaerrorassert", "cudaerrorillegaladdress", "cudaerrorlaunchfailure", "cudaerroreccuncorrectable",
    "cudaerrorillegalinstruction", "cudaerrormisalignedaddress", "cudaerrorhardwarestackerror",
    "cudaerrordevicesunavailable", "cuda_error_illegal_address", "cuda_error_launch_failed",
)
_OUT_OF_MEMORY = ("cuda out of memory", "cuda error: out of memory", "cuda failure 2: out of memory",
                  "cudaerrormemoryallocation", "cuda_error_out_of_memory")


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".lower()


def is_poisoned(exc: BaseException) -> bool:
    """Whether ``exc`` says the CUDA context can run nothing more (module docstring): one of
    those errors, named as coming from CUDA or a GPU (a CPU runtime's own "misaligned
    address" is not the device's)."""
    text = _text(exc)
    from_device = "cuda" in text or "gpu" in text or type(exc).__name__ == "AcceleratorError"
    return from_device and any(phrase in text for phrase in _POISONED)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device allocation failure of one call (not a host MemoryError)."""
    return type(exc).__name__ == "OutOfMemoryError" or any(phrase in _text(exc) for phrase in _OUT_OF_MEMORY)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The error's first line, as one log line holds it (torch appends lines of advice)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:limit]


def out_of_memory(exc: BaseException, rows: int) -> DeviceOutOfMemory:
    """The error the requests of a call of ``rows`` items that ran out of device memory get
    (logged once, as a warning: the server goes on)."""
    event("device_out_of_memory", f"a model call of {rows} items ran out of device memory ({first_line(exc)}); "
          "its requests get RESOURCE_EXHAUSTED", level=logging.WARNING, rows=rows, error=first_line(exc))
    return DeviceOutOfMemory(f"the device ran out of memory on the model call holding this request "
                             f"({first_line(exc, 200)}); retry with backoff or send fewer or smaller images")


def exit_poisoned(exc: BaseException) -> None:
    """Log one line and end the process now (``os._exit``: no drain, no more device calls)."""
    event("device_poisoned", f"the device context is unusable after a model call failed with {first_line(exc)}; "
          f"exiting with status {POISONED_EXIT_STATUS} so that the orchestrator restarts the server",
          level=logging.CRITICAL, error=first_line(exc), exit_status=POISONED_EXIT_STATUS)
    for handler in logging.getLogger("vqserve").handlers:
        handler.flush()
    os._exit(POISONED_EXIT_STATUS)
