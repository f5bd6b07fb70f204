"""workload=jsonl: batches read from a JSON-lines file (harness/core/workload.py, conf/workload/jsonl.yaml).

- the shipped sample file loads, with every accepted form of a record;
- batches are a pure function of (file, seed, iteration), cover the file once per epoch and carry
  the file's lengths (responses capped at max_gen_len); a sim run writes them to samples.csv;
- every kind of bad line fails with "<path>:<line>: <what>", a missing file names its path;
- backend=ray generates from the file's prompts (unit test of prompt_tokens; one tiny Ray run).
"""
from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from harness.run.pipeline import compose
from harness.core.config import LengthDistConfig, WorkloadConfig
from harness.errors import ConfigError
from harness.core.workload import (REPO_ROOT, load_workload_file, make_batch, resolve_workload, text_token_ids)
from tests.helpers import run_in_process

SAMPLE = REPO_ROOT / "data" / "workloads" / "sample.jsonl"
SIM = ["workload=jsonl", "model=tiny", "cluster=h100_8x", "cluster.num_nodes=1", "logger=none",
       "logger.progress_bar=false", "+system=rlhfuse_base", "workload.global_batch_size=16",
       "workload.mini_batch_size=8", "workload.max_gen_len=128", "backend.num_iterations=2"]


def file_workload(path, global_batch_size: int = 64, max_gen_len: int = 1024) -> WorkloadConfig:
    dist = LengthDistConfig(median=8, max=16)
    return WorkloadConfig(name="jsonl", path=str(path), global_batch_size=global_batch_size, mini_batch_size=8,
                          micro_batch_size=1, max_gen_len=max_gen_len, prompt_len=dist, output_len=dist)


def workload_of(name: str) -> WorkloadConfig:
    return OmegaConf.to_object(compose([f"workload={name}"]).workload)


