"""``backend=ray``: real execution of a Plan on Ray actors, one per device (docs/DESIGN.md sections 2, 6).

- :mod:`.driver`: the driver (the Backend, the cluster, the worker group, a PPO iteration's
  dispatch and data);
- :mod:`.worker`: the per-device actor and the work it does (generation, inference, training with
  pipeline schedules, streamed generation);
- the boundary between them, typed: :mod:`.protocol` (one request per worker method, dispatch
  modes), :mod:`.replies` (each method's result), :mod:`.settings` (a worker's options and set-up);
- :mod:`.config` (the typed ``backend.options``) and :mod:`.rewards` (the programmatic reward, which
  the driver requests and the worker computes).

Models, layouts, weight movement and optimizers on each device are the model-parallel runtime
:mod:`harness.real.parallel`. Importing this package does not import Ray; :class:`RayBackend` does
when it starts.
"""
from harness.backends.ray.driver.backend import RayBackend
from harness.backends.ray.driver.calls import WorkerFailedError

__all__ = ["RayBackend", "WorkerFailedError"]
