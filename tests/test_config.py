"""PipelineConfig: validation at construction, ``ConfigError.field``, and ``from_env`` with
KVPIPE_ variables, FastDeploy fallbacks, bool parsing and overrides."""

from __future__ import annotations

import dataclasses
import math
import socket
from typing import Any

import pytest

import kvpipe
from kvpipe import ConfigError, PipelineConfig

INT_FIELDS = [
    "slice_block_num",
    "staging_bytes",
    "queue_depth",
    "copy_threads",
    "io_threads",
    "max_restarts",
]
FLOAT_FIELDS = [
    "slice_timeout",
    "total_timeout",
    "lookup_timeout",
    "restart_window",
    "deadline_slack",
    "close_timeout",
]


def test_field_lists_are_complete() -> None:
    types = {f.name: f.type for f in dataclasses.fields(PipelineConfig)}
    ints = sorted(n for n, t in types.items() if t == "int" and n != "worker_nice")
    assert ints == sorted(INT_FIELDS) and types["worker_nice"] == "int"
    assert sorted(n for n, t in types.items() if t == "float") == sorted(FLOAT_FIELDS)
    assert types["verify_checksums"] == "bool"
    assert types["node_id"] == "str"


@pytest.mark.parametrize("bad", [-1, 20, True, "3", 2.0, None])
def test_worker_nice_is_0_to_19(bad: Any) -> None:
    assert PipelineConfig(worker_nice=0).worker_nice == 0
    assert PipelineConfig(worker_nice=19).worker_nice == 19
    with pytest.raises(ConfigError) as info:
        PipelineConfig(worker_nice=bad)
    assert info.value.field == "worker_nice"


def test_defaults_valid() -> None:
    cfg = PipelineConfig()
    assert cfg.slice_block_num == 500
    assert cfg.slice_timeout == 10.0
    assert cfg.total_timeout == 30.0
    assert cfg.verify_checksums is True
    assert cfg.node_id == socket.gethostname()
    assert cfg.staging_bytes > 0


def test_issue_example() -> None:
    cfg = PipelineConfig(slice_block_num=500, slice_timeout=10.0, total_timeout=30.0)
    assert (cfg.slice_block_num, cfg.slice_timeout, cfg.total_timeout) == (500, 10.0, 30.0)


@pytest.mark.parametrize("bad", [0, -1, True, False, "3", 2.0, None])
@pytest.mark.parametrize("name", INT_FIELDS)
def test_int_fields_reject(name: str, bad: Any) -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig(**{name: bad})
    assert info.value.field == name
    assert name in str(info.value)


@pytest.mark.parametrize("name", INT_FIELDS)
def test_int_fields_accept_one(name: str) -> None:
    assert getattr(PipelineConfig(**{name: 1}), name) == 1


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, "3", None])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_float_fields_reject(name: str, bad: Any) -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig(**{name: bad})
    assert info.value.field == name


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("good", [1, 0.001, 1e6])
def test_float_fields_accept_positive_numbers(name: str, good: float) -> None:
    assert getattr(PipelineConfig(**{name: good}), name) == good


@pytest.mark.parametrize("bad", [1, 0, "true", None])
def test_verify_checksums_must_be_bool(bad: Any) -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig(verify_checksums=bad)
    assert info.value.field == "verify_checksums"


@pytest.mark.parametrize("bad", ["", "   ", 3, None, "pod@7", "pod 7", "pod\n7", "pod\t7"])
def test_node_id_must_be_non_empty_string(bad: Any) -> None:
    """A node id is one printable word without ``@``: stores build record names as
    ``<key>@<node>`` (Mooncake's residency index), and a line break or a space breaks
    Mooncake's node registry and the logs that name the node."""
    with pytest.raises(ConfigError) as info:
        PipelineConfig(node_id=bad)
    assert info.value.field == "node_id"


def test_config_error_is_value_error_and_kvpipe_error() -> None:
    with pytest.raises(ValueError):
        PipelineConfig(slice_block_num=0)
    with pytest.raises(kvpipe.KVPipeError):
        PipelineConfig(slice_block_num=0)


def test_frozen_and_replace_revalidates() -> None:
    cfg = PipelineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.slice_block_num = 3  # type: ignore[misc]
    assert cfg.replace(slice_block_num=3).slice_block_num == 3
    assert cfg.slice_block_num == 500
    with pytest.raises(ConfigError) as info:
        cfg.replace(total_timeout=-1.0)
    assert info.value.field == "total_timeout"


# ---------------------------------------------------------------- from_env


def test_from_env_empty_is_defaults() -> None:
    assert PipelineConfig.from_env(environ={}) == PipelineConfig()