def write(tmp_path: Path, text: str, name: str = "w.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_the_sample_file_loads_with_every_record_form():
    f = load_workload_file(str(SAMPLE))
    assert f.num_records == 256 and f.line_numbers.tolist() == list(range(1, 257))
    recs = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    assert f.prompt_ids[0].tolist() == recs[0]["prompt_ids"]  # token ids, as given
    assert f.prompt_ids[1] is None and f.prompt_lens[1] == recs[1]["prompt_len"]  # a length only
    assert f.response_lens[2] == len(recs[2]["response"].encode())  # response text: its byte count
    assert f.prompt_lens[3] == len(recs[3]["prompt"].encode()) > len(recs[3]["prompt"])  # multi-byte chars
    assert f.prompt_ids[4].tolist() == list(recs[4]["prompt"].encode())  # one id per UTF-8 byte
    assert f.response_lens[4] == recs[4]["response_len"]
    assert load_workload_file(str(SAMPLE)) is f  # parsed once, then cached


def test_jsonl_yaml_composes_to_the_sample_file():
    w = workload_of("jsonl")
    assert w.path == "data/workloads/sample.jsonl" and Path(load_workload_file(w.path).path).resolve() == SAMPLE
    assert workload_of("tiny").path is None


def test_batches_are_deterministic_and_take_each_record_once_per_epoch():
    w = file_workload(SAMPLE, global_batch_size=64, max_gen_len=128)
    f = load_workload_file(str(SAMPLE))
    batches = [make_batch(w, 3, it) for it in range(5)]
    again = make_batch(w, 3, 2)
    assert np.array_equal(batches[2].source_lines, again.source_lines)
    assert np.array_equal(batches[2].output_lens, again.output_lens)
    epoch0 = np.concatenate([b.source_lines for b in batches[:4]])  # 4 x 64 = the 256 records
    assert sorted(epoch0.tolist()) == list(range(1, 257))
    assert not np.array_equal(make_batch(w, 4, 0).source_lines, batches[0].source_lines)  # seed matters
    assert not np.array_equal(batches[4].source_lines, batches[0].source_lines)  # a new epoch, a new order
    for b in batches:  # the file's lengths, responses capped at max_gen_len
        rec = b.source_lines - 1
        assert np.array_equal(b.prompt_lens, f.prompt_lens[rec])
        assert np.array_equal(b.output_lens, np.minimum(f.response_lens[rec], 128))
        assert [None if p is None else len(p) for p in b.prompt_ids][:3] == \
            [None if f.prompt_ids[r] is None else int(f.prompt_lens[r]) for r in rec[:3]]
    assert batches[0].output_lens.max() == 128


def test_a_batch_larger_than_the_file_spans_several_epochs(tmp_path):
    path = write(tmp_path, "".join(json.dumps({"prompt_len": i + 1, "response_len": 10 * (i + 1)}) + "\n"
                                   for i in range(3)))
    b = make_batch(file_workload(path, global_batch_size=8), 0, 0)
    assert np.bincount(b.source_lines, minlength=4)[1:].tolist() in ([3, 3, 2], [3, 2, 3], [2, 3, 3])
    assert np.array_equal(b.output_lens, 10 * b.prompt_lens) and b.prompt_ids is None


def test_resolve_workload_gives_planners_the_files_lengths():
    w = file_workload(SAMPLE, max_gen_len=256)
    f = load_workload_file(str(SAMPLE))
    r = resolve_workload(w, vocab_size=256)
    assert (r.prompt_len.min, r.prompt_len.median, r.prompt_len.max) == \
        (f.prompt_lens.min(), np.median(f.prompt_lens), f.prompt_lens.max())
    assert r.output_len.max == 256 and r.output_len.median == np.median(np.minimum(f.response_lens, 256))
    synthetic = workload_of("tiny")
    assert resolve_workload(synthetic, vocab_size=256) is synthetic


def test_sim_run_on_the_sample_file_generates_the_files_lengths(tmp_path):
    from harness.run.pipeline import execute

    out = execute(compose([*SIM, f"results_dir={tmp_path}"]), SIM)
    run = OmegaConf.to_object(compose(SIM))
    batch = make_batch(run.workload, run.seed, 1)  # samples.csv holds the last iteration
    with open(out.path / "samples.csv") as fh:
        rows = sorted(csv.DictReader(fh), key=lambda r: int(r["sample_id"]))
    assert [int(r["prompt_len"]) for r in rows] == batch.prompt_lens.tolist()
    assert [int(r["response_len"]) for r in rows] == batch.output_lens.tolist()
    f = load_workload_file(run.workload.path)
    assert set(batch.prompt_lens.tolist()) <= set(f.prompt_lens.tolist())
    assert len(set(batch.output_lens.tolist())) > 4  # the file's spread, not a constant


BAD = {
    "invalid_json": ('{"prompt_len": 4, "response_len": 2}\n{"prompt_len": 4,\n', 2, "invalid JSON"),
    "not_an_object": ('[4, 2]\n', 1, "expected a JSON object, got list"),
    "no_prompt": ('{"response_len": 2}\n', 1, "no prompt: give one of 'prompt', 'prompt_ids', 'prompt_len'"),
    "two_prompts": ('{"prompt": "hi", "prompt_len": 2, "response_len": 2}\n', 1, "not 'prompt' and 'prompt_len'"),
    "no_response": ('{"prompt": "hi"}\n', 1, "no response: give one of 'response_len', 'response'"),
    "zero_prompt_len": ('{"prompt_len": 0, "response_len": 2}\n', 1, "'prompt_len' must be a positive integer, got 0"),
    "negative_response_len": ('{"prompt_len": 3, "response_len": -3}\n', 1, "'response_len' must be a positive"),
    "string_length": ('{"prompt_len": 3, "response_len": "12"}\n', 1, "'response_len' must be a positive integer, "
                                                                      'got "12"'),
    "float_length": ('{"prompt_len": 1.5, "response_len": 2}\n', 1, "'prompt_len' must be a positive integer, got 1.5"),
    "bool_length": ('{"prompt_len": true, "response_len": 2}\n', 1, "'prompt_len' must be a positive integer"),
    "empty_prompt": ('{"prompt": "", "response_len": 2}\n', 1, "'prompt' is empty"),
    "empty_response": ('{"prompt": "a", "response": ""}\n', 1, "'response' is empty"),
    "prompt_not_text": ('{"prompt": 7, "response_len": 2}\n', 1, "'prompt' must be a string, got int"),
    "negative_id": ('{"prompt_ids": [1, -1], "response_len": 2}\n', 1, "'prompt_ids' must hold non-negative "
                                                                       "integers; item 1 is -1"),
    "empty_ids": ('{"prompt_ids": [], "response_len": 2}\n', 1, "'prompt_ids' must be a non-empty list"),
    # blank lines count: the bad record is on line 4
    "after_blank_lines": ('{"prompt_len": 4, "response_len": 2}\n\n   \n{"prompt_len": 4}\n', 4, "no response"),
    "not_utf8": (b'{"prompt_len": 4, "response_len": 2}\n{"prompt": "\xff", "response_len": 2}\n', 2,
                 "not valid UTF-8"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_line_is_named_with_its_path_and_number(tmp_path, case):
    text, line, what = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_workload_file(str(path))
    assert str(e.value).startswith(f"{path}:{line}: ") and what in str(e.value)


def test_ids_outside_the_vocabulary_are_refused_at_resolve_time(tmp_path):
    path = write(tmp_path, '{"prompt": "ok", "response_len": 2}\n{"prompt_ids": [3, 300], "response_len": 2}\n')
    resolve_workload(file_workload(path), vocab_size=512)
    message = rf"^{re.escape(str(path))}:2: prompt token id 300 is outside .*vocab_size=256"
    with pytest.raises(ConfigError, match=message):
        resolve_workload(file_workload(path), vocab_size=256)


def test_missing_empty_and_directory_paths_are_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=rf"^workload.path='{re.escape(str(missing))}': no such file$"):
        load_workload_file(str(missing))
    with pytest.raises(ConfigError, match=r"workload.path='nope/w.jsonl': no such file \(looked in"):
        load_workload_file("nope/w.jsonl")
    with pytest.raises(ConfigError, match="is a directory"):
        load_workload_file(str(tmp_path))
    empty = write(tmp_path, "\n  \n", "empty.jsonl")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(empty))}: no records"):
        load_workload_file(str(empty))


