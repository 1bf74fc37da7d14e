"""The config contract: schema, validation messages, precedence (defaults < file < env < inline)."""

from __future__ import annotations

import math

import pickle

import pytest
import yaml

from kvstore.config import ConfigError, GiB, StoreConfig, env_overrides, from_dict, load_config
from kvstore.tiers.policy import POLICIES


def test_defaults():
    c = from_dict({})
    assert c == StoreConfig()
    assert c.tiers.dram.capacity_gb == 4.0 and c.tiers.dram.policy == "lru" and c.tiers.dram.codec == "none"
    assert c.tiers.nvme.o_direct == "auto" and c.tiers.nvme.write_mode == "write_back"
    assert c.metrics.port is None and c.trace_path is None
    assert from_dict(None) == c


def test_full_schema_round_trip(tmp_path):
    data = {
        "tiers": {
            "dram": {"capacity_gb": 0.5, "ttl_s": 300, "policy": "lru_shared", "codec": "fp8", "pin_memory": False},
            "nvme": {"path": str(tmp_path / "c"), "capacity_gb": 2, "ttl_s": None, "policy": "fifo",
                     "codec": "int8+zstd", "o_direct": False, "write_mode": "write_through", "io_threads": 3},
        },
        "metrics": {"port": 9400},
        "trace_path": str(tmp_path / "t.jsonl"),
    }
    c = from_dict(data)
    assert c.tiers.dram.capacity_bytes == GiB // 2
    assert c.tiers.dram.ttl_s == 300.0 and c.tiers.nvme.ttl_s is None
    assert c.tiers.nvme.o_direct is False and c.tiers.nvme.io_threads == 3
    assert c.metrics.port == 9400
    assert from_dict(yaml.safe_load(c.to_yaml())) == c


def test_zero_capacity_disables_a_tier():
    c = from_dict({"tiers": {"dram": {"capacity_gb": 0}}})
    assert not c.tiers.dram.enabled and c.tiers.nvme.enabled


@pytest.mark.parametrize("data, key, allowed", [
    ({"bogus": 1}, "bogus", "trace_path"),
    ({"tiers": {"ssd": {}}}, "tiers.ssd", "dram, nvme"),
    ({"tiers": {"dram": {"capacity": 4}}}, "tiers.dram.capacity", "capacity_gb"),
    ({"tiers": {"nvme": {"odirect": True}}}, "tiers.nvme.odirect", "o_direct"),
    ({"metrics": {"prot": 1}}, "metrics.prot", "port"),
])
def test_unknown_keys(data, key, allowed):
    with pytest.raises(ConfigError) as ei:
        from_dict(data)
    e = ei.value
    assert e.key == key
    assert key in str(e) and allowed in str(e) and "unknown key" in str(e)
    assert "invalid value" not in str(e)  # its value is not shown: it may be a credential under a misspelt name
    again = pickle.loads(pickle.dumps(e))  # vLLM's engine process hands it to the API server
    assert str(again) == str(e) and again.value is e.value


@pytest.mark.parametrize("data, near", [
    ({"tiers": {"dram": {"capacty_gb": 2}}}, "capacity_gb"),
    ({"tiers": {"nvme": {"odirect": True}}}, "o_direct"),
    ({"metrics": {"prot": 1}}, "port"),
    ({"trace_pth": "x"}, "trace_path"),
    ({"bogus": 1}, None),
])
def test_an_unknown_key_names_the_nearest_known_one(data, near):
    with pytest.raises(ConfigError) as ei:
        from_dict(data)
    assert ("did you mean" in str(ei.value)) == (near is not None)
    if near:
        assert f"(did you mean '{near}'?)" in str(ei.value)


