"""The driver side of ``backend=ray``: a single controller (as in verl/HybridFlow) that runs a plan's
iterations on the device workers (:mod:`harness.backends.ray.worker`), split by responsibility:

- :mod:`.backend`: :class:`~.backend.RayBackend`, the Backend: checks before anything starts,
  set-up, one iteration after another, close;
- :mod:`.cluster`: starts or joins Ray, places one worker per device and wires the workers into one
  ``torch.distributed`` job;
- :mod:`.calls`: the workers as one group: typed requests sent in explicit dispatch modes, bounded
  waits, failures named by device and task;
- :mod:`.options`: the plan features and option combinations the backend runs (the rest is refused
  before Ray starts);
- :mod:`.homes`: each model's home layout and which copies of its weights are current;
- :mod:`.iteration`: one PPO iteration: its units started by the planning library's one scheduler,
  each run by its handler (:mod:`.training` for training stages, :mod:`.inter_stage` for a streamed
  generation and the inference that consumes it);
- :mod:`.experience`: prompts, rollout tensors, rewards, GAE and mini-batches (the iteration's data);
- :mod:`.off_policy`, :mod:`.continuous`, :mod:`.partial`: off-policy plans' batched, continuous and
  partial rollouts across the run's iterations.

Weights never pass through the driver during an iteration: they move between workers with
collectives; the driver routes only the small per-sample data between tasks.
"""
