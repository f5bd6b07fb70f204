"""Fit the execution engines' shared constants on published measurements, with leave-one-source-out
cross-validation.

What is fitted: only the constants :data:`harness.core.engines.FITTED_PRIORS` names, one value per engine
(``kind/fit_key``), shared by every point that runs on that engine: never one per point. Which
constants a point informs follows from the engines its overrides resolve to.

How: robust least squares on ``log(predicted / measured)`` over the points, in the logs of the
constants, by Gauss-Newton with finite-difference sensitivities (each point re-simulated with one
constant doubled), a few iterations, with a weak pull (``PRIOR_WEIGHT``) of every constant towards
its prior, so a constant no point informs stays at its prior instead of drifting. The loss is
soft-L1 (``rho(r) = 2 (sqrt(1 + (r/s)^2) - 1)`` with ``s = ROBUST_SCALE_LOG``, log 2), solved by
iteratively reweighted least squares: a point within about 2x counts as its squared log error, one
further off about as its absolute log error, so a point whose setup the replay cannot express (a
published baseline with unknown configuration) cannot set an engine's constant on its own. Leave-one-source-out: the same
fit without one source's points, whose predictions are then simulated with that fold's constants.

Trial constants reach a simulation as the run config's ``engine.constants`` (:func:`with_constants`,
:func:`constants_override`): the table the run's engines are resolved with instead of the fit file's.

Runtime: every iteration simulates each point once per constant it depends on, plus once; about a
minute per iteration for the committed replay file on one CPU core. The result is written to
``data/engines/fitted.json`` with what produced it.
"""
from __future__ import annotations

import copy
import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from harness.core import engines as eng

PRIOR_WEIGHT = 0.1  # residual weight of log(constant / prior): a tenth of one point's
STEP_LOG = math.log(2.0)  # finite-difference step: each constant doubled
MAX_ABS_LOG = math.log(20.0)  # constants stay within 1/20x..20x of their priors
CONVERGED_STEP_LOG = 1e-3  # stop when no constant moves by more than 0.1%
ROBUST_SCALE_LOG = math.log(2.0)  # soft-L1 scale: residuals beyond a factor of about 2 count linearly


def robust_weight(residual_log: float) -> float:
    """IRLS weight of one residual under the soft-L1 loss (the loss's derivative in r^2)."""
    return 1.0 / math.sqrt(1.0 + (residual_log / ROBUST_SCALE_LOG) ** 2)


@dataclass(frozen=True)
class Constant:
    key: str  # kind/fit_key
    name: str  # constant name

    @property
    def label(self) -> str:
        return f"{self.key}:{self.name}"

    @property
    def prior(self) -> float:
        return eng.FITTED_PRIORS[self.key.split("/")[0]][self.name]


def table_of(values: dict[Constant, float]) -> eng.FittedTable:
    out: dict[str, dict[str, float]] = {}
    for c, v in values.items():
        out.setdefault(c.key, {})[c.name] = float(v)
    return out


def with_constants(cfg: DictConfig, values: dict[Constant, float]) -> DictConfig:
    """A copy of the composed ``cfg`` whose engines are resolved with ``values`` (every other fitted
    constant at its prior): ``engine.constants``."""
    out = copy.deepcopy(cfg)
    out.engine.constants = table_of(values)
    return out


def constants_override(values: dict[Constant, float]) -> str:
    """The command-line override that puts ``values`` in force (``engine.constants={...}``); each value
    written as Python's shortest round-trip repr, which Hydra reads back exactly."""
    table = table_of(values)
    body = ",".join(f"{key}:{{{','.join(f'{name}:{value!r}' for name, value in consts.items())}}}"
                    for key, consts in table.items())
    return f"engine.constants={{{body}}}"


def point_constants(cfg: Any) -> list[Constant]:
    """The fitted constants the engines of one composed config depend on (those its YAML leaves free)."""
    run = OmegaConf.to_object(cfg)
    out = []
    for kind, engine in eng.chosen_engines(run.engine, run.system).items():
        for const in eng.FITTED_PRIORS[kind]:
            if getattr(engine, const) is None and _matters(kind, engine, const):
                out.append(Constant(eng.fit_key(kind, engine), const))
    return out


