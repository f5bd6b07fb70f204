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
:mod:`harness.real.parallel`. The Backend is :class:`harness.backends.ray.driver.backend.RayBackend`
(``conf/backend/ray.yaml``'s ``_target_``). Importing this package imports neither torch nor Ray, so
the typed ``backend.options`` (:mod:`.config`) cost a command that never executes on Ray nothing;
``RayBackend`` imports torch, and Ray when it starts.
"""
