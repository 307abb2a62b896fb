"""The run log's pickler: the standard one where it gives what cloudpickle would, cloudpickle otherwise.

No Ray: values are encoded and decoded as the executor's log writer does. A blob holding a pickled
value is signed with the run-log key; once its signature holds, decoding goes through the standard
unpickler alone, so a value the log records must read back in any process.
"""

from __future__ import annotations

import pickle

from ray import cloudpickle

from opgraph.actors.persistence import codec
from opgraph.kernel import SpawnRequest, create_operation


class _Spy:
    """Stands in for ``pickle.dumps``: counts the values it pickles."""

    def __init__(self) -> None:
        self.pickled: list[type] = []
        self.dumps = pickle.dumps

    def __call__(self, value: object, protocol: int | None = None) -> bytes:
        self.pickled.append(type(value))
        return self.dumps(value, protocol=protocol)


def test_an_importable_value_is_recorded_by_the_standard_pickler_and_reads_back_equal(monkeypatch):
    spy = _Spy()
    monkeypatch.setattr(pickle, "dumps", spy)
    request = SpawnRequest(instruction="look into it", context={"depth": 2})
    node = create_operation("bench_sleep", {"seconds": 0.05})
    data = codec.encode([["admitted", 1.0, node, request]])
    assert spy.pickled == [type(node), SpawnRequest]
    [[kind, when, node_back, request_back]] = codec.decode(data)
    assert (kind, when) == ("admitted", 1.0)
    assert node_back.model_dump() == node.model_dump() and request_back == request


def test_what_only_cloudpickle_holds_is_recorded_by_cloudpickle():
    class Local:  # defined in a function: the standard pickler cannot find it by name
        def __init__(self, n: int) -> None:
            self.n = n

    def double(x: int) -> int:
        return 2 * x

    data = codec.encode([["values", Local(7), lambda: 3, double]])
    [[kind, local, constant, doubled]] = codec.decode(data)
    assert kind == "values" and type(local).__name__ == "Local" and local.n == 7
    assert constant() == 3 and doubled(4) == 8


class Sample:
    """Defined in a test module, which the test session registers to travel by value."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_a_value_of_a_module_registered_to_travel_by_value_is_recorded_by_cloudpickle():
    assert __name__ in cloudpickle.list_registry_pickle_by_value()  # tests/conftest.py registers it
    data = codec.encode([[Sample(5), SpawnRequest(instruction="by reference")]])
    assert pickle.dumps(Sample(5), protocol=5) not in data  # the class travelled with it
    assert pickle.dumps(SpawnRequest(instruction="by reference"), protocol=5) in data
    [[sample, request]] = codec.decode(data)
    assert sample.n == 5 and request.instruction == "by reference"


def test_a_value_no_pickler_holds_is_refused_with_its_type():
    import threading

    from opgraph.kernel.errors import CodecError

    try:
        codec.encode([[threading.Lock()]])
    except CodecError as exc:
        assert "lock" in str(exc).lower()
    else:
        raise AssertionError("a lock was recorded")
