"""init() config: defaults, environment, our shape and the reference system's shape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tq_redis import units
from tq_redis.api import config
from tq_redis.errors import ConfigError


def test_defaults(monkeypatch):
    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    monkeypatch.delenv("TQ_NAMESPACE", raising=False)
    monkeypatch.delenv("TQ_REDIS_CLUSTER", raising=False)
    cfg = config.load()
    assert cfg["redis"]["url"] is None
    assert cfg["redis"]["cluster"] is None  # detect
    assert cfg["namespace"] == "tq"
    assert cfg["storage"]["backend"] == "dram"


def test_environment_attaches(monkeypatch):
    monkeypatch.setenv("TQ_REDIS_URL", "redis://h:1/0")
    monkeypatch.setenv("TQ_NAMESPACE", "job7")
    cfg = config.load({"storage": {"backend": "redis"}})
    assert cfg["redis"]["url"] == "redis://h:1/0"
    assert cfg["namespace"] == "job7"
    assert cfg["storage"]["backend"] == "redis"
    assert cfg["storage"]["units"] == 2  # untouched defaults survive a partial section


def test_reference_shape_is_mapped():
    cfg = config.load(
        {
            "controller": {"sampler": "GRPOGroupNSampler", "polling_mode": True, "zmq_info": None},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {"num_data_storage_units": 4, "total_storage_size": 1000, "zmq_info": None},
            },
            "metrics": {"enabled": True, "port": 9000},
        }
    )
    assert cfg["sampler"] == "GRPOGroupNSampler"
    assert cfg["storage"] == {"backend": "dram", "units": 4, "unit_capacity": "4GiB", "spill": None, "options": {},
                              "inline_max_bytes": 4096, "durable": None, "replicas": 1}
    assert cfg["metrics"] == {"enabled": True, "port": 9000}


def test_reference_mooncake_options_pass_through():
    cfg = config.load({"backend": {"storage_backend": "MooncakeStore",
                                   "MooncakeStore": {"protocol": "tcp", "zmq_info": 1}}})
    assert cfg["storage"]["backend"] == "mooncake"
    assert cfg["storage"]["options"] == {"protocol": "tcp"}


def test_unknown_sections_are_kept_like_the_reference():
    # verl passes its whole `transfer_queue` section: `enable`, its own metrics and Mooncake keys
    cfg = config.load({"enable": True, "num_global_batch": 4, "metrics": {"enabled": False}})
    assert cfg["enable"] is True
    assert cfg["num_global_batch"] == 4
    assert cfg["storage"]["backend"] == "dram"


def test_ssd_offload_maps_to_spill(tmp_path):
    cfg = config.load({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {
        "num_data_storage_units": 2, "ssd_offload": {"enabled": True, "path": str(tmp_path)}}}})
    assert cfg["storage"]["spill"] == str(tmp_path)
    off = config.load({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {
        "ssd_offload": {"enabled": False, "path": str(tmp_path)}}}})
    assert off["storage"]["spill"] is None


def test_compat_defaults_are_the_reference_layout():
    cfg = config.load()
    assert cfg["compat"] == {"nested_output": True, "strict_schema": False}


def test_omegaconf_accepted():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = config.load(omegaconf.OmegaConf.create({"namespace": "x"}))
    assert cfg["namespace"] == "x"


def test_redis_cluster_from_config_or_environment(monkeypatch):
    monkeypatch.delenv("TQ_REDIS_CLUSTER", raising=False)
    assert config.load({"redis": {"url": "redis://h:1", "cluster": True}})["redis"]["cluster"] is True
    assert config.load({"redis": {"cluster": "false"}})["redis"]["cluster"] is False
    monkeypatch.setenv("TQ_REDIS_CLUSTER", "1")
    assert config.load()["redis"]["cluster"] is True
    assert config.load({"redis": {"cluster": False}})["redis"]["cluster"] is False  # the config wins
    monkeypatch.setenv("TQ_REDIS_CLUSTER", "perhaps")
    with pytest.raises(ConfigError, match="TQ_REDIS_CLUSTER='perhaps'"):
        config.load()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"redis": {"url": "http://h:6379"}}, "scheme 'http'.*redis://host:port"),
        ({"redis": {"cluster": "maybe"}}, "redis.cluster='maybe'"),
        ({"storgae": {"backend": "redis"}}, "did you mean 'storage'"),
        ({"rediss": {"url": "redis://h:1/0"}}, "did you mean 'redis'"),
        ({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"ssd_offload": {"enabled": True}}}},
         "ssd_offload.path"),
        ({"backend": {"storage_backend": "Nope"}}, "storage_backend"),
        ({"namespace": ""}, "namespace"),
        ({"storage": 3}, "mapping"),
        ("redis://x", "dict"),
    ],
)
def test_bad_config(bad, match):
    with pytest.raises(ConfigError, match=match):
        config.load(bad)


@pytest.mark.parametrize(
    "text, expected",
    [
        # IEC: powers of 1024, with or without the B
        ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1KiB", 1024), ("2TiB", 2 * 2**40),
        ("4Gi", 4 * 2**30), ("3Mi", 3 * 2**20), ("1Ki", 1024), ("1Ti", 2**40),
        # SI: powers of 1000, the bare suffixes included
        ("512MB", 512 * 10**6), ("4GB", 4 * 10**9), ("2kB", 2000), ("1TB", 10**12),
        ("4G", 4 * 10**9), ("512M", 512 * 10**6), ("2k", 2000), ("2K", 2000), ("1T", 10**12),
        # bytes, letter case, spaces, fractions (rounded down), exponents, ints and floats
        ("1024", 1024), ("1024B", 1024), ("4gib", 4 * 2**30), ("4 GiB", 4 * 2**30), (" 512 mb ", 512 * 10**6),
        ("1.5KiB", 1536), (".5MiB", 2**19), ("1.5G", 1_500_000_000), ("2.5B", 2), ("1e9", 10**9),
        (7, 7), (4e9, 4 * 10**9),
    ],
)  # fmt: skip
def test_parse_size(text, expected):
    assert units.parse_size(text) == expected


def test_sizes_are_parsed_and_formatted_in_one_module_only():
    """tq_redis/units.py holds the one size parser and the one byte formatter."""
    root = Path(units.__file__).parent
    own = re.compile(
        r'def (parse_size|format_size|_?fmt_bytes|_?human\w*|_size)\(|for unit in \("B", "KiB"|_SIZE_UNITS = '
    )
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if own.search(p.read_text(encoding="utf-8")))
    assert found == ["units.py"]
    assert units.format_size(512) == "512 B" and units.format_size(1536) == "1.5 KiB"
    assert units.format_size(3 << 40) == "3.0 TiB"


def test_parse_size_takes_zero_where_allowed():
    assert units.parse_size("0", allow_zero=True) == 0 and units.parse_size("0MiB", allow_zero=True) == 0
    with pytest.raises(ConfigError, match="must be non-negative"):
        units.parse_size(-1, allow_zero=True)


@pytest.mark.parametrize(("given", "bytes_"), [("4KiB", 4096), (0, 0), ("64KiB", 65536), (100, 100)])
def test_inline_max_bytes_is_a_size_and_zero_turns_it_off(given, bytes_):
    assert config.load({"storage": {"inline_max_bytes": given}})["storage"]["inline_max_bytes"] == bytes_


def test_inline_max_bytes_refuses_what_is_not_a_size():
    with pytest.raises(ConfigError, match="inline|size"):
        config.load({"storage": {"inline_max_bytes": "lots"}})


@pytest.mark.parametrize(
    ("given", "recorded"),
    [
        (None, None),
        ("file:///data/tq", {"url": "file:///data/tq", "storage_options": {}}),
        ("/data/tq", {"url": "/data/tq", "storage_options": {}}),
        ({"url": "s3://b/p", "storage_options": {"endpoint_url": "http://x"}},
         {"url": "s3://b/p", "storage_options": {"endpoint_url": "http://x"}}),
    ],
)
def test_storage_durable_is_a_url_or_a_url_with_options(given, recorded):
    assert config.load({"storage": {"durable": given}})["storage"]["durable"] == recorded


def test_storage_durable_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("TQ_STORAGE_DURABLE", "file:///from/env")
    assert config.load()["storage"]["durable"]["url"] == "file:///from/env"
    assert config.load({"storage": {"durable": "file:///given"}})["storage"]["durable"]["url"] == "file:///given"