@pytest.mark.parametrize("data, key, value, allowed_part", [
    ({"tiers": {"dram": {"capacity_gb": -1}}}, "tiers.dram.capacity_gb", -1, ">= 0"),
    ({"tiers": {"dram": {"capacity_gb": "four"}}}, "tiers.dram.capacity_gb", "four", "number"),
    ({"tiers": {"dram": {"capacity_gb": True}}}, "tiers.dram.capacity_gb", True, "number"),
    ({"tiers": {"dram": {"capacity_gb": math.inf}}}, "tiers.dram.capacity_gb", math.inf, "finite"),
    ({"tiers": {"nvme": {"capacity_gb": None}}}, "tiers.nvme.capacity_gb", None, "number"),
    ({"tiers": {"dram": {"ttl_s": -5}}}, "tiers.dram.ttl_s", -5, "or null"),
    ({"tiers": {"nvme": {"ttl_s": "1h"}}}, "tiers.nvme.ttl_s", "1h", "or null"),
    ({"tiers": {"dram": {"policy": "lfu"}}}, "tiers.dram.policy", "lfu", "fifo | lru | lru_shared"),
    ({"tiers": {"nvme": {"policy": 3}}}, "tiers.nvme.policy", 3, "lru"),
    ({"tiers": {"dram": {"codec": "gzip"}}}, "tiers.dram.codec", "gzip", "fp8+zstd"),
    ({"tiers": {"nvme": {"o_direct": "maybe"}}}, "tiers.nvme.o_direct", "maybe", "auto | true | false"),
    ({"tiers": {"nvme": {"write_mode": "async"}}}, "tiers.nvme.write_mode", "async", "write_back | write_through"),
    ({"tiers": {"nvme": {"io_threads": 0}}}, "tiers.nvme.io_threads", 0, "[1, 64]"),
    ({"tiers": {"nvme": {"io_threads": 2.5}}}, "tiers.nvme.io_threads", 2.5, "[1, 64]"),
    ({"tiers": {"nvme": {"path": ""}}}, "tiers.nvme.path", "", "folder path"),
    ({"tiers": {"nvme": {"path": 7}}}, "tiers.nvme.path", 7, "folder path"),
    ({"tiers": {"dram": {"pin_memory": "sometimes"}}}, "tiers.dram.pin_memory", "sometimes", "auto | true | false"),
    ({"tiers": {"nvme": {"admit_after": -1}}}, "tiers.nvme.admit_after", -1, "an integer >= 0"),
    ({"tiers": {"nvme": {"admit_after": 1.5}}}, "tiers.nvme.admit_after", 1.5, "an integer >= 0"),
    ({"tiers": {"nvme": {"admit_after": "twice"}}}, "tiers.nvme.admit_after", "twice", "an integer >= 0"),
    ({"tiers": {"nvme": {"admit_after": True}}}, "tiers.nvme.admit_after", True, "an integer >= 0"),
    ({"tiers": {"nvme": {"admit_after": None}}}, "tiers.nvme.admit_after", None, "an integer >= 0"),
    ({"tiers": {"nvme": {"engine_depth": 0}}}, "tiers.nvme.engine_depth", 0, "auto | an integer in [1, 64]"),
    ({"tiers": {"nvme": {"engine_depth": 65}}}, "tiers.nvme.engine_depth", 65, "auto | an integer in [1, 64]"),
    ({"tiers": {"nvme": {"engine_depth": "deep"}}}, "tiers.nvme.engine_depth", "deep", "auto | an integer in [1, 64]"),
    ({"tiers": {"nvme": {"engine_depth": True}}}, "tiers.nvme.engine_depth", True, "auto | an integer in [1, 64]"),
    ({"metrics": {"port": 0}}, "metrics.port", 0, "[1, 65535]"),
    ({"metrics": {"port": 70000}}, "metrics.port", 70000, "[1, 65535]"),
    ({"trace_path": 5}, "trace_path", 5, "file path"),
    ({"tiers": []}, "tiers", [], "mapping"),
    ({"tiers": {"dram": "big"}}, "tiers.dram", "big", "mapping"),
])
def test_bad_values_name_key_value_and_allowed(data, key, value, allowed_part):
    with pytest.raises(ConfigError) as ei:
        from_dict(data)
    e = ei.value
    assert e.key == key
    assert e.value == value or (isinstance(value, float) and math.isnan(value))
    msg = str(e)
    assert key in msg and repr(value) in msg and allowed_part in msg
    assert isinstance(e, ValueError)


