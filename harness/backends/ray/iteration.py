"""One PPO iteration of a plan on the device workers (driver side).

The plan's units run in dependency order through the shared interpreter
(:class:`harness.interpreter.PlanInterpreter`, one handler per task kind), each on its own mesh; the driver routes per-sample
data (prompts, responses, log-probs, values, scores, advantages) between them. Before a task
computes with a model it checks that the model's weights in the task's layout are current: the
home layout always is; a copy is current after a weight-movement task refreshed it since the last
training step. A plan that omits a needed movement still runs correctly: the move is done inside
the consuming task and shows as a ``realloc`` span of that task.

RL metrics go to ``StepTrace.counters`` under ``rl/``; weight digests (sum, L2, distance from the
initial weights) to ``rl/<model>_param_{sum,l2}`` and ``rl/<model>_update_l2`` and, with the SHA,
to ``StepTrace.extra["param_digest"]``.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from harness.backends.ray import experience as ex
from harness.backends.ray.layout import assemble
from harness.backends.ray.worker import layout_key
from harness.interpreter import PlanInterpreter, Unit
from harness.plan import Allocation, Plan, TaskKind
from harness.trace import PipelineRun, SampleRecord, StepTrace
from harness.workload import Batch

INFERENCE_OUTPUT = {"ref": "logprobs", "reward": "score", "critic": "values"}


class Iteration(PlanInterpreter):
    def __init__(self, backend, plan: Plan, iteration: int, batch: Batch):
        self.b, self.plan, self.iteration, self.batch = backend, plan, iteration, batch
        self.opts = backend.opts
        self.trace = StepTrace(iteration=iteration, num_devices=backend.ctx.num_devices)
        self.rollout: ex.Rollout | None = None
        self.outputs: dict[str, np.ndarray] = {}  # model role -> its inference output
        self.train_data: dict[str, np.ndarray] | None = None
        self.t0 = time.time()

    def handlers(self):
        return {TaskKind.WEIGHT_MOVEMENT: self._movement_unit, TaskKind.GENERATE: self._generate_unit,
                TaskKind.INFERENCE: self._inference_unit, TaskKind.TRAIN: self._train_unit}

    def run(self) -> StepTrace:
        self.prompts = ex.prompt_tokens(self.b.ctx.seed, self.iteration, self.batch, self.b.args["actor"].vocab_size)
        self.run_units(self.plan)
        if self.opts.digest:
            self._digest()
        return self.trace

    # ---- handlers, one per task kind (fused stages and streams are refused before setup) -----
    def _movement_unit(self, unit: Unit) -> None:
        (task,) = unit.tasks
        m = self.plan.movement_of(task.name)
        source = m.source if self._current(m.model, m.source) else self.b.home[m.model]
        self._move(task.name, m.model, source, m.target)

    def _generate_unit(self, unit: Unit) -> None:
        (task,) = unit.tasks
        self._generate(task.name, task.allocation)

    def _inference_unit(self, unit: Unit) -> None:
        for task in unit.tasks:
            self._infer(task.name, task.model, task.allocation)

    def _train_unit(self, unit: Unit) -> None:
        for task in unit.tasks:
            self._train(task.name, task.model, task.allocation, unit.stage)

    # ---- weights ----------------------------------------------------------------------------
    def _current(self, role: str, alloc: Allocation) -> bool:
        b = self.b
        if layout_key(alloc) == layout_key(b.home[role]):
            return True
        return b.valid.get((role, layout_key(alloc))) == b.version[role]

    def _move(self, task: str, role: str, source: Allocation, target: Allocation) -> None:
        devices = sorted(set(source.mesh) | set(target.mesh))
        results = self.b._call(task, "move", role, target, None, devices, source)
        self.b.spans_from(task, results, self.t0, self.trace)
        self.b.valid[(role, layout_key(target))] = self.b.version[role]

    def _ensure(self, task: str, role: str, alloc: Allocation) -> None:
        if not self._current(role, alloc):  # the plan has no movement for it: move inside the task
            self._move(task, role, self.b.home[role], alloc)

    # ---- tasks ------------------------------------------------------------------------------
    def _generate(self, name: str, alloc: Allocation) -> None:
        self._ensure(name, "actor", alloc)
        policy, w = self.plan.generation, self.b.ctx.workload
        payload = {"prompts": self.prompts, "target_lens": self.batch.output_lens.tolist(),
                   "batching": policy.batching, "max_batch_size": policy.max_batch_size,
                   "temperature": self.opts.temperature,
                   "sampling_seed": ex.stable_seed("sampling", self.b.ctx.seed, self.iteration),
                   "kv_capacity": int(self.batch.prompt_lens.max() + w.max_gen_len)}
        results = self.b._call(name, "generate", "actor", alloc, payload)
        self.b.spans_from(name, results, self.t0, self.trace)
        responses = {}
        for part in self.b.outputs(results):
            for sample_id, tokens, logprobs, finish in part:
                responses[sample_id] = (tokens, logprobs)
                self.trace.samples.append(SampleRecord(int(sample_id), int(self.batch.prompt_lens[sample_id]),
                                                       len(tokens), finish - self.t0))
        missing = sorted(set(range(self.batch.num_samples)) - set(responses))
        if missing:
            raise RuntimeError(f"generation returned no response for samples {missing[:8]}")
        self.trace.samples.sort(key=lambda s: s.sample_id)
        self.rollout = ex.build_rollout(self.prompts, responses)

    def _infer(self, name: str, role: str, alloc: Allocation) -> None:
        self._ensure(name, role, alloc)
        r = self.rollout
        what = INFERENCE_OUTPUT[role]
        payload = {"tokens": r.tokens, "attn": r.attn, "last_index": r.last_index, "what": what,
                   "micro_batch_size": self.b.ctx.workload.micro_batch_size, "temperature": self.opts.temperature}
        results = self.b._call(name, "infer", role, alloc, payload)
        self.b.spans_from(name, results, self.t0, self.trace)
        shape = (len(r.prompt_lens),) if what == "score" else r.action_mask.shape
        self.outputs[role] = ex.scatter_rows(self.b.outputs(results), shape)

    def _experience(self) -> dict[str, np.ndarray]:
        if self.train_data is None:
            r, o = self.rollout, self.outputs
            derived, stats = ex.advantages(r, o["ref"], o["critic"], o["reward"], self.opts.kl_coef,
                                           self.opts.gamma, self.opts.lam, self.opts.whiten_advantages)
            self.train_data = {"tokens": r.tokens, "attn": r.attn, "action_mask": r.action_mask,
                               "old_logprobs": r.old_logprobs, **derived}
            for key, value in stats.items():
                self.trace.counters[f"rl/{key}"] = value
        return self.train_data

    def _train(self, name: str, role: str, alloc: Allocation, stage) -> None:
        data = self._experience()
        keep = ("tokens", "attn", "action_mask", "old_logprobs", "advantages") if role == "actor" else \
            ("tokens", "attn", "action_mask", "old_values", "returns")
        minibatches = ex.minibatch_indices(len(data["tokens"]), self.plan.mini_batch_size, self.b.ctx.seed,
                                           self.iteration)
        payload = {"data": {k: data[k] for k in keep}, "minibatches": minibatches,
                   "micro_batch_size": stage.micro_batch_size, "loss": role, "temperature": self.opts.temperature,
                   "clip_eps": self.opts.clip_eps, "value_clip_eps": self.opts.value_clip_eps}
        pipe = next(iter(stage.schedule.pipes.values()))
        payload["actions_by_stage"] = {p: [a.token() for a in stage.schedule.order.get(r, []) if a.is_compute
                                           and a.pipe == pipe.name and a.stage == p]
                                       for p, r in enumerate(pipe.stage_to_rank)}
        results = self.b._call(name, "train", role, alloc, payload)
        self.b.spans_from(name, results, self.t0, self.trace)
        self.b.version[role] += 1
        totals: dict[str, float] = {}
        for part in self.b.outputs(results):
            for key, value in part.get("stats", {}).items():
                totals[key] = totals.get(key, 0.0) + value
        n = len(minibatches)
        prefix = "policy" if role == "actor" else "value"
        if "loss" in totals:
            self.trace.counters[f"rl/{prefix}_loss"] = totals["loss"] / n
            self.trace.counters[f"rl/{prefix}_clipfrac"] = totals["clipfrac"] / n
        if "approx_kl" in totals:
            self.trace.counters["rl/ppo_kl"] = totals["approx_kl"] / n
        self._pipelines(name, alloc, results, n)

    def _pipelines(self, name: str, alloc: Allocation, results: list[dict], num_minibatches: int) -> None:
        """One PipelineRun per mini-batch over dp replica 0, tp rank 0 (its pp stages)."""
        s = alloc.strategy
        ranks = {alloc.device(0, p, 0) for p in range(s.pp)}
        mine = [r for r in results if r["rank"] in ranks]
        for j in range(num_minibatches):
            start = min(r["out"]["runs"][j][0] for r in mine)
            end = max(r["out"]["runs"][j][1] for r in mine)
            compute = sum(min(e, end) - max(st, start) for r in mine for kind, st, e, *_ in r["spans"]
                          if kind in ("forward", "backward") and st < end and e > start)
            self.trace.pipelines.append(PipelineRun(name, start - self.t0, end - start, s.pp, compute, 0.0))

    # ---- digest -----------------------------------------------------------------------------
    def _digest(self) -> None:
        digests = {}
        for role in ("actor", "critic"):
            alloc = self.b.home[role]
            results = self.b._call(f"digest_{role}", "state", role, alloc, None)
            pieces = {tuple(p["coord"]): {n: torch.tensor(v) for n, v in p["state"].items()}
                      for p in self.b.outputs(results)}
            s = alloc.strategy
            pp, tp = (1, 1) if s.zero_stage == 3 else (s.pp, s.tp)
            state = assemble(pieces, self.b.args[role], pp, tp)
            d = ex.param_digest(state, self.b.init_states.get(role))
            digests[role] = d
            for key, counter in (("sum", "param_sum"), ("l2", "param_l2"), ("update_l2", "update_l2")):
                if key in d:
                    self.trace.counters[f"rl/{role}_{counter}"] = d[key]
            if self.opts.dump_weights_dir:
                folder = Path(self.opts.dump_weights_dir)
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(state, folder / f"{role}.pt")
        self.trace.extra["param_digest"] = digests
