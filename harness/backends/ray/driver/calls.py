"""The device workers as one group, from the driver: requests sent, results collected, failures named.

:class:`WorkerGroup` sends a request (:mod:`harness.backends.ray.protocol`) to the devices of a
call in one of the protocol's dispatch modes and tracks the call (:class:`Call`, one Ray object
ref per device) until :meth:`WorkerGroup.collect` has every result
(:class:`~harness.backends.ray.replies.Result`, one per device). One thread starts and collects
every call (the iteration's dispatch loop, :mod:`harness.backends.ray.driver.iteration`).

Every wait is bounded: a worker whose process dies surfaces as ``RayActorError`` on its own call
at once, even while its peers are blocked in a collective with it, and :meth:`~WorkerGroup.collect` raises
:class:`WorkerFailedError` naming the device, its process and the task; a call that outlives its
deadline does the same. After a failure the group is unhealthy: closing it kills the workers
rather than waiting on them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from harness.backends.ray.protocol import Dispatch, Request
from harness.backends.ray.replies import Result


class WorkerFailedError(RuntimeError):
    """A device worker died, raised, or did not answer in time; the run is aborted."""


@dataclass
class Call:
    """Work started on some devices (one Ray object ref per device), collected by
    :meth:`WorkerGroup.collect`."""

    what: str
    refs: list
    devices: list[int]
    timeout_s: float
    deadline: float
    results: list = field(default_factory=list)
    left: set = field(default_factory=set)
    seq: int = 0  # submission order (a worker runs its calls in this order)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.refs)
        self.left = set(range(len(self.refs)))


class WorkerGroup:
    """One Ray actor per device (``workers[d]``), and the calls in flight on them."""

    def __init__(self, ray, workers: list, pids: list, task_timeout_s: float):
        self.ray, self.workers, self.pids, self.task_timeout_s = ray, workers, pids, task_timeout_s
        self.healthy = True
        self.num_calls = 0  # calls submitted so far (one per request sent, whatever its devices)
        # every submitted call not yet collected whole: a worker's death is charged to the call it was
        # running, which may be one the driver is not waiting on at the moment (_running_when_died)
        self._in_flight: dict[int, Call] = {}

    def start(self, request: Request, devices: Sequence[int] | None = None, mode: Dispatch = Dispatch.ONE_TO_ALL,
              shares: Sequence[Request] | dict[int, Request] | None = None) -> Call:
        """Send a request without waiting (see :meth:`collect`): ``ONE_TO_ALL``, ``request`` to
        ``devices`` (default: its allocation's mesh); ``BY_DP_RANK``, ``shares[k]`` to every device of
        dp replica ``k`` of ``request.allocation``; ``BY_DEVICE``, ``shares[d]`` to device ``d``."""
        alloc = request.allocation
        if mode == Dispatch.ONE_TO_ALL:
            devices = sorted(alloc.mesh) if devices is None else sorted(devices)
            ref = self.ray.put(request)  # one copy in the object store for every device
            per_device = {d: ref for d in devices}
        elif mode == Dispatch.BY_DP_RANK:
            per_device = {d: shares[k] for k in range(alloc.strategy.dp) for d in alloc.replica_devices(k)}
        else:
            per_device = dict(shares)
        devices = sorted(per_device)
        refs = [getattr(self.workers[d], request.method).remote(per_device[d]) for d in devices]
        return self.submit(refs, devices, f"task {request.task}")

    def call(self, request: Request, devices: Sequence[int] | None = None, **kwargs) -> list[Result]:
        """:meth:`start` and wait for every result (in device order)."""
        return self.collect([self.start(request, devices, **kwargs)]).results

    def submit(self, refs: list, devices: list[int], what: str, timeout_s: float | None = None) -> Call:
        """Track ``refs`` (one per device, in order) as one call that must finish within ``timeout_s``."""
        timeout_s = self.task_timeout_s if timeout_s is None else timeout_s
        self.num_calls += 1
        call = Call(what, list(refs), list(devices), timeout_s, time.monotonic() + timeout_s, seq=self.num_calls)
        self._in_flight[call.seq] = call
        return call

    def wait(self, refs: list, devices: list[int], what: str, timeout_s: float | None = None) -> list:
        """Results of ``refs`` (one per device, in order); raise WorkerFailedError on the first
        failure or when ``timeout_s`` passes, without waiting for the others."""
        return self.collect([self.submit(refs, devices, what, timeout_s)]).results

    def _running_when_died(self, device: int, failed: Call) -> Call:
        """The call the dead worker of ``device`` was running, among every call in flight on it (the
        death can surface first on a later call the driver waits on while it does not wait on the
        earlier one: a stream's closing request queued behind the inference that died). A worker
        runs its calls in submission order, so it is the earliest one whose result on ``device`` is
        not a success: an earlier call can have finished on the worker with its result not yet
        collected here (a streamed generation step beside the inference that died). The death
        reaches every pending result within moments; a result still unknown after a second counts
        as not a success."""
        ray = self.ray
        calls = list(self._in_flight.values())
        mine = sorted(((c, c.refs[j]) for c in calls for j in list(c.left) if c.devices[j] == device),
                      key=lambda cr: cr[0].seq)
        if not mine:
            return failed
        ray.wait([ref for _, ref in mine], num_returns=len(mine), timeout=1.0)
        for c, ref in mine:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # died with the worker, or not known yet
                return c
        return failed

    def collect(self, calls: list[Call]) -> Call:
        """Wait until one of ``calls`` has all its results and return it. Raises WorkerFailedError
        on the first failure of any call, or when a call outlives its deadline, without waiting for
        the others (their workers may be blocked in a collective with a dead peer)."""
        ray = self.ray
        owner = {ref: (call, i) for call in calls for i, ref in enumerate(call.refs) if i in call.left}
        while True:
            for call in calls:
                if not call.left:
                    self._in_flight.pop(call.seq, None)
                    return call
            now = time.monotonic()
            first = min(calls, key=lambda c: c.deadline)
            if first.deadline <= now:
                self.healthy = False
                stuck = sorted(first.devices[i] for i in first.left)
                raise WorkerFailedError(f"{first.what}: devices {stuck} did not finish within {first.timeout_s:.0f} s "
                                        f"(backend.options.task_timeout_s); the run is aborted")
            ready, _ = ray.wait(list(owner), num_returns=1, timeout=first.deadline - now)
            for ref in ready:
                call, i = owner.pop(ref)
                d = call.devices[i]
                try:
                    call.results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self.healthy = False
                    call = self._running_when_died(d, call)
                    raise WorkerFailedError(f"{call.what}: the worker of device {d} (pid {self.pid(d)}) died; the run "
                                            f"is aborted and the other workers are stopped. Ray: "
                                            f"{str(e).splitlines()[0]}") from None
                except ray.exceptions.RayTaskError as e:
                    self.healthy = False
                    others = list(owner)  # every in-flight ref of every call
                    dead = self._dead_peer(others, [owner[r][0].devices[owner[r][1]] for r in others])
                    if dead is not None:  # a peer's death broke this worker's collective: report the cause
                        raise WorkerFailedError(
                            f"{call.what}: the worker of device {dead} (pid {self.pid(dead)}) died; the run is "
                            f"aborted and the other workers are stopped (device {d} then failed: "
                            f"{str(e).strip().splitlines()[-1]})") from None
                    raise WorkerFailedError(f"{call.what}: failed on device {d}: {e}") from None
                call.left.discard(i)

    def pid(self, device: int) -> Any:
        return self.pids[device] if device < len(self.pids) else "?"

    def _dead_peer(self, refs: list, devices: list[int], grace_s: float = 5.0) -> int | None:
        """A device among ``refs`` whose worker died, waiting at most ``grace_s`` for Ray to notice
        (a gloo peer sees the closed connection before Ray reports the dead process)."""
        ray = self.ray
        index = {ref: i for i, ref in enumerate(refs)}
        left, deadline = list(refs), time.monotonic() + grace_s
        while left and deadline > time.monotonic():
            ready, left = ray.wait(left, num_returns=1, timeout=deadline - time.monotonic())
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    return devices[index[ref]]
                except Exception:  # noqa: BLE001 - another failure, not a death
                    continue
        return None
