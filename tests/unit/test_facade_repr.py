"""Every public object's ``repr`` works on a half-built object (its constructor raised part-way).

Ray builds an actor's instance and then calls ``__init__``; when that raises, it reports the error
with the instance's ``repr``, and a ``repr`` that raises hides the real error behind "unexpected
internal error". So each case builds the object the same way, makes its constructor fail, and
asks for its ``repr``.
"""

from __future__ import annotations

import pytest

from tq_redis import (
    AsyncTransferQueueClient,
    Channel,
    DockMetrics,
    GRPOTransferDock,
    StreamingDataLoader,
    StreamingDataset,
    TransferDock,
    TransferQueueClient,
)
from tq_redis.errors import ConfigError, InvalidArgument, InvalidName
from tq_redis.reprs import attrs_repr

ALL = (AsyncTransferQueueClient, TransferQueueClient, Channel, DockMetrics, GRPOTransferDock, TransferDock,
       StreamingDataset, StreamingDataLoader)


def half_built(cls, *args, error=Exception, **kwargs):
    obj = cls.__new__(cls)
    with pytest.raises(error):
        obj.__init__(*args, **kwargs)
    return obj


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_repr_of_an_object_whose_constructor_never_ran(cls):
    text = repr(cls.__new__(cls))
    assert text.startswith(f"{cls.__name__}(")


def test_repr_of_objects_whose_constructor_raised_part_way(monkeypatch):
    for var in ("TQ_REDIS_URL", "TQ_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    dock = half_built(GRPOTransferDock, 0, 1, error=InvalidArgument)  # prompts_num=0, after its own fields
    assert repr(dock) == "GRPOTransferDock(<not initialized>)"
    chan = half_built(Channel, "bad name", "redis://127.0.0.1:1", "ns", 0, error=InvalidName)
    assert repr(chan) == "Channel(name='bad name', maxsize=0, namespace='ns')"
    client = half_built(TransferQueueClient, "redis://127.0.0.1:1", "bad:ns", error=InvalidName)
    assert repr(client).startswith("TransferQueueClient(namespace='bad:ns', client_id='client-")
    dataset = half_built(StreamingDataset, None, 2, 2, ["a"], "p", "t", error=ConfigError)  # no URL anywhere
    assert repr(dataset) == "StreamingDataset(<not initialized>)"
    loader = half_built(StreamingDataLoader, dataset, num_workers=-1, error=ValueError)
    assert repr(loader).startswith("StreamingDataLoader(dataset=StreamingDataset(")


def test_attrs_repr_never_raises():
    class Odd:
        @property
        def broken(self):
            raise RuntimeError("not yet")

        def __init__(self):
            self.loud = self

        def __repr__(self):
            raise ValueError("no")

    odd = Odd()
    assert attrs_repr(odd, ("broken", "loud", "missing")) == "Odd(loud=<unprintable>)"
