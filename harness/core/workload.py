"""Iteration inputs: prompt lengths and target output lengths drawn from the workload config.

Systems benchmarks of RLHF (RLHFuse section 7, ReaLHF, verl) control output lengths: each prompt
carries a target length drawn from a distribution fitted to the dataset, and generation ignores
EOS until it is reached. Long tails matter (RLHFuse section 2.2: P99.9 of output length is more
than 10x the median), so the default distribution is a lognormal clipped at ``max_gen_len``.

Batches are a pure function of (workload config, seed, iteration): every system sees the same
samples in the same iteration, so differences in throughput come from the systems alone.

A workload can also be read from a JSON-lines file (``workload=jsonl workload.path=<file>``; format,
tokenisation rule and draw order in the section "Workloads read from a JSON-lines file" below): the
sim backend then uses the file's prompt and response lengths, and ``backend=ray`` generates from
its prompts (``Batch.prompt_ids``), again stopping at each record's response length.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.core.config import LengthDistConfig, WorkloadConfig
from harness.errors import ConfigError
from harness.core.files import file_kind


@dataclass(frozen=True)
class Batch:
    iteration: int
    prompt_lens: np.ndarray  # int64 [global_batch_size]
    output_lens: np.ndarray  # int64 [global_batch_size], target tokens to generate
    # File workloads only (None for synthetic ones): each sample's prompt token ids (None for a
    # record that gave only prompt_len; backend=ray then draws random tokens as for synthetic
    # prompts), and the 1-based file line each sample came from.
    prompt_ids: tuple[np.ndarray | None, ...] | None = None
    source_lines: np.ndarray | None = None
    # Dynamic sampling only (None otherwise): the generation rounds that filled the batch, each a
    # Batch of the samples generated in it; the samples above are the kept ones, sample i being
    # sample trained_ids[i] of the rounds' samples laid end to end (make_sampled_batch).
    rounds: tuple[Batch, ...] | None = None
    trained_ids: np.ndarray | None = None
    # A round's only: per group (prompt), how many of its responses pass the verifier
    group_num_correct: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.prompt_lens.shape[0])

    @property
    def total_num_tokens(self) -> int:
        return int(self.prompt_lens.sum() + self.output_lens.sum())


def median_at(dist: LengthDistConfig, iteration: int) -> float:
    """The distribution's median in iteration ``iteration``: ``median x (1 + growth_per_iteration)^iteration``
    (lengths drifting over training, as reasoning RL's responses grow; before the clip to [min, max])."""
    return dist.median * (1.0 + dist.growth_per_iteration) ** iteration


def sample_lengths(dist: LengthDistConfig, num: int, rng: np.random.Generator, cap: int | None = None,
                   iteration: int = 0, group_size: int = 1) -> np.ndarray:
    """``num`` lengths of ``dist`` in iteration ``iteration`` (its median drifted: :func:`median_at`;
    a uniform distribution shifts by the median's change), rounded and clipped to [min, max], and to
    ``cap``. With ``dist.prompt_sigma`` the ``num / group_size`` groups of ``group_size``
    consecutive lengths (the responses to one prompt) share a factor ``exp(N(0, prompt_sigma))``,
    each length its own ``exp(N(0, sqrt(sigma^2 - prompt_sigma^2)))``: the same marginal lognormal,
    with lengths correlated within a prompt (hard prompts draw long responses); the factors are drawn
    after the lengths, so without them the draws are as they were."""
    upper = dist.max if cap is None else min(dist.max, cap)
    median = median_at(dist, iteration)
    if dist.kind == "constant":
        values = np.full(num, median, dtype=float)
    elif dist.kind == "lognormal":
        within = math.sqrt(dist.sigma ** 2 - dist.prompt_sigma ** 2) if dist.prompt_sigma else dist.sigma
        values = rng.lognormal(mean=np.log(median), sigma=within, size=num)
        if dist.prompt_sigma:
            if num % group_size:
                raise ConfigError(f"{num} lengths are not whole groups of {group_size}")
            values *= np.repeat(np.exp(rng.normal(0.0, dist.prompt_sigma, size=num // group_size)), group_size)
    elif dist.kind == "uniform":  # integers in [min, max], each equally likely
        values = rng.integers(dist.min, dist.max, size=num, endpoint=True).astype(float) + (median - dist.median)
    else:
        raise ConfigError(f"unknown length distribution kind {dist.kind!r} "
                          f"(expected one of {', '.join(LENGTH_KINDS)})")
    return np.clip(np.rint(values), dist.min, upper).astype(np.int64)


LENGTH_KINDS = ("lognormal", "constant", "uniform")


def prompt_log_factors(w: WorkloadConfig, seed: int, iteration: int, group_size: int) -> np.ndarray:
    """Per prompt of :func:`make_batch` ``(w, seed, iteration, group_size)``, the log length factor
    its responses share (zeros without ``output_len.prompt_sigma``): make_batch's draws replayed
    (a lognormal consumes the same random stream whatever its parameters)."""
    num_prompts = w.global_batch_size // group_size
    if w.path is not None or not w.output_len.prompt_sigma:
        return np.zeros(num_prompts)
    rng = np.random.default_rng([seed, iteration])
    sample_lengths(w.prompt_len, num_prompts, rng, iteration=iteration)
    rng.lognormal(0.0, 1.0, size=w.global_batch_size)
    return rng.normal(0.0, w.output_len.prompt_sigma, size=num_prompts)


def regenerated_lengths(w: WorkloadConfig, seed: int, iteration: int, prompt: tuple[int, int], attempt: int,
                        log_factor: float, group_size: int) -> np.ndarray:
    """``group_size`` new response lengths for a prompt drawn before (``prompt``: the iteration it
    was drawn in and its index there) and generated again, attempt ``attempt``, in iteration
    ``iteration``: its own length factor (``log_factor``, :func:`prompt_log_factors`), fresh draws
    within it, the median of ``iteration``, the cap ``max_gen_len`` (a stream of their own)."""
    dist = w.output_len
    rng = np.random.default_rng([seed, prompt[0], prompt[1], attempt, 7919])
    if dist.kind != "lognormal":
        return sample_lengths(dist, group_size, rng, cap=w.max_gen_len, iteration=iteration)
    within = math.sqrt(dist.sigma ** 2 - dist.prompt_sigma ** 2)
    values = math.exp(log_factor) * rng.lognormal(np.log(median_at(dist, iteration)), within, size=group_size)
    return np.clip(np.rint(values), dist.min, min(dist.max, w.max_gen_len)).astype(np.int64)


def validate_length_dist(key: str, dist: LengthDistConfig) -> None:
    """Refuse a length distribution that cannot be drawn from, naming the key. ``uniform`` draws from
    [min, max], so its median must be their midpoint (systems read the median as the typical length)."""
    if dist.kind not in LENGTH_KINDS:
        raise ConfigError(f"workload.{key}.kind={dist.kind!r}; expected one of {', '.join(LENGTH_KINDS)}")
    if not 1 <= dist.min <= dist.max:
        raise ConfigError(f"workload.{key}: min={dist.min} and max={dist.max} must satisfy 1 <= min <= max")
    if not (math.isfinite(dist.median) and dist.median > 0):
        raise ConfigError(f"workload.{key}.median={dist.median}: must be a finite positive number of tokens")
    if not (math.isfinite(dist.growth_per_iteration) and dist.growth_per_iteration > -1):
        raise ConfigError(f"workload.{key}.growth_per_iteration={dist.growth_per_iteration}: the median's change per "
                          f"iteration as a fraction, a finite number > -1")
    if not (math.isfinite(dist.prompt_sigma) and dist.prompt_sigma >= 0):
        raise ConfigError(f"workload.{key}.prompt_sigma={dist.prompt_sigma}: a finite number >= 0")
    if dist.prompt_sigma and dist.kind != "lognormal":
        raise ConfigError(f"workload.{key}.prompt_sigma={dist.prompt_sigma} splits a lognormal's sigma; "
                          f"workload.{key}.kind={dist.kind}")
    if dist.kind == "lognormal" and not (math.isfinite(dist.sigma) and dist.sigma >= 0):
        raise ConfigError(f"workload.{key}.sigma={dist.sigma}: a lognormal's shape must be a finite number >= 0")
    if dist.prompt_sigma > dist.sigma:
        raise ConfigError(f"workload.{key}.prompt_sigma={dist.prompt_sigma} is part of sigma={dist.sigma}: at most it")
    if dist.kind == "uniform" and abs(dist.median - (dist.min + dist.max) / 2) > 0.5:
        raise ConfigError(f"workload.{key}.kind=uniform draws from [min, max] = [{dist.min}, {dist.max}]: set "
                          f"workload.{key}.median={(dist.min + dist.max) / 2:g} (their midpoint), not {dist.median:g}")


def validate_workload(w: WorkloadConfig, group_size: int = 1) -> None:
    """Refuse batch sizes that cannot work before any work starts: every size must be >= 1, and
    micro-batch <= mini-batch <= global batch, each dividing the next; and length distributions
    that cannot be drawn from. With ``group_size`` responses per prompt the global and mini-batch
    sizes count prompts and the micro-batch samples (:func:`harness.core.algorithm.sample_workload`),
    so a mini-batch holds ``mini_batch_size * group_size`` samples."""
    if w.path is None:
        validate_length_dist("prompt_len", w.prompt_len)
        validate_length_dist("output_len", w.output_len)
    for key in ("global_batch_size", "mini_batch_size", "micro_batch_size"):
        if getattr(w, key) < 1:
            raise ConfigError(f"workload.{key}={getattr(w, key)} must be a positive number of samples")
    if w.mini_batch_size > w.global_batch_size:
        raise ConfigError(f"workload.mini_batch_size={w.mini_batch_size} is larger than "
                          f"workload.global_batch_size={w.global_batch_size}")
    mini = f"workload.mini_batch_size={w.mini_batch_size}"
    if group_size > 1:
        mini = f"a mini-batch's {w.mini_batch_size * group_size} samples ({mini} prompts x algo.group_size={group_size})"
    if w.micro_batch_size > w.mini_batch_size * group_size:
        raise ConfigError(f"workload.micro_batch_size={w.micro_batch_size} is larger than {mini}")
    if w.global_batch_size % w.mini_batch_size:
        raise ConfigError(
            f"workload.global_batch_size={w.global_batch_size} is not a multiple of "
            f"workload.mini_batch_size={w.mini_batch_size}")
    if (w.mini_batch_size * group_size) % w.micro_batch_size:
        raise ConfigError(f"{mini[0].upper() + mini[1:] if group_size > 1 else mini} is not a multiple of "
                          f"workload.micro_batch_size={w.micro_batch_size}")
    if w.micro_batch_tokens is not None:
        longest = w.prompt_len.max + w.max_gen_len
        if w.micro_batch_tokens < longest:
            raise ConfigError(f"workload.micro_batch_tokens={w.micro_batch_tokens} is below the longest sample "
                              f"(prompt_len.max + max_gen_len = {longest:g} tokens), which would fit no packed "
                              f"micro-batch")
    if w.activation_recompute not in ("none", "selective", "full"):
        raise ConfigError(f"workload.activation_recompute={w.activation_recompute!r}; use none, selective or full")
    a, b = w.pass_rate.alpha, w.pass_rate.beta
    if not (a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)):
        raise ConfigError(f"workload.pass_rate: alpha={a} and beta={b} must be finite and > 0 (a Beta distribution)")
    if w.max_gen_len < 1 or w.output_len.min > w.max_gen_len:
        raise ConfigError(f"workload.max_gen_len={w.max_gen_len} is below output_len.min={w.output_len.min}")


def make_batch(w: WorkloadConfig, seed: int, iteration: int, group_size: int = 1) -> Batch:
    """Iteration ``iteration``'s samples: ``w.global_batch_size`` of them (``w`` counts samples, as
    :func:`harness.core.algorithm.sample_workload` makes it), in groups of ``group_size`` responses
    to one prompt: each group's samples share a prompt length, and each draws its own output length."""
    if w.path is not None:
        if group_size != 1:
            raise ConfigError(f"a JSON-lines workload gives one response length per prompt, not {group_size}")
        return make_file_batch(w, seed, iteration)
    num_prompts, rest = divmod(w.global_batch_size, group_size)
    if rest:
        raise ConfigError(f"{w.global_batch_size} samples are not whole groups of {group_size}")
    rng = np.random.default_rng([seed, iteration])
    prompts = np.repeat(sample_lengths(w.prompt_len, num_prompts, rng, iteration=iteration), group_size)
    outputs = sample_lengths(w.output_len, w.global_batch_size, rng, cap=w.max_gen_len, iteration=iteration,
                             group_size=group_size)
    return Batch(iteration, prompts, outputs)


def draw_batch(w: WorkloadConfig, seed: int, iteration: int, algorithm) -> Batch:
    """Iteration ``iteration``'s batch under ``algorithm`` (an ``AlgorithmConfig``): :func:`make_batch`
    of the samples ``w`` (counting samples: ``harness.core.algorithm.sample_workload``) trains on;
    under dynamic sampling, the generation rounds that fill it (:func:`make_sampled_batch`)."""
    if not algorithm.dynamic_sampling:
        return make_batch(w, seed, iteration, algorithm.group_size)
    return make_sampled_batch(w, seed, iteration, algorithm.group_size, algorithm.oversample_factor,
                              algorithm.max_gen_rounds)


def mixed_groups(group_num_correct: np.ndarray, group_size: int) -> np.ndarray:
    """Per group, whether its responses neither all pass nor all fail: the groups dynamic sampling keeps."""
    return (group_num_correct > 0) & (group_num_correct < group_size)


def draw_round(w: WorkloadConfig, seed: int, iteration: int, round_index: int, num_prompts: int,
               group_size: int) -> Batch:
    """Generation round ``round_index`` of iteration ``iteration`` under dynamic sampling:
    ``num_prompts`` prompts of ``group_size`` responses, their lengths drawn as :func:`make_batch`
    draws them (from (seed, iteration, 1 + round_index), a stream of its own), and per prompt a pass
    rate from ``w.pass_rate`` and its group's number of passing responses (``group_num_correct``).
    ``backend=ray`` generates the same rounds and judges them by its verifier instead."""
    rng = np.random.default_rng([seed, iteration, 1 + round_index])  # make_batch draws from [seed, iteration]
    prompts = np.repeat(sample_lengths(w.prompt_len, num_prompts, rng, iteration=iteration), group_size)
    outputs = sample_lengths(w.output_len, num_prompts * group_size, rng, cap=w.max_gen_len, iteration=iteration,
                             group_size=group_size)
    num_correct = rng.binomial(group_size, rng.beta(w.pass_rate.alpha, w.pass_rate.beta, size=num_prompts))
    return Batch(iteration, prompts, outputs, group_num_correct=num_correct)


def make_sampled_batch(w: WorkloadConfig, seed: int, iteration: int, group_size: int, oversample_factor: float,
                       max_rounds: int) -> Batch:
    """Iteration ``iteration``'s batch under DAPO's dynamic sampling (arXiv 2503.14476 section 3.2;
    :mod:`harness.core.algorithm`): rounds of ``ceil(oversample_factor x P)`` prompts (``P =
    w.global_batch_size / group_size`` prompts trained), ``group_size`` responses each, until ``P``
    groups with mixed outcomes are kept; the first ``P`` kept groups, in round and prompt order,
    are the batch. Each round draws its lengths as :func:`make_batch` does, and each prompt a pass
    rate from ``w.pass_rate`` (Beta) and its group's number of correct responses (binomial):
    a group is kept unless all or none pass. Lengths and outcomes are drawn independently (the
    synthetic workload has no answers; a model that fails long responses more often is not
    modelled). Raises ConfigError if ``max_rounds`` rounds do not fill the batch."""
    num_prompts, rest = divmod(w.global_batch_size, group_size)
    if rest:
        raise ConfigError(f"{w.global_batch_size} samples are not whole groups of {group_size}")
    if w.path is not None:
        raise ConfigError("dynamic sampling draws pass rates for synthetic prompts; a JSON-lines workload has none")
    a, b = w.pass_rate.alpha, w.pass_rate.beta
    per_round = math.ceil(oversample_factor * num_prompts)
    rounds, kept = [], []  # kept: (round, group) of each kept group
    for r in range(max_rounds):
        rounds.append(draw_round(w, seed, iteration, r, per_round, group_size))
        kept += [(r, g) for g in np.flatnonzero(mixed_groups(rounds[-1].group_num_correct, group_size)).tolist()]
        if len(kept) >= num_prompts:
            break
    else:
        raise ConfigError(f"dynamic sampling kept {len(kept)} of the {num_prompts} prompts it needs after "
                          f"algo.max_gen_rounds={max_rounds} rounds of {per_round} prompts (workload.pass_rate "
                          f"alpha={a}, beta={b} leaves few groups with mixed outcomes); raise algo.max_gen_rounds "
                          f"or algo.oversample_factor")
    offset = per_round * group_size
    trained = np.array([r * offset + g * group_size + i for r, g in kept[:num_prompts] for i in range(group_size)],
                       dtype=np.int64)
    prompts = np.concatenate([rb.prompt_lens for rb in rounds])[trained]
    outputs = np.concatenate([rb.output_lens for rb in rounds])[trained]
    return Batch(iteration, prompts, outputs, rounds=tuple(rounds), trained_ids=trained)


# ---- Workloads read from a JSON-lines file (workload.path; conf/workload/jsonl.yaml) ---------------
#
# Line format: one JSON object per line; blank lines are skipped, other keys (an ``id``, a source)
# ignored. Each object gives its prompt as exactly one of
#   "prompt": "text"         -> tokenised by the rule below
#   "prompt_ids": [1, 2, 3]  -> token ids, used as they are (each must be < the actor's vocab_size)
#   "prompt_len": 128        -> a length only (backend=ray draws random tokens for it, as for
#                               synthetic workloads)
# and its response length as exactly one of
#   "response_len": 256      -> tokens to generate
#   "response": "text"       -> its length under the rule below (the text itself is not used)
#
# Tokenisation rule for text (no tokenizer can be fetched at run time): one token per UTF-8 byte,
# token id = the byte's value (0-255), which lies inside every vocabulary here (>= 256 ids). It is
# not the model's tokenizer: a text's length in tokens is its UTF-8 byte count, roughly 3-4x its LLaMA
# token count for English. For realistic lengths, write prompt_ids / prompt_len and response_len
# from your own tokenizer.
#
# Drawing a batch (a pure function of the file, seed and iteration, like make_batch's synthetic
# draw): the records form a stream of epochs, each epoch a permutation of all records drawn from
# (seed, epoch); iteration i takes stream positions [i * B, (i + 1) * B), B = global_batch_size,
# so every record is used once per epoch, and an iteration may straddle two epochs (or span several
# when B exceeds the file). Response lengths are capped at max_gen_len, as in the synthetic draw.
#
# Errors: a missing file names the path; every bad line raises ConfigError "<path>:<line>: <what>",
# at context build time (resolve_workload), before any work starts. Parsed files are cached per
# (path, mtime, size): iterations index arrays, they do not re-read the file.

PROMPT_KEYS = ("prompt", "prompt_ids", "prompt_len")
RESPONSE_KEYS = ("response_len", "response")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WorkloadFile:
    """A parsed workload file: one entry per record (non-blank line), in file order."""

    path: str  # as opened (relative paths as given when found in the working directory)
    prompt_lens: np.ndarray  # int64 [N]
    response_lens: np.ndarray  # int64 [N], before the max_gen_len cap
    prompt_ids: tuple[np.ndarray | None, ...]  # int64 ids per record; None where only prompt_len was given
    line_numbers: np.ndarray  # int64 [N], 1-based line of each record

    @property
    def num_records(self) -> int:
        return int(self.prompt_lens.shape[0])

    @property
    def has_prompts(self) -> bool:
        return any(ids is not None for ids in self.prompt_ids)


def text_token_ids(text: str) -> np.ndarray:
    """The tokenisation rule for text fields: one token per UTF-8 byte, id = byte value (0-255)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def resolve_workload_path(path: str) -> str:
    """``path`` if it names a file (relative: to the working directory), else the repo root's
    ``path`` (so ``data/workloads/sample.jsonl`` works from any directory of a checkout)."""
    p = Path(path).expanduser()
    if p.is_file():
        return str(p)
    if not p.is_absolute() and (REPO_ROOT / p).is_file():
        return str(REPO_ROOT / p)
    if p.exists():  # a folder, a device, a pipe, a socket
        raise ConfigError(f"workload.path={path!r}: is {file_kind(p)}, not a regular file")
    where = "" if p.is_absolute() else f" (looked in {Path.cwd()} and {REPO_ROOT})"
    raise ConfigError(f"workload.path={path!r}: no such file{where}")


def load_workload_file(path: str) -> WorkloadFile:
    """The parsed, validated file ``path`` (cached; re-parsed only when the file changes)."""
    resolved = resolve_workload_path(path)
    st = os.stat(resolved)
    return _parse_workload_file(resolved, st.st_mtime_ns, st.st_size)


def _positive_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key!r} must be a positive integer, got {json.dumps(value)}")
    return value


def _text(value, key: str) -> np.ndarray:
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{key!r} is empty")
    return text_token_ids(value)


def _token_ids(value, key: str) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{key!r} must be a non-empty list of token ids")
    for j, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{key!r} must hold non-negative integers; item {j} is {json.dumps(v)}")
    return np.asarray(value, dtype=np.int64)


def _one_of(obj: dict, keys: tuple[str, ...], what: str) -> str:
    given = [k for k in keys if k in obj]
    options = ", ".join(repr(k) for k in keys)
    if not given:
        raise ValueError(f"no {what}: give one of {options}")
    if len(given) > 1:
        raise ValueError(f"give one {what} key of {options}, not {' and '.join(repr(k) for k in given)}")
    return given[0]


def _parse_record(obj) -> tuple[int, int, np.ndarray | None]:
    """(prompt length, response length, prompt ids or None) of one decoded line; ValueError if bad."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    key = _one_of(obj, PROMPT_KEYS, "prompt")
    if key == "prompt_len":
        ids, prompt_len = None, _positive_int(obj[key], key)
    else:
        ids = _text(obj[key], key) if key == "prompt" else _token_ids(obj[key], key)
        prompt_len = int(ids.shape[0])
    key = _one_of(obj, RESPONSE_KEYS, "response")
    response_len = _positive_int(obj[key], key) if key == "response_len" else int(_text(obj[key], key).shape[0])
    return prompt_len, response_len, ids


@functools.lru_cache(maxsize=8)
def _parse_workload_file(path: str, _mtime_ns: int, _size: int) -> WorkloadFile:
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark some editors write
        data = data[3:]
    prompts, responses, ids, lines = [], [], [], []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}:{number}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: invalid JSON: {e.msg} (column {e.colno})") from None
        try:
            p, r, i = _parse_record(obj)
        except ValueError as e:
            raise ConfigError(f"{path}:{number}: {e}") from None
        prompts.append(p)
        responses.append(r)
        ids.append(i)
        lines.append(number)
    if not prompts:
        raise ConfigError(f"{path}: no records (every line is blank)")
    arrays = [np.asarray(a, dtype=np.int64) for a in (prompts, responses, lines)] + [a for a in ids if a is not None]
    for a in arrays:
        a.flags.writeable = False  # shared by every batch drawn from the cache
    return WorkloadFile(path, arrays[0], arrays[1], tuple(ids), arrays[2])


def check_prompt_ids(f: WorkloadFile, vocab_size: int) -> None:
    """Every prompt token id of ``f`` lies in [0, vocab_size), or a ConfigError names the line."""
    for ids, line in zip(f.prompt_ids, f.line_numbers.tolist()):
        if ids is not None and int(ids.max()) >= vocab_size:
            raise ConfigError(
                f"{f.path}:{line}: prompt token id {int(ids.max())} is outside the actor's vocabulary "
                f"(vocab_size={vocab_size}; text is tokenised as one id per UTF-8 byte, 0-255)")


def _length_summary(lens: np.ndarray) -> LengthDistConfig:
    return LengthDistConfig(kind="lognormal", median=float(np.median(lens)), sigma=float(np.log(lens).std()),
                            min=int(lens.min()), max=int(lens.max()))


def resolve_workload(w: WorkloadConfig, vocab_size: int | None = None,
                     max_context: int | None = None) -> WorkloadConfig:
    """``w`` ready for planning. For a file workload (``w.path``): the file is read and validated
    (every bad line raises ConfigError "<path>:<line>: ..."; ids checked against ``vocab_size`` when
    given), and ``prompt_len`` / ``output_len``, which planners read (max sequence for memory, medians
    for typical contexts), become the file's empirical summary: min, median and max of its prompt
    lengths and of its response lengths capped at ``max_gen_len``, with the lognormal sigma fitted as
    the standard deviation of log lengths. Batches still come from the records, not from these.
    Synthetic workloads are returned unchanged."""
    if w.path is None:
        return w
    f = load_workload_file(w.path)
    if vocab_size is not None:
        check_prompt_ids(f, vocab_size)
    if max_context is not None:
        check_record_context(f, w.max_gen_len, max_context)
    return dataclasses.replace(w, prompt_len=_length_summary(f.prompt_lens),
                               output_len=_length_summary(np.minimum(f.response_lens, w.max_gen_len)))


def check_record_context(f: WorkloadFile, max_gen_len: int, max_context: int) -> None:
    """Every record's prompt plus its response (capped at ``max_gen_len``) fits ``max_context``
    tokens (the smallest ``max_seq_len`` of the four models); the first record over it is named."""
    total = f.prompt_lens + np.minimum(f.response_lens, max_gen_len)
    over = np.flatnonzero(total > max_context)
    if over.size:
        i = int(over[0])
        raise ConfigError(f"{f.path}:{int(f.line_numbers[i])}: prompt of {int(f.prompt_lens[i])} + response of "
                          f"{int(min(f.response_lens[i], max_gen_len))} tokens exceeds the models' context of "
                          f"{max_context} tokens (model.*.max_seq_len); {over.size} record(s) are over it")


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_records: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(num_records)
    order.flags.writeable = False
    return order


def make_file_batch(w: WorkloadConfig, seed: int, iteration: int) -> Batch:
    """Iteration ``iteration``'s records of the file ``w.path`` (see the section comment above)."""
    f = load_workload_file(w.path)
    n, size = f.num_records, w.global_batch_size
    pos = np.arange(iteration * size, (iteration + 1) * size, dtype=np.int64)
    epochs = pos // n
    idx = np.empty(size, dtype=np.int64)
    for e in np.unique(epochs).tolist():
        sel = epochs == e
        idx[sel] = _epoch_order(seed, e, n)[pos[sel] % n]
    return Batch(iteration, f.prompt_lens[idx], np.minimum(f.response_lens[idx], w.max_gen_len),
                 prompt_ids=tuple(f.prompt_ids[i] for i in idx.tolist()) if f.has_prompts else None,
                 source_lines=f.line_numbers[idx])
