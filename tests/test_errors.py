"""The error hierarchy: everything under KVPipeError, the ValueError / TimeoutError mix-ins,
and the attributes errors carry."""

from __future__ import annotations

import pytest

import kvpipe
from kvpipe import _errors

ALL_ERRORS = [
    kvpipe.ActorCrashed,
    kvpipe.BackendError,
    kvpipe.ConfigError,
    kvpipe.DeviceError,
    kvpipe.IncompleteRead,
    kvpipe.LayoutError,
    kvpipe.OperationTimeout,
    kvpipe.PipelineClosed,
    kvpipe.RequestError,
    kvpipe.Unsupported,
    kvpipe.WrongEventLoop,
]


def test_module_exports_every_error() -> None:
    assert set(_errors.__all__) == {e.__name__ for e in ALL_ERRORS} | {"KVPipeError"}
    for name in _errors.__all__:
        assert getattr(kvpipe, name) is getattr(_errors, name)


@pytest.mark.parametrize("cls", ALL_ERRORS)
def test_all_under_kvpipe_error(cls: type[Exception]) -> None:
    assert issubclass(cls, kvpipe.KVPipeError)
    assert cls is not kvpipe.KVPipeError


def test_root_is_exception() -> None:
    assert issubclass(kvpipe.KVPipeError, Exception)
    assert not issubclass(kvpipe.KVPipeError, ValueError)


@pytest.mark.parametrize("cls", [kvpipe.ConfigError, kvpipe.RequestError, kvpipe.LayoutError])
def test_value_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, ValueError)


def test_operation_timeout_is_timeout_error() -> None:
    assert issubclass(kvpipe.OperationTimeout, TimeoutError)
    with pytest.raises(TimeoutError):
        raise kvpipe.OperationTimeout("lookup took too long")


@pytest.mark.parametrize(
    "cls",
    [
        kvpipe.PipelineClosed,
        kvpipe.IncompleteRead,
        kvpipe.ActorCrashed,
        kvpipe.BackendError,
        kvpipe.DeviceError,
        kvpipe.Unsupported,
    ],
)
def test_others_are_not_value_or_timeout_errors(cls: type[Exception]) -> None:
    assert not issubclass(cls, ValueError)
    assert not issubclass(cls, TimeoutError)


def test_config_error_field_and_message() -> None:
    err = kvpipe.ConfigError("slice_timeout", "must be finite and > 0, got nan")
    assert err.field == "slice_timeout"
    assert str(err) == "slice_timeout: must be finite and > 0, got nan"


def test_incomplete_read_attributes() -> None:
    result = object()
    err = kvpipe.IncompleteRead("only 2 of 4 loaded", result, [2, 3])
    assert err.result is result
    assert err.failed_blocks == (2, 3)
    assert str(err) == "only 2 of 4 loaded"


def test_actor_crashed_attributes() -> None:
    err = kvpipe.ActorCrashed("writer", "writer crashed: boom")
    assert err.actor == "writer"
    assert str(err) == "writer crashed: boom"


def test_backend_error_attributes_and_chaining() -> None:
    cause = OSError("disk on fire")
    with pytest.raises(kvpipe.BackendError) as info:
        try:
            raise cause
        except OSError as exc:
            raise kvpipe.BackendError("file", "put", "write failed") from exc
    err = info.value
    assert err.backend == "file"
    assert err.operation == "put"
    assert str(err) == "file.put: write failed"
    assert err.__cause__ is cause


def test_catching_root_catches_all() -> None:
    for cls, args in [
        (kvpipe.RequestError, ("x",)),
        (kvpipe.PipelineClosed, ("x",)),
        (kvpipe.ConfigError, ("f", "x")),
        (kvpipe.ActorCrashed, ("a", "x")),
        (kvpipe.WrongEventLoop, ("x",)),
    ]:
        with pytest.raises(kvpipe.KVPipeError):
            raise cls(*args)


def test_a_call_from_the_wrong_loop_is_a_runtime_error() -> None:
    assert issubclass(kvpipe.WrongEventLoop, RuntimeError)