def test_from_env_reads_kvpipe_variables() -> None:
    cfg = PipelineConfig.from_env(
        environ={
            "KVPIPE_SLICE_BLOCK_NUM": "7",
            "KVPIPE_SLICE_TIMEOUT": "2.5",
            "KVPIPE_TOTAL_TIMEOUT": " 12 ",
            "KVPIPE_LOOKUP_TIMEOUT": "0.5",
            "KVPIPE_STAGING_BYTES": "1048576",
            "KVPIPE_QUEUE_DEPTH": "3",
            "KVPIPE_COPY_THREADS": "5",
            "KVPIPE_IO_THREADS": "6",
            "KVPIPE_NODE_ID": "node-7",
            "KVPIPE_MAX_RESTARTS": "9",
            "KVPIPE_RESTART_WINDOW": "30",
            "KVPIPE_DEADLINE_SLACK": "0.1",
            "KVPIPE_VERIFY_CHECKSUMS": "false",
            "KVPIPE_CLOSE_TIMEOUT": "4",
            "UNRELATED": "x",
        }
    )
    assert cfg == PipelineConfig(
        slice_block_num=7,
        slice_timeout=2.5,
        total_timeout=12.0,
        lookup_timeout=0.5,
        staging_bytes=1048576,
        queue_depth=3,
        copy_threads=5,
        io_threads=6,
        node_id="node-7",
        max_restarts=9,
        restart_window=30.0,
        deadline_slack=0.1,
        verify_checksums=False,
        close_timeout=4.0,
    )
    assert isinstance(cfg.total_timeout, float)
    assert isinstance(cfg.slice_block_num, int)


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPIPE_QUEUE_DEPTH", "11")
    monkeypatch.delenv("KVPIPE_SLICE_BLOCK_NUM", raising=False)
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCK_NUM", "13")
    cfg = PipelineConfig.from_env()
    assert cfg.queue_depth == 11
    assert cfg.slice_block_num == 13


@pytest.mark.parametrize(
    ("field", "var", "raw", "value"),
    [
        ("slice_block_num", "AS_WRITE_SLICE_BLOCK_NUM", "9", 9),
        ("slice_timeout", "AS_WRITE_SLICE_TIMEOUT", "1.5", 1.5),
        ("total_timeout", "AS_WRITE_TOTAL_TIMEOUT", "20", 20.0),
    ],
)
def test_fastdeploy_fallbacks(field: str, var: str, raw: str, value: float) -> None:
    assert getattr(PipelineConfig.from_env(environ={var: raw}), field) == value
    # the KVPIPE_ variable wins when both are set
    kv = f"KVPIPE_{field.upper()}"
    assert getattr(PipelineConfig.from_env(environ={var: raw, kv: "3"}), field) == 3
    # a blank KVPIPE_ variable counts as unset
    assert getattr(PipelineConfig.from_env(environ={var: raw, kv: " "}), field) == value


@pytest.mark.parametrize(
    "var", ["AS_WRITE_SLICE_BLOCK_NUM", "AS_WRITE_SLICE_TIMEOUT", "AS_WRITE_TOTAL_TIMEOUT"]
)
def test_fallback_not_read_when_kvpipe_variable_set(var: str) -> None:
    kv = {
        "AS_WRITE_SLICE_BLOCK_NUM": "KVPIPE_SLICE_BLOCK_NUM",
        "AS_WRITE_SLICE_TIMEOUT": "KVPIPE_SLICE_TIMEOUT",
        "AS_WRITE_TOTAL_TIMEOUT": "KVPIPE_TOTAL_TIMEOUT",
    }[var]
    # an invalid fallback is never even parsed when the KVPIPE_ one is set
    cfg = PipelineConfig.from_env(environ={kv: "4", var: "garbage"})
    assert cfg == PipelineConfig.from_env(environ={kv: "4"})


