"""serve/error_codes.py: every serving error's gRPC status and its byte on the split wire,
from the one table, the same in either layout; and the old homes still name them."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
import pytest

from vqserve.serve import error_codes as ec
from vqserve.serve.split import wire

C = grpc.StatusCode
ERRORS = [
    (ec.BadInput("images.shape", "must be [B,H,W,3]"), C.INVALID_ARGUMENT),
    (ValueError("bad"), C.INVALID_ARGUMENT),
    (ec.QueueFull("full"), C.RESOURCE_EXHAUSTED),
    (ec.ReplyTooLarge("too large"), C.RESOURCE_EXHAUSTED),
    (ec.DeviceOutOfMemory("out of memory"), C.RESOURCE_EXHAUSTED),
    (ec.DeadlineExpired("late"), C.DEADLINE_EXCEEDED),
    (ec.BatcherClosed("draining"), C.UNAVAILABLE),
    (ec.NotReady("loading"), C.UNAVAILABLE),
    (ec.NotFound("no such model"), C.NOT_FOUND),
]


@pytest.mark.parametrize(("exc", "code"), ERRORS, ids=lambda x: type(x).__name__ if isinstance(x, Exception) else "")
def test_each_error_gets_its_status_and_its_own_message(exc, code):
    assert ec.status_for(exc) == (code, str(exc))


def test_anything_else_is_internal_and_a_cancellation_cancelled():
    assert ec.status_for(KeyError("secret")) == (C.INTERNAL, "internal error (KeyError); see the server log")
    assert ec.status_for(asyncio.CancelledError()) == (C.CANCELLED, "cancelled")


@pytest.mark.parametrize(("exc", "code"), ERRORS, ids=lambda x: type(x).__name__ if isinstance(x, Exception) else "")
def test_what_crosses_the_wire_comes_back_with_the_same_status(exc, code):
    status, message = wire.status_of(exc)
    again = wire.error_of(status, message)
    if isinstance(exc, ec.NotReady | ec.NotFound):  # raised in front of the model only
        assert status == wire.FAILED and isinstance(again, RuntimeError)
        return
    assert type(again) is type(exc) and str(again) == str(exc)
    assert ec.status_for(again) == (code, str(exc))


def test_the_wire_bytes_are_those_of_before():
    """Front-end and executor are one install, but the bytes stay put all the same."""
    got = {kind.__name__: byte for kind, _, byte in ec.CODES if byte is not None}
    assert got == {"BadInput": 1, "QueueFull": 2, "DeadlineExpired": 3, "BatcherClosed": 4, "ReplyTooLarge": 5,
                   "ValueError": 8, "DeviceOutOfMemory": 9}
    assert (wire.OK, wire.CANCELLED, wire.FAILED) == (0, 6, 7)


def test_the_old_homes_name_the_same_classes():
    from vqserve.serve.api import codec, errors
    from vqserve.serve.engine import batcher, device_faults

    assert codec.BadInput is ec.BadInput
    assert (batcher.QueueFull, batcher.DeadlineExpired, batcher.BatcherClosed) == (
        ec.QueueFull, ec.DeadlineExpired, ec.BatcherClosed)
    assert device_faults.DeviceOutOfMemory is ec.DeviceOutOfMemory
    assert (errors.NotReady, errors.NotFound, errors.ReplyTooLarge, errors.status_for) == (
        ec.NotReady, ec.NotFound, ec.ReplyTooLarge, ec.status_for)


def test_it_stands_below_everything_it_serves():
    """No torch and nothing of vqserve: front-ends and clients import it."""
    tree = ast.parse(Path(ec.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "asyncio", "grpc"}, imported