def test_policy_choices_come_from_the_registry():
    with pytest.raises(ConfigError) as ei:
        from_dict({"tiers": {"dram": {"policy": "nope"}}})
    for name in POLICIES:
        assert name in ei.value.allowed


def test_choices_are_case_and_space_insensitive():
    c = from_dict({"tiers": {"dram": {"policy": " LRU "}, "nvme": {"o_direct": "TRUE", "write_mode": "Write_Through"}}})
    assert c.tiers.dram.policy == "lru" and c.tiers.nvme.o_direct is True
    assert c.tiers.nvme.write_mode == "write_through"


def test_nan_is_rejected():
    with pytest.raises(ConfigError) as ei:
        from_dict({"tiers": {"dram": {"ttl_s": float("nan")}}})
    assert ei.value.key == "tiers.dram.ttl_s"


def test_env_overrides_parse_yaml_scalars():
    env = {
        "KVSTORE__TIERS__DRAM__CAPACITY_GB": "8",
        "KVSTORE__TIERS__DRAM__TTL_S": "null",
        "KVSTORE__TIERS__NVME__O_DIRECT": "false",
        "KVSTORE__METRICS__PORT": "9100",
        "KVSTORE_CONFIG_UNRELATED": "x",
        "PATH": "/bin",
    }
    assert env_overrides(env) == {"tiers": {"dram": {"capacity_gb": 8, "ttl_s": None}, "nvme": {"o_direct": False}},
                                  "metrics": {"port": 9100}}
    c = load_config(environ=env)
    assert c.tiers.dram.capacity_gb == 8.0 and c.tiers.dram.ttl_s is None
    assert c.tiers.nvme.o_direct is False and c.metrics.port == 9100


def test_env_override_with_bad_value_or_key():
    with pytest.raises(ConfigError) as ei:
        load_config(environ={"KVSTORE__TIERS__DRAM__CAPACITY_GB": "lots"})
    assert ei.value.key == "tiers.dram.capacity_gb" and "lots" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(environ={"KVSTORE__TIERS__DRAM__SIZE": "1"})
    assert ei.value.key == "tiers.dram.size"


def test_env_scalar_and_nested_conflict_is_a_config_error():
    with pytest.raises(ConfigError):
        env_overrides({"KVSTORE__TIERS": "1", "KVSTORE__TIERS__DRAM__TTL_S": "5"})
    with pytest.raises(ConfigError):
        env_overrides({"KVSTORE__TIERS__DRAM__TTL_S": "5", "KVSTORE__TIERS": "1"})


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_precedence_file_env_inline(tmp_path):
    f = _write(tmp_path / "c.yaml", {"tiers": {"dram": {"capacity_gb": 1, "ttl_s": 10, "policy": "fifo"},
                                               "nvme": {"capacity_gb": 5}}})
    env = {"KVSTORE__TIERS__DRAM__TTL_S": "20", "KVSTORE__TIERS__DRAM__CAPACITY_GB": "2"}
    c = load_config(f, overrides={"tiers": {"dram": {"capacity_gb": 3}}}, environ=env)
    assert c.tiers.dram.capacity_gb == 3.0  # inline beats env beats file
    assert c.tiers.dram.ttl_s == 20.0  # env beats file
    assert c.tiers.dram.policy == "fifo"  # file beats defaults
    assert c.tiers.nvme.capacity_gb == 5.0
    assert c.tiers.nvme.ttl_s == 86400.0  # default; siblings survive the deep merge