def test_no_fallback_for_other_fields() -> None:
    cfg = PipelineConfig.from_env(environ={"AS_WRITE_LOOKUP_TIMEOUT": "1", "AS_QUEUE_DEPTH": "2"})
    assert cfg == PipelineConfig()


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"AS_WRITE_SLICE_BLOCK_NUM": "0"}, "AS_WRITE_SLICE_BLOCK_NUM"),
        ({"AS_WRITE_SLICE_BLOCK_NUM": "abc"}, "AS_WRITE_SLICE_BLOCK_NUM"),
        ({"AS_WRITE_SLICE_BLOCK_NUM": "1.5"}, "AS_WRITE_SLICE_BLOCK_NUM"),
        ({"AS_WRITE_SLICE_TIMEOUT": "-1"}, "AS_WRITE_SLICE_TIMEOUT"),
        ({"AS_WRITE_TOTAL_TIMEOUT": "inf"}, "AS_WRITE_TOTAL_TIMEOUT"),
        ({"KVPIPE_SLICE_BLOCK_NUM": "0"}, "KVPIPE_SLICE_BLOCK_NUM"),
        (
            {"KVPIPE_SLICE_BLOCK_NUM": "0", "AS_WRITE_SLICE_BLOCK_NUM": "5"},
            "KVPIPE_SLICE_BLOCK_NUM",
        ),
        ({"KVPIPE_SLICE_TIMEOUT": "nan"}, "KVPIPE_SLICE_TIMEOUT"),
        ({"KVPIPE_TOTAL_TIMEOUT": "ten"}, "KVPIPE_TOTAL_TIMEOUT"),
        ({"KVPIPE_STAGING_BYTES": "-5"}, "KVPIPE_STAGING_BYTES"),
        ({"KVPIPE_QUEUE_DEPTH": "1e3"}, "KVPIPE_QUEUE_DEPTH"),
        ({"KVPIPE_VERIFY_CHECKSUMS": "maybe"}, "KVPIPE_VERIFY_CHECKSUMS"),
        ({"KVPIPE_CLOSE_TIMEOUT": "0"}, "KVPIPE_CLOSE_TIMEOUT"),
    ],
)
def test_from_env_bad_values_name_the_variable(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_env(environ=env)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_from_env_bool_parsing(raw: str, value: bool) -> None:
    cfg = PipelineConfig.from_env(environ={"KVPIPE_VERIFY_CHECKSUMS": raw})
    assert cfg.verify_checksums is value


def test_overrides_win() -> None:
    env = {"KVPIPE_SLICE_BLOCK_NUM": "7", "AS_WRITE_TOTAL_TIMEOUT": "20"}
    cfg = PipelineConfig.from_env(environ=env, slice_block_num=3, total_timeout=5.0, node_id="n")
    assert cfg.slice_block_num == 3
    assert cfg.total_timeout == 5.0
    assert cfg.node_id == "n"


@pytest.mark.parametrize(
    ("env", "override"),
    [
        ({"KVPIPE_NODE_ID": "pod 7"}, {"node_id": "pod-7"}),
        ({"KVPIPE_QUEUE_DEPTH": "0"}, {"queue_depth": 3}),
        ({"AS_WRITE_SLICE_TIMEOUT": "garbage"}, {"slice_timeout": 2.0}),
        ({"KVPIPE_STAGING_BYTES": str(1 << 62)}, {"staging_bytes": 64 << 20}),
    ],
)
def test_an_override_wins_over_a_bad_variable_for_its_field(
    env: dict[str, str], override: dict[str, Any]
) -> None:
    """docs/embedding.md: keyword overrides take precedence over the environment. A field the
    caller sets is not read from the environment, so a variable for it that would not parse
    or validate does not fail the config (the FastDeploy adapter overrides node_id, say)."""
    cfg = PipelineConfig.from_env(environ=env, **override)
    assert cfg == PipelineConfig(**override)


def test_bad_override_names_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_env(environ={}, queue_depth=0)
    assert info.value.field == "queue_depth"


@pytest.mark.parametrize(("processors", "threads"), [(1, 1), (2, 1), (3, 2), (64, 2)])
def test_copy_threads_leave_the_event_loop_a_processor(
    monkeypatch: pytest.MonkeyPatch, processors: int, threads: int
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(processors)))
    assert PipelineConfig().copy_threads == threads
    assert PipelineConfig(copy_threads=4).copy_threads == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("total_timeout", 10**400), ("slice_timeout", -(10**400)), ("staging_bytes", 10**400)],
)
def test_an_int_too_large_for_a_float_is_a_config_error(field: str, value: int) -> None:
    """Refused naming its field; it raised a bare OverflowError (``math.isfinite`` of the int,
    or the message's GiB figure)."""
    with pytest.raises(kvpipe.ConfigError, match=field):
        kvpipe.PipelineConfig(**{field: value})


def test_each_variable_is_checked_alone_not_against_the_other_fields_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a machine with less physical memory than the default 1 GiB of staging, a valid
    environment and override (the documented example's ``staging_bytes=64 << 20``) were
    refused, naming ``KVPIPE_SLICE_BLOCK_NUM``: each variable was checked by building a whole
    config around it, with the default staging, which did not fit."""
    monkeypatch.setattr("kvpipe._config.physical_memory", lambda: 512 << 20)
    env = {"KVPIPE_SLICE_BLOCK_NUM": "64", "AS_WRITE_SLICE_TIMEOUT": "2"}
    cfg = PipelineConfig.from_env(environ=env, staging_bytes=64 << 20)
    assert (cfg.slice_block_num, cfg.slice_timeout, cfg.staging_bytes) == (64, 2.0, 64 << 20)
    cfg = PipelineConfig.from_env(environ={**env, "KVPIPE_STAGING_BYTES": str(64 << 20)})
    assert cfg.staging_bytes == 64 << 20
    with pytest.raises(ConfigError, match="physical memory") as info:
        PipelineConfig.from_env(environ={**env, "KVPIPE_STAGING_BYTES": str(1 << 30)})
    assert info.value.field == "KVPIPE_STAGING_BYTES"