def test_a_bad_file_fails_the_run_before_any_result_is_written(tmp_path):
    from harness.run.pipeline import execute

    path = write(tmp_path, '{"prompt_len": 4, "response_len": 2}\n{"prompt_len": 4, "respone_len": 2}\n')
    overrides = [*SIM, f"workload.path={path}"]
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2: no response"):
        execute(compose([*overrides, f"results_dir={tmp_path / 'results'}"]), overrides)
    assert not (tmp_path / "results").exists()


def test_an_edited_file_is_read_again(tmp_path):
    path = write(tmp_path, '{"prompt_len": 4, "response_len": 2}\n')
    assert load_workload_file(str(path)).prompt_lens.tolist() == [4]
    path.write_text('{"prompt_len": 5, "response_len": 2}\n{"prompt_len": 6, "response_len": 2}\n')
    os.utime(path, ns=(1, 1))  # a new mtime even on coarse-grained file systems
    assert load_workload_file(str(path)).prompt_lens.tolist() == [5, 6]


# ---- backend=ray: prompts from the file ---------------------------------------------------------

RAY_FILE = "".join(json.dumps(r) + "\n" for r in [
    {"prompt": "Hello there", "response_len": 3},
    {"prompt_ids": [5, 6, 7, 250], "response_len": 5},
    {"prompt_len": 6, "response": "four"},
    {"prompt": "¿Qué tal?", "response_len": 7},
])


def test_prompt_tokens_come_from_the_file(tmp_path):
    pytest.importorskip("torch")
    from harness.backends.ray.driver.experience import prompt_tokens

    path = write(tmp_path, RAY_FILE)
    batch = make_batch(file_workload(path, global_batch_size=8), 0, 0)
    prompts = prompt_tokens(0, 0, batch, vocab_size=256)
    expected = {1: list(b"Hello there"), 2: [5, 6, 7, 250], 4: list("¿Qué tal?".encode())}
    for i, line in enumerate(batch.source_lines.tolist()):
        if line in expected:
            assert prompts[i] == expected[line]
        else:  # prompt_len only: random tokens of that length, as for synthetic workloads
            assert len(prompts[i]) == 6 and all(0 <= t < 256 for t in prompts[i])
    assert prompt_tokens(0, 0, batch, vocab_size=256) == prompts
    with pytest.raises(ConfigError, match=r"workload file line 2\) has token id 250, outside .*vocab_size=200"):
        prompt_tokens(0, 0, batch, vocab_size=200)


def test_synthetic_prompts_are_unchanged():
    """prompt_ids=None keeps the seeded random prompts bit for bit (golden digests depend on them)."""
    torch = pytest.importorskip("torch")
    from harness.backends.ray.driver.experience import prompt_tokens, stable_seed

    w = workload_of("tiny")
    batch = make_batch(w, 0, 1)
    assert batch.prompt_ids is None and batch.source_lines is None
    gen = torch.Generator().manual_seed(stable_seed("prompt", 0, 1, 0))
    first = torch.randint(0, 256, (int(batch.prompt_lens[0]),), generator=gen).tolist()
    assert prompt_tokens(0, 1, batch, 256)[0] == first


def test_text_rule_is_one_token_per_utf8_byte():
    assert text_token_ids("aé").tolist() == [97, 0xC3, 0xA9]


@pytest.mark.ray
def test_ray_run_generates_from_the_files_prompts_to_its_lengths(tmp_path):
    """One PPO iteration of tiny models on one CPU worker: every sample's prompt is the file's (its
    token count) and its response has the file's length (the rollout's action mask, dumped)."""
    pytest.importorskip("ray")
    path = write(tmp_path, RAY_FILE)
    proc = run_in_process(["model=tiny", "workload=jsonl", f"workload.path={path}", "backend=ray", "cluster=h100_8x",
                           "cluster.num_nodes=1", "cluster.gpus_per_node=1", "+system=deepspeed_chat",
                           "system.mini_batch_size=4", "system.generation_batch_size=8",
                           "workload.global_batch_size=8", "workload.mini_batch_size=4", "workload.micro_batch_size=2",
                           "workload.max_gen_len=16", "backend.num_iterations=1", "backend.num_warmup_iterations=0",
                           "logger=none", "logger.progress_bar=false", "backend.options.dump_weights_dir=w"],
                          tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    batch = make_batch(file_workload(path, global_batch_size=8, max_gen_len=16), 0, 0)
    mask = np.load(tmp_path / "run" / "w" / "experience.npz")["action_mask"]
    assert (mask.argmax(axis=1) + 1).tolist() == batch.prompt_lens.tolist()  # responses start after the prompt
    assert mask.sum(axis=1).astype(int).tolist() == batch.output_lens.tolist()
    assert sorted(set(batch.output_lens.tolist())) == [3, 4, 5, 7]
