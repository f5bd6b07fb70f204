"""``backend=ray``: real execution of a Plan on Ray actors, one per device (docs/DESIGN.md sections 2, 6).

Modules: :mod:`.backend` (the driver: Ray, workers, bounded waits), :mod:`.iteration` (a PPO
iteration task by task), :mod:`.experience` (prompts, rollout tensors, rewards, GAE, mini-batches),
:mod:`.worker` (the per-device actor), :mod:`.passes` (generation, inference, training with
pipeline schedules), :mod:`.replica` / :mod:`.zero3` (a model in a layout; DeepSpeed ZeRO-3),
:mod:`.layout` / :mod:`.tp` (pieces of a model per (dp, tp, pp) coordinate; Megatron-style tensor
parallelism), :mod:`.movement` (weight movement with collectives), :mod:`.optim` (dp gradient
sync and Adam, ZeRO 0-3), :mod:`.comm` (process groups, point-to-point), :mod:`.options`.

Importing this package does not import Ray; :class:`RayBackend` does when it starts.
"""
from harness.backends.ray.backend import RayBackend, WorkerFailedError

__all__ = ["RayBackend", "WorkerFailedError"]
