"""Which call a dead worker is charged to (``WorkerGroup._running_when_died``), with Ray replaced by
a small in-process fake whose object refs are settled by the test.

A worker runs its calls in submission order, so its death belongs to the earliest call still
pending on it, whichever call sees the death first. The case: a streamed generation's closing
request (``task gen``), waited on alone, surfaces the death of the worker that was running the
streamed inference (``task ref``, not waited on at that moment): the error must name ``ref``.
"""
from __future__ import annotations

import types

import pytest

from harness.backends.ray.driver.calls import WorkerFailedError, WorkerGroup


class _ActorDied(Exception):
    pass


class _TaskFailed(Exception):
    pass


class _Ref:
    def __init__(self, name: str):
        self.name, self.value, self.error = name, None, None

    @property
    def settled(self) -> bool:
        return self.value is not None or self.error is not None


class FakeRay:
    """``wait`` and ``get`` over refs settled by hand; an unsettled ref never becomes ready."""

    exceptions = types.SimpleNamespace(RayActorError=_ActorDied, RayTaskError=_TaskFailed)

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.settled][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        if ref.value is None:
            raise TimeoutError(ref.name)
        return ref.value


def _group() -> WorkerGroup:
    return WorkerGroup(FakeRay(), workers=[None, None], pids=[100, 101], task_timeout_s=60.0)


def test_death_is_charged_to_the_earliest_pending_call_even_if_another_is_being_waited_on():
    group = _group()
    ref_infer = _Ref("ref on 0")
    inference = group.submit([ref_infer], [0], "task ref")  # submitted first, not passed to collect
    close = _Ref("close on 0")
    closing = group.submit([close], [0], "task gen")
    ref_infer.error = close.error = _ActorDied("The actor died unexpectedly before finishing this task.")
    with pytest.raises(WorkerFailedError, match=r"task ref: the worker of device 0 \(pid 100\) died"):
        group.collect([closing])
    assert not group.healthy
    assert inference.left == {0}  # nothing of the other call was consumed


def test_a_call_that_finished_on_the_worker_is_not_charged():
    group = _group()
    step = _Ref("step on 0")
    earlier = group.submit([step], [0], "task gen")
    dead = _Ref("ref on 0")
    running = group.submit([dead], [0], "task ref")
    step.value = "done"  # finished on the worker before it died, result not collected yet
    dead.error = _ActorDied("died")
    with pytest.raises(WorkerFailedError, match=r"task ref: the worker of device 0"):
        group.collect([running])
    assert earlier.left == {0}


def test_collected_calls_leave_the_record_and_other_devices_do_not_count():
    group = _group()
    old = _Ref("old on 0")
    old.value = "ok"
    assert group.collect([group.submit([old], [0], "task reward")]).results == ["ok"]
    other = group.submit([_Ref("on device 1")], [1], "task critic")  # pending, but on another device
    dead = _Ref("ref on 0")
    dead.error = _ActorDied("died")
    with pytest.raises(WorkerFailedError, match=r"task ref: the worker of device 0"):
        group.collect([group.submit([dead], [0], "task ref")])
    assert other.left == {0}
