"""The collector policy while planning (harness.planning.collector): full collections deferred inside,
young ones kept, the thresholds found restored after, also on error and when nested."""
from __future__ import annotations

import gc

import pytest

from harness.planning.collector import DEFERRED_FULL_THRESHOLD, full_collections_deferred


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_full_collections_wait_and_the_thresholds_come_back(thresholds):
    with full_collections_deferred():
        assert gc.get_threshold() == (700, 10, DEFERRED_FULL_THRESHOLD)
        young, before = gc.get_stats()[0]["collections"], gc.get_stats()[2]["collections"]
        for _ in range(200_000):  # many young collections, a cycle each time
            a = []
            a.append(a)
        assert gc.get_stats()[0]["collections"] > young
        assert gc.get_stats()[2]["collections"] == before
        with full_collections_deferred():
            pass
        assert gc.get_threshold() == (700, 10, DEFERRED_FULL_THRESHOLD)
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_come_back_after_an_error(thresholds):
    with pytest.raises(RuntimeError):
        with full_collections_deferred():
            raise RuntimeError("planning failed")
    assert gc.get_threshold() == (700, 10, 10)
