"""The worker side of ``backend=ray``: what runs inside each device's Ray actor.

- :mod:`.device`: :class:`~.device.DeviceWorker`, the actor: its process groups, its model replicas,
  one method per request of :mod:`harness.backends.ray.protocol`, each answering with a typed
  :mod:`harness.backends.ray.replies` result;
- :mod:`.passes`: generation and inference passes on one device's replica;
- :mod:`.pipeline`: a training stage's lowered pipeline schedule run verbatim, and the PPO losses;
- :mod:`.streaming`: streamed generation sessions and long-tail migration of their samples
  (RLHFuse section 4).

The model-parallel runtime these drive (replicas, layouts, weight movement, optimizers, process
groups) is :mod:`harness.real.parallel`. Nothing here imports the driver
(:mod:`harness.backends.ray.driver`); both sides share only the boundary's types
(:mod:`~harness.backends.ray.protocol`, :mod:`~harness.backends.ray.replies`,
:mod:`~harness.backends.ray.settings`) and the programmatic reward (:mod:`~harness.backends.ray.rewards`).
"""
