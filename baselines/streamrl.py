"""StreamRL: disaggregated stream generation with a length ranker (Zhong et al., "StreamRL:
Scalable, Heterogeneous, and Elastic RL for LLMs with Disaggregated Stream Generation", arXiv
2504.15930; by RLHFuse's authors): ``+system=streamrl``.

What the original does, as far as the paper's abstract and the descriptions of it in later papers
say (the paper's own text was not at hand; Seer, arXiv 2511.14617, section 4, and RLBoost, arXiv
2510.19225, section 6, re-implement it):

- **disaggregation and stream generation**: generation (its Stream Generation Service) and
  training on GPUs of their own; each sample goes to the trainer side the moment it finishes, so
  the sample-level work there (reference log-probs, rewards) runs while generation goes on;
- **asynchronous mode**: one-step off-policy, the next batch generated while this one trains, the
  weight transfer overlapping training (StreamRL-Async; StreamRL-Sync keeps the stage boundary of
  the synchronous algorithm);
- **output-length ranker and skewness-aware dispatch**: a small model ranks each prompt's expected
  output length; the top 20% (``alpha``) are treated as the long tail and dispatched to dedicated
  generation instances, which run them at a smaller batch (a decode step's latency grows with the
  batch, so the longest samples finish sooner), the rest to the other instances; the number of
  long-tail instances is enumerated, each split's latency estimated from historical lengths (P90
  for the long tail, P50 for the rest);
- **stage balancing**: the generation:training GPU split found by searching, over profiled
  per-stage times, the split that minimises the longer stage.

What we reproduce is :mod:`baselines.refit`'s plan (vLLM engines, whose constants stand for
StreamRL's in-house engine; the training engine ``engine.training``, Megatron-style by default, as
StreamRL's trainer is 3D-parallel) with:

- generation on ``system.generation_gpus`` of its own (0: the split searched among a quarter, half
  and three quarters of the cluster by the step the simulator gives each: stage balancing with the
  simulator as the profile, on a coarser grid than the original's), the weights broadcast each
  iteration;
- ``system.asynchronous`` (default true): one-step off-policy batched rollout
  (:mod:`harness.planning.iterations`); the training GPUs then train the previous batch while
  generation runs, so the samples' inference waits for the batch as in ``one_step_off``;
- ``system.asynchronous=false`` (StreamRL-Sync): synchronous, finished samples streamed into the
  recomputation of log-probs and the reference model's (under PPO also the reward and critic
  models') inference on the training GPUs while generation goes on (``Task.stream_from``); the
  training steps wait for the whole batch (StreamRL's dynamic mini-batches are not modelled);
- length dispatch (``GenerationPolicy.dispatch``, :func:`harness.planning.taskmodels.generation.dispatch_samples`):
  the ranker modelled by its recall, ``system.ranker_recall`` of the truly longest
  ``system.long_frac`` caught (0.87 and 0.2: the top-20% recall reported for its Qwen2.5-7B ranker,
  as later papers quote it), its misses samples of the rest; whatever the workload's prompts say of
  their lengths (``workload.output_len.prompt_sigma``), the recall is what is modelled. The
  long-tail instances (``system.long_instances``; 0: the number among 1, 2, 4, ... below the
  engines' count that gives the shortest step, each scored by simulating the workload's batch on
  the plan found without a dispatch, where the original estimates them from P90/P50 lengths). Inside an instance the flagged samples
  are admitted in batch order, not longest first.

Not modelled: the ranker's own cost and its online updates, dynamic mini-batches in training,
heterogeneous GPUs and cross-datacenter weight transfer, elastic scaling of the generation pool.
``backend=ray`` refuses the length dispatch before any work.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from baselines.refit import RefitSystem
from harness.core.config import SystemConfig
from harness.core.plan import LengthDispatch, Plan, TaskKind
from harness.errors import ConfigError, PlanError
from harness.planning.estimate import simulated_makespan_s
from harness.system import PlanContext, register_system_config


@dataclass
class StreamRLConfig(SystemConfig):
    name: str = "streamrl"
    impl: str = "baselines.streamrl.StreamRL"
    asynchronous: bool = True  # StreamRL-Async: one-step off-policy; false: StreamRL-Sync
    generation_gpus: int = 0  # GPUs of the Stream Generation Service; 0 = searched (stage balancing)
    long_frac: float = 0.2  # alpha: the share of each batch the ranker flags as the long tail
    ranker_recall: float = 0.87  # of the truly longest long_frac, the share the ranker flags
    long_instances: int = 0  # generation instances for the flagged samples; 0 = enumerated
    rollout_tp: int = 0  # tensor parallelism of a generation instance; 0 = the fastest that fits
    max_num_seqs: int = 1024  # sequences per generation instance
    train_layout: Optional[str] = None  # the trainer's (dp, tp, pp); null = searched
    zero_stage: int = 1
    generation_engine: str = "vllm"
    training_engine: str = "megatron"


class StreamRL(RefitSystem):
    cfg: StreamRLConfig
    KNOBS = {"rollout_tp": "rollout_tp", "max_num_seqs": "max_num_seqs", "train_layout": "train_layout",
             "zero_stage": "zero_stage", "generation_gpus": "generation_gpus"}

    def refit(self, ctx: PlanContext, **knobs) -> Plan:
        knobs.setdefault("max_staleness", 1 if self.cfg.asynchronous else None)
        # streamed inference runs on the trainer's GPUs: in the asynchronous mode they are training
        # the previous batch while generation runs, and the stream would hold generation back
        knobs.setdefault("stream_inference", not self.cfg.asynchronous)
        return super().refit(ctx, **knobs)

    def plan(self, ctx: PlanContext) -> Plan:
        c = self.cfg
        try:  # the dispatch's own checks, named by the knobs that set it
            LengthDispatch(1, c.long_frac, c.ranker_recall)
        except PlanError as e:
            raise ConfigError(f"streamrl (system.long_frac, system.ranker_recall): {e}") from None
        if c.long_instances < 0:
            raise ConfigError(f"system.long_instances={c.long_instances}: instances, >= 0 (0 = enumerated)")
        base = self.pooled(ctx)
        dp = base.tasks_of(TaskKind.GENERATE)[0].allocation.strategy.dp
        if c.long_instances:
            if c.long_instances >= dp:
                raise ConfigError(f"system.long_instances={c.long_instances}: the plan has {dp} generation "
                                  f"instances; the long tail gets fewer than all of them")
            return self._with_dispatch(ctx, c.long_instances, base)
        if dp < 2:
            base.notes["long_instances"] = "none: one generation instance, nothing to dispatch"
            return base
        best = None
        for n in (1 << k for k in range(dp.bit_length()) if (1 << k) < dp):
            try:
                plan = self._with_dispatch(ctx, n, base)
            except PlanError:
                continue
            step = simulated_makespan_s(ctx, plan)
            if best is None or step < best[0]:
                best = (step, n, plan)
        if best is None:
            raise PlanError(f"streamrl: no number of long-tail instances among the {dp} generation instances plans")
        best[2].notes["long_instances"] = f"{best[1]} of {dp} (enumerated)"
        return best[2]

    def _with_dispatch(self, ctx: PlanContext, num_long: int, base: Plan) -> Plan:
        """``base`` (its split, layouts and engines searched without a dispatch) with the length
        dispatch to ``num_long`` instances: a dispatch changes neither layouts nor memory."""
        c = self.cfg
        plan = dataclasses.replace(base, generation=dataclasses.replace(
            base.generation, dispatch=LengthDispatch(num_long, c.long_frac, c.ranker_recall)),
            notes=dict(base.notes))
        plan.validate(ctx.num_devices)
        plan.notes["long_instances"] = f"{num_long} of {plan.tasks_of(TaskKind.GENERATE)[0].allocation.strategy.dp}"
        plan.notes["ranker"] = f"recall {c.ranker_recall} of the longest {c.long_frac:.0%} of each batch"
        return plan


register_system_config("streamrl", StreamRLConfig)
