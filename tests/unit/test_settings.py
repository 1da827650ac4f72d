"""tq_redis/settings.py owns every TQ_* environment variable: one table, one reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tq_redis import settings as settings_module
from tq_redis.errors import ConfigError
from tq_redis.settings import VARIABLES, parse_flag, settings

PACKAGE = Path(settings_module.__file__).parent


def _property(variable: str) -> str:
    return variable.removeprefix("TQ_").lower()


def test_the_table_lists_every_variable_once_in_order_and_each_has_a_property():
    doc = settings_module.__doc__ or ""
    in_table = re.findall(r"^``(TQ_[A-Z_]+)``", doc, flags=re.M)
    assert in_table == list(VARIABLES)
    for variable in VARIABLES:
        prop = getattr(type(settings), _property(variable))
        assert isinstance(prop, property) and variable in (prop.__doc__ or ""), variable


def test_no_other_module_reads_the_environment_for_a_tq_variable():
    reads = re.compile(r"""(environ\.get|environ\[|getenv)\(?\s*(["']TQ_|[A-Z_]*ENV\b)""")
    offenders = sorted(
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
        if p.name != "settings.py" and reads.search(p.read_text(encoding="utf-8"))
    )
    assert offenders == []


def test_every_tq_variable_the_package_names_is_a_setting():
    named = set()
    for p in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bTQ_[A-Z0-9_]+\b", p.read_text(encoding="utf-8")))
    assert sorted(named - set(VARIABLES)) == []


def test_unset_variables_give_the_documented_defaults(monkeypatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert settings.redis_url is None and settings.namespace is None and settings.redis_cluster is None
    assert settings.heartbeat_s == 10.0 and settings.buffer_cache == 1 << 30 and settings.copy_threads is None
    assert settings.native_copy is True and settings.native_scan is True and settings.logging_level is None


def test_values_are_read_when_asked_for(monkeypatch):
    monkeypatch.setenv("TQ_NAMESPACE", "  job-a ")
    assert settings.namespace == "job-a"
    monkeypatch.setenv("TQ_NAMESPACE", "job-b")
    assert settings.namespace == "job-b"
    monkeypatch.setenv("TQ_REDIS_CLUSTER", "yes")
    monkeypatch.setenv("TQ_HEARTBEAT_S", "0.5")
    monkeypatch.setenv("TQ_COPY_THREADS", "3")
    monkeypatch.setenv("TQ_NATIVE_SCAN", "off")
    monkeypatch.setenv("TQ_BUFFER_CACHE", "64MiB")
    assert settings.redis_cluster is True and settings.heartbeat_s == 0.5 and settings.copy_threads == 3
    assert settings.native_scan is False and settings.buffer_cache == 64 << 20


@pytest.mark.parametrize(
    ("variable", "value", "prop"),
    [
        ("TQ_REDIS_CLUSTER", "maybe", "redis_cluster"),
        ("TQ_HEARTBEAT_S", "soon", "heartbeat_s"),
        ("TQ_HEARTBEAT_S", "-1", "heartbeat_s"),
        ("TQ_COPY_THREADS", "0", "copy_threads"),
        ("TQ_COPY_THREADS", "many", "copy_threads"),
        ("TQ_NATIVE_COPY", "2", "native_copy"),
        ("TQ_BUFFER_CACHE", "lots", "buffer_cache"),
    ],
)
def test_a_value_that_does_not_parse_names_its_variable(monkeypatch, variable, value, prop):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        getattr(settings, prop)


def test_flags():
    assert parse_flag("ON", "x") is True and parse_flag(0, "x") is False and parse_flag(True, "x") is True
    assert parse_flag("", "x", auto=True) is None and parse_flag("auto", "x", auto=True) is None
    with pytest.raises(ConfigError, match="x=''"):
        parse_flag("", "x")