def _matters(kind: str, engine: Any, const: str) -> bool:
    """Whether ``const`` can change a prediction on ``engine`` (only then is it fitted on its points)."""
    if const == "cpu_adam_gbps":
        return bool(getattr(engine, "optimizer_offload", False))
    if const == "host_time_scale":
        return getattr(engine, "kernels", "graph") == "eager"
    if const == "host_s_per_step":
        return getattr(engine, "kernels", "graph") == "graph"
    if const in ("reload_s", "reload_s_per_gb"):
        return getattr(engine, "refit", "transfer") == "reload"
    return True


Predict = Callable[[int, dict[Constant, float]], float]


def bumped(values: dict[Constant, float], c: Constant) -> dict[Constant, float]:
    """``values`` with ``c`` multiplied by the finite-difference step."""
    out = dict(values)
    out[c] = values[c] * math.exp(STEP_LOG)
    return out


def fit(num_points: int, deps: list[list[Constant]], measured: list[float], predict: Predict,
        include: Optional[list[int]] = None, iterations: int = 3,
        start: Optional[dict[Constant, float]] = None,
        prefetch: Optional[Callable[[list[tuple[int, dict[Constant, float]]]], None]] = None,
        ) -> dict[Constant, float]:
    """Constants minimising the soft-L1 loss of the log errors over the points ``include`` (default
    all); ``predict(i, values)`` simulates point ``i`` under ``values``. ``prefetch``, when given, is
    first handed every ``(i, values)`` an iteration will ask ``predict`` for (a caller that memoises
    ``predict`` can simulate them in parallel); the result does not depend on it."""
    include = list(range(num_points)) if include is None else include
    unknowns = sorted({c for i in include for c in deps[i]}, key=lambda c: c.label)
    values = {c: (start or {}).get(c, c.prior) for c in unknowns}
    if not unknowns:
        return values
    for _ in range(iterations):
        if prefetch is not None:
            prefetch([(i, v) for i in include
                      for v in (values, *(bumped(values, c) for c in unknowns if c in deps[i]))])
        rows, residuals = [], []
        for i in include:
            base = predict(i, values)
            row = np.zeros(len(unknowns))
            for j, c in enumerate(unknowns):
                if c in deps[i]:
                    row[j] = (math.log(predict(i, bumped(values, c))) - math.log(base)) / STEP_LOG
            residual = math.log(base / measured[i])
            w = math.sqrt(robust_weight(residual))
            rows.append(w * row)
            residuals.append(w * residual)
        for j, c in enumerate(unknowns):  # weak pull towards the prior
            row = np.zeros(len(unknowns))
            row[j] = PRIOR_WEIGHT
            rows.append(row)
            residuals.append(PRIOR_WEIGHT * math.log(values[c] / c.prior))
        a, r = np.asarray(rows), np.asarray(residuals)
        step, *_ = np.linalg.lstsq(a, -r, rcond=None)
        for j, c in enumerate(unknowns):
            log_rel = math.log(values[c] / c.prior) + float(step[j])
            values[c] = c.prior * math.exp(max(-MAX_ABS_LOG, min(MAX_ABS_LOG, log_rel)))
        if float(np.max(np.abs(step))) < CONVERGED_STEP_LOG:
            break
    return values


def write_fitted(values: dict[Constant, float], path: Path, replay_file: str, num_points: int,
                 cv: Optional[dict[str, Any]] = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"written_by": f"python -m harness.replay {replay_file} --fit --write",
           "date": datetime.date.today().isoformat(),
           "num_points": num_points,
           "note": "per-engine constants shared by every run of the engine (harness/core/engines.py); "
                   "see docs/VALIDATION.md",
           "constants": table_of(values)}
    if cv is not None:
        doc["leave_one_source_out"] = cv
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
