"""Pieces written once and used in several places: client methods made from operations, the
module-level coroutines made from their functions, and what the external stores share."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from tq_redis.api import functions as interface
from tq_redis.backends import external
from tq_redis.client.aio import AsyncTransferQueueClient
from tq_redis.client.blocking import TransferQueueClient
from tq_redis.client.methods import blocking
from tq_redis.errors import BackendNotInstalled, DataMissing, InvalidArgument, StorageError

# ------------------------------------------------------------------ client methods


def test_get_meta_keeps_the_public_signature_and_its_keyword_only_additions():
    expected = (
        "(self, data_fields: 'Sequence[str]', batch_size: 'int', partition_id: 'str', mode: 'str' = 'fetch', "
        "task_name: 'str | None' = None, sampling_config: 'dict[str, Any] | None' = None, *, "
        "timeout: 'float' = 0.0, lease_s: 'float | None' = None, max_deliveries: 'int | None' = None) -> 'BatchMeta'"
    )
    assert str(inspect.signature(TransferQueueClient.get_meta)) == expected
    assert str(inspect.signature(AsyncTransferQueueClient.async_get_meta)) == expected
    assert inspect.iscoroutinefunction(AsyncTransferQueueClient.async_get_meta)
    assert not inspect.iscoroutinefunction(TransferQueueClient.get_meta)
    assert TransferQueueClient.get_meta.__doc__.strip().startswith("Get the metadata of a batch.")


class _Recorder:
    """Stands in for a client: ``run`` returns what the operation was built with."""

    context = "ctx"

    def run(self, op):
        return op


def _op(ctx, a, b=1, *, c=None):
    return (ctx, a, b, c)


def test_a_method_from_an_operation_passes_the_context_and_checks_the_call():
    method = blocking(_op, doc="Doc.")
    recorder = _Recorder()
    assert method(recorder, 5) == ("ctx", 5, 1, None)
    assert method(recorder, 5, 2, c=3) == ("ctx", 5, 2, 3)
    assert method(recorder, a=5, c=3) == ("ctx", 5, 1, 3)
    with pytest.raises(TypeError):
        method(recorder, 5, 2, 3)  # c is keyword-only
    with pytest.raises(TypeError):
        method(recorder, 5, d=1)
    assert (method.__name__, method.__doc__) == ("_op", "Doc.")
    assert str(inspect.signature(method)) == "(self, a, b=1, *, c=None)"


def test_module_coroutines_take_their_functions_parameters():
    for name in ("kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list", "kv_clear"):
        function, coroutine = getattr(interface, name), getattr(interface, f"async_{name}")
        assert inspect.signature(coroutine) == inspect.signature(function)
        assert inspect.iscoroutinefunction(coroutine) and coroutine.__name__ == f"async_{name}"
        assert {name, f"async_{name}"} <= set(interface.__all__)


# ------------------------------------------------------------------ external stores


def test_import_client_names_what_to_install():
    with pytest.raises(BackendNotInstalled, match="the demo store needs the demo library .*install it with: pip x"):
        external.import_client("no_such_module_here", "demo", "the demo library", "pip x")


def test_put_plan_keeps_the_last_value_of_a_key_and_counts_the_marker():
    order, views, sizes = external.put_plan(["a", "b", "a"], [[b"1"], [b"22", b"3"], [np.arange(2, dtype=np.int16)]])
    assert order == [2, 1]
    assert sizes == [5, 4]  # 4 bytes + marker, 3 bytes + marker
    assert all(v.format == "B" for segs in views for v in segs)
    with pytest.raises(InvalidArgument, match="2 keys but 1 values"):
        external.put_plan(["a", "b"], [[b"1"]])


def test_batches_bound_count_and_bytes_and_let_a_large_value_go_alone():
    assert list(external.batches([4, 4, 4, 4, 4], 2, 100)) == [(0, 2, 8), (2, 4, 8), (4, 5, 4)]
    assert list(external.batches([3, 50, 3, 3], 10, 10)) == [(0, 1, 3), (1, 2, 50), (2, 4, 6)]
    assert list(external.batches([], 10, 10)) == []


def test_marked_values_round_trip_and_an_unmarked_one_is_refused():
    buffer = bytearray(10)
    end = external.write_marked(memoryview(buffer), [memoryview(b"ab"), memoryview(b"cd")], 3)
    assert end == 8 and buffer[3:8] == b"abcd" + bytes([external.MARK])
    assert bytes(external.unmarked(memoryview(buffer)[3:8], "demo", "k")) == b"abcd"
    with pytest.raises(StorageError, match="demo store: the value of 'k' was not written by tq-redis"):
        external.unmarked(memoryview(b"abc"), "demo", "k")
    with pytest.raises(StorageError):
        external.unmarked(memoryview(b""), "demo", "k")


def test_errors_name_at_most_ten_keys():
    keys = [f"k{i}" for i in range(12)]
    assert external.named(keys[:2]) == "'k0', 'k1'"
    assert external.named(keys).endswith("'k9' and 2 more")
    err = external.missing(keys, "the demo store (worker w)")
    assert isinstance(err, DataMissing) and str(err).startswith("12 value(s) missing from the demo store (worker w)")


def test_process_connection_refuses_use_after_close():
    made = []
    conn = external.ProcessConnection("demo", lambda: made.append(1) or len(made))
    assert conn.get() == 1 and conn.get() == 1  # made once in this process
    conn.close()
    with pytest.raises(StorageError, match="this demo store is closed"):
        conn.get()
