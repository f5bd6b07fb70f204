"""Model-parallel execution of the real models on ``torch.distributed``, independent of how the
processes were launched: where each parameter lives in a (dp, tp, pp) layout (``layout``),
Megatron-style tensor parallelism (``tp``), process groups and point-to-point exchanges (``comm``),
data-parallel gradient sync and flat Adam (``optim``), a model replica in one layout as one device
sees it (``replica``), ZeRO-3 with DeepSpeed (``zero3``), weight movement between layouts
(``movement``) and a device's set of replicas (``store``).

The Ray backend's device workers (:mod:`harness.backends.ray.worker`) drive it; nothing here imports
Ray or a backend (tests/architecture/test_layers.py holds it so), so another launcher (torchrun, a
cluster scheduler) could drive the same code.
"""
