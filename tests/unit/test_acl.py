"""``tq_redis.server.acl``: the rules of a namespace's user cover every command tq-redis sends, and no more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from tq_redis.cli import main as cli
from tq_redis.errors import ConfigError, InvalidName, PermissionDenied, RedisOutOfMemory
from tq_redis.server import acl
from tq_redis.server import policy as server_policy

ROOT = Path(__file__).parents[2]


def _sources(*folders: str) -> str:
    return "\n".join(p.read_text() for f in folders for p in sorted((ROOT / f).rglob("*.py")))


def test_every_command_the_operations_send_is_granted():
    text = _sources("tq_redis")
    sent = {m.lower() for m in re.findall(r'Cmd\(\(\s*"([A-Za-z]+)"', text)}
    sent |= {m.lower() for m in re.findall(r'execute_command\(\s*"([A-Za-z]+)"', text)} - {
        "function", "cluster", "acl"}  # admin steps and test clusters, not a namespace client's
    assert sent, "the scan found no commands: the pattern is stale"
    missing = sorted(sent - set(acl.CLIENT_COMMANDS))
    assert not missing, f"grant these in acl.CLIENT_DATA_COMMANDS: {missing}"


def test_every_command_the_functions_run_is_granted():
    text = "\n".join(p.read_text() for p in sorted((ROOT / "tq_redis" / "lua").rglob("*.lua")))
    run = {m.lower() for m in re.findall(r"redis\.p?call\('([A-Za-z]+)'", text)}
    assert len(run) > 20
    missing = sorted(run - set(acl.CLIENT_COMMANDS))
    assert not missing, f"grant these in acl.CLIENT_DATA_COMMANDS: {missing}"


def test_a_namespace_user_reaches_its_keys_only_and_no_admin_command():
    rules = acl.rules("job-1")
    assert [r for r in rules if r.startswith("~")] == ["~job-1:*"]
    assert "resetchannels" in rules and rules.index("-@all") < rules.index("+fcall")
    granted = {r[1:] for r in rules if r.startswith("+")}
    assert not granted & acl.FORBIDDEN
    assert not any(g.startswith("@") for g in granted), "grant commands, never categories"
    assert "function|list" in granted and "function|load" not in granted
    node = acl.rules("job-1", "storage-node")
    assert [r for r in node if r.startswith("~")] == [
        "~job-1:storage:nodes", "~job-1:storage:pending:*", "~job-1:storage:pendingnodes",
    ]  # its registration, and the deletes recorded for it while it was unreachable
    assert [r for r in node if r.startswith("%R~")] == ["%R~job-1:storage:epoch"]  # read only: the epoch
    assert {"+hset", "+hget", "+hdel", "+get", "+time", "+lpop"} <= set(node) and "+fcall" not in node


def test_setuser_line_starts_from_nothing_and_sets_the_password():
    args = acl.setuser_args("u1", "ns", "s3cret")
    assert args[:6] == ["ACL", "SETUSER", "u1", "reset", "on", ">s3cret"]
    assert acl.render(args).startswith("ACL SETUSER u1 reset on '>s3cret' '~ns:*' resetchannels -@all")


@pytest.mark.parametrize("namespace", ["a:b", "a*", "", "a{b}"])
def test_a_namespace_that_could_reach_others_is_refused(namespace):
    with pytest.raises(InvalidName):
        acl.rules(namespace)


def test_bad_user_role_and_password_are_config_errors():
    with pytest.raises(ConfigError, match="role"):
        acl.rules("ns", "admin")
    with pytest.raises(ConfigError, match="user name"):
        acl.setuser_args("a b", "ns", "pw")
    with pytest.raises(ConfigError, match="password"):
        acl.setuser_args("u", "ns", "")


def test_unknown_commands_are_left_out_when_applied():
    sent: list[list[str]] = []

    def run(args: list[str]) -> None:
        sent.append(list(args))
        if "+waitaof" in args:
            raise redis.ResponseError(
                "Error in ACL SETUSER modifier '+waitaof': Unknown command or category name in ACL")

    final = acl._setuser(run, acl.setuser_args("u", "ns", "pw"))
    assert "+waitaof" not in final and len(sent) == 2 and "+wait" in final


def test_cli_prints_the_rules(capsys):
    assert cli.main(["acl", "myjob", "--password", "pw"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ACL SETUSER tq-myjob reset on '>pw' '~myjob:*'")
    assert cli.main(["acl", "bad:ns"]) == 2
    assert "namespace" in capsys.readouterr().err


def test_refusals_map_to_typed_errors_without_the_password():
    url = "redis://user:topsecret@host:6379/0"
    denied = server_policy.typed_error(url, redis.exceptions.NoPermissionError("this user has no permissions"))
    assert isinstance(denied, PermissionDenied) and "topsecret" not in str(denied) and "tq-redis acl" in str(denied)
    in_script = server_policy.typed_error(url, redis.ResponseError(
        "The user executing the script can't run this command or subcommand script: tq_reserve"))
    assert isinstance(in_script, PermissionDenied)
    full = server_policy.typed_error(url, redis.exceptions.OutOfMemoryError("command not allowed"))
    assert isinstance(full, RedisOutOfMemory) and "clear_partition" in str(full)
    assert server_policy.typed_error(url, redis.ResponseError("WRONGTYPE")) is None
    assert server_policy.redact(url) == "redis://user:***@host:6379/0"
    assert server_policy.redact("redis://h:1/0") == "redis://h:1/0"
    assert server_policy.redact("unix:///run/redis.sock") == "unix:///run/redis.sock"
    assert server_policy.redact("unix://:secret@/run/redis.sock?db=0") == "unix://:***@/run/redis.sock?db=0"


@pytest.mark.parametrize("policy, outcome", [
    ("noeviction", None), ("allkeys-lru", "error"), ("allkeys-random", "error"), ("volatile-ttl", "warn"),
    (None, "warn"),
])
def test_eviction_policies_are_judged(policy, outcome):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if outcome == "error":
            with pytest.raises(ConfigError, match="noeviction"):
                server_policy.judge_policy("redis://h:1", "", policy, "error")
            server_policy.judge_policy("redis://h:1", "", policy, "warn")  # the same, only warned
        else:
            server_policy.judge_policy("redis://h:1", "", policy, "error")
    assert bool(caught) == (outcome is not None)
    assert all(issubclass(w.category, server_policy.EvictionWarning) for w in caught)


def test_policy_replies_are_read_in_every_shape():
    assert server_policy.policy_from_config({"maxmemory-policy": "noeviction"}) == "noeviction"
    assert server_policy.policy_from_config([b"maxmemory-policy", b"allkeys-lru"]) == "allkeys-lru"
    assert server_policy.policy_from_info({"maxmemory_policy": "volatile-lru"}) == "volatile-lru"
    assert server_policy.policy_from_info("# Memory\r\nmaxmemory_policy:noeviction\r\n") == "noeviction"