def test_inline_overrides_win_over_file(tmp_path):
    f = _write(tmp_path / "c.yaml", {"tiers": {"nvme": {"ttl_s": 100, "policy": "fifo"}}})
    c = load_config(f, overrides={"tiers": {"nvme": {"ttl_s": None}}}, environ={})
    assert c.tiers.nvme.ttl_s is None and c.tiers.nvme.policy == "fifo"


def test_kvstore_config_names_the_file(tmp_path):
    f = _write(tmp_path / "env.yaml", {"tiers": {"dram": {"capacity_gb": 7}}})
    g = _write(tmp_path / "explicit.yaml", {"tiers": {"dram": {"capacity_gb": 9}}})
    assert load_config(environ={"KVSTORE_CONFIG": str(f)}).tiers.dram.capacity_gb == 7.0
    # an explicit path, or a "config" key in the inline overrides, beats KVSTORE_CONFIG
    assert load_config(g, environ={"KVSTORE_CONFIG": str(f)}).tiers.dram.capacity_gb == 9.0
    c = load_config(overrides={"config": str(g), "tiers": {"dram": {"ttl_s": 1}}}, environ={"KVSTORE_CONFIG": str(f)})
    assert c.tiers.dram.capacity_gb == 9.0 and c.tiers.dram.ttl_s == 1.0


def test_kvstore_config_from_os_environ(tmp_path, monkeypatch):
    f = _write(tmp_path / "env.yaml", {"tiers": {"nvme": {"capacity_gb": 11}}})
    monkeypatch.setenv("KVSTORE_CONFIG", str(f))
    monkeypatch.setenv("KVSTORE__TIERS__NVME__TTL_S", "60")
    c = load_config()
    assert c.tiers.nvme.capacity_gb == 11.0 and c.tiers.nvme.ttl_s == 60.0


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path / "missing.yaml", environ={})
    assert ei.value.key == "config" and "missing.yaml" in str(ei.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [unclosed\n")
    with pytest.raises(ConfigError) as ei:
        load_config(bad, environ={})
    assert ei.value.key == "config" and "YAML" in str(ei.value)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as ei:
        load_config(lst, environ={})
    assert "mapping" in str(ei.value)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty, environ={}) == StoreConfig()


def test_unknown_key_in_file_names_it(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tiers:\n  dram:\n    capacity_gb: 1\n    tll_s: 5\n")
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={})
    assert ei.value.key == "tiers.dram.tll_s" and "ttl_s" in str(ei.value)


def test_admit_after_defaults_to_every_block_and_takes_an_integer(tmp_path):
    assert StoreConfig().tiers.nvme.admit_after == 0
    assert from_dict({"tiers": {"nvme": {"admit_after": 2}}}).tiers.nvme.admit_after == 2
    f = tmp_path / "c.yaml"
    f.write_text("tiers:\n  nvme:\n    admit_after: 3\n")
    assert load_config(f, environ={"KVSTORE__TIERS__NVME__ADMIT_AFTER": "2"}).tiers.nvme.admit_after == 2
    assert load_config(f, environ={}).tiers.nvme.admit_after == 3


def test_path_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    c = from_dict({"tiers": {"nvme": {"path": "~/cache"}}})
    assert c.tiers.nvme.path == str(tmp_path / "cache")


def test_default_yaml_lists_every_key():
    """configs/default.yaml maps one-to-one onto the config objects: every field, default values."""
    import dataclasses
    from pathlib import Path

    import yaml

    from kvstore.config import StoreConfig, load_config

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "default.yaml").read_text())
    defaults = StoreConfig()

    def check(obj, d, where):
        names = {f.name for f in dataclasses.fields(obj)}
        assert set(d) == names, (where, set(d) ^ names)
        for n in names:
            v = getattr(obj, n)
            if dataclasses.is_dataclass(v):
                check(v, d[n], f"{where}.{n}")

    check(defaults, doc, "")
    assert load_config(str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")) == defaults
