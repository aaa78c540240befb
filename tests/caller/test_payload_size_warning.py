"""Large payloads warn once per function, naming what is large and pointing to kinetic_prefect.Data."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kinetic_prefect.caller.payload import build_call_payload

pytestmark = pytest.mark.no_server

MiB = 2**20


def _payload_warnings(calls) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls()
    return [str(w.message) for w in caught if "payload" in str(w.message)]


def test_a_large_captured_array_warns_once_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KINETIC_PAYLOAD_WARN_BYTES", str(2 * MiB))
    weights = np.ones(3 * MiB // 8)
    labels = ["cat", "dog"]

    def predict(x):
        return weights.sum() + x + len(labels)

    messages = _payload_warnings(lambda: [build_call_payload(predict, (i,), {}, None) for i in range(5)])
    assert len(messages) == 1, messages
    message = messages[0]
    assert "predict()" in message and "'weights'" in message and "ndarray" in message and "3.0 MiB" in message
    assert "'labels'" not in message, "only what is large is named"
    assert "kinetic_prefect.Data" in message and "KINETIC_PAYLOAD_WARN_BYTES" in message


def test_a_large_global_of_a_script_is_named():
    namespace = {"__name__": "__main__", "np": np}
    exec("TABLE = np.zeros(11 * 2**20 // 8)\ndef lookup(i):\n    return TABLE[i]\n", namespace)
    messages = _payload_warnings(lambda: [build_call_payload(namespace["lookup"], (i,), {}, None) for i in range(3)])
    assert len(messages) == 1, messages  # the default threshold is 10 MiB
    assert "global 'TABLE'" in messages[0] and "lookup()" in messages[0]


def test_a_large_argument_warns_once_naming_it(monkeypatch):
    monkeypatch.setenv("KINETIC_PAYLOAD_WARN_BYTES", str(2 * MiB))

    def fit(data, epochs=1):
        return len(data) * epochs

    def calls():
        for i in range(4):
            build_call_payload(fit, (np.full(4 * MiB // 8, i),), {"epochs": 2}, None)

    messages = _payload_warnings(calls)
    assert len(messages) == 1, messages
    assert "argument 'data'" in messages[0] and "fit()" in messages[0] and "4.0 MiB" in messages[0]
    assert "'epochs'" not in messages[0]
    assert "kinetic_prefect.Data" in messages[0]


def test_small_payloads_do_not_warn_and_zero_turns_the_warning_off(monkeypatch):
    def small(x):
        return x

    assert _payload_warnings(lambda: build_call_payload(small, (1,), {}, None)) == []
    monkeypatch.setenv("KINETIC_PAYLOAD_WARN_BYTES", "0")

    def big(x):
        return x

    assert _payload_warnings(lambda: build_call_payload(big, (np.ones(12 * MiB // 8),), {}, None)) == []
