"""Long-tail migration and streaming (RLHFuse section 4) against hand-computed timelines.

Profile: prefill 10 ms and decode step 1 ms whatever the batch. Two instances (one GPU each, one
node): instance 0 holds s0 (2 tokens) and s2 (10), instance 1 holds s1 (3) and s3 (8); prompts 4.
Without migration: prefill to 10 ms, then s0 at 12, s1 at 13, s3 at 18, s2 at 20.
R_t = 75% of 4 = 3: after s1 finishes at 13 only 2 < 3 are unfinished, so migration happens at 13.
Both instances then hold one unfinished sample (s2 has 7 tokens left, s3 has 5); the tie goes to
instance 0, which receives s3.
- KV transfer: s3's 7-token KV (256 B/token for the tiny model) over NVLink: ~1 us. Instance 0
  then decodes s2 and s3 together: s3 at 13.001 + 5 = 18.001 ms, s2 at 20.001 ms.
- Token transfer: instance 0 re-prefills s3 (10 ms): s3 at 28.00x ms, s2 at 30.00x ms.
"""
import numpy as np
import pytest

from harness.planning.taskmodels.generation import simulate_generation
from harness.core.plan import Allocation, GenerationPolicy, MigrationPolicy, ParallelStrategy, Task


def _run(setup, migration):
    cm, model = setup
    task = Task("gen", "generate", "actor", Allocation((0, 1), ParallelStrategy(dp=2)))
    policy = GenerationPolicy("continuous", migration=migration)
    return simulate_generation(cm, task, policy, model, np.array([4, 4, 4, 4]), np.array([2, 3, 10, 8]),
                               0.0, kv_capacity_gb=1.0, max_gen_len=16)


def test_without_migration(setup):
    res = _run(setup, None)
    assert [r.finish_s for r in res.samples] == pytest.approx([0.012, 0.013, 0.020, 0.018])
    assert res.migrated_samples == 0 and res.migration_s is None


def test_kv_migration_timeline(setup):
    res = _run(setup, MigrationPolicy(0.75, 1, "kv"))
    assert res.migration_s == pytest.approx(0.013)
    assert (res.migrated_samples, res.tail_instances) == (1, 1)
    finish = [r.finish_s for r in res.samples]
    assert finish[:2] == pytest.approx([0.012, 0.013])
    assert finish[3] == pytest.approx(0.018, abs=1e-5) and finish[2] == pytest.approx(0.020, abs=1e-5)
    assert finish[3] > 0.018 and finish[2] > 0.020  # the transfer cost is not free
    assert res.device_free_s()[1] == pytest.approx(0.013, abs=1e-5)  # instance 1 released at migration


def test_token_migration_reprefills(setup):
    res = _run(setup, MigrationPolicy(0.75, 1, "tokens"))
    finish = [r.finish_s for r in res.samples]
    assert finish[3] == pytest.approx(0.028, abs=1e-5) and finish[2] == pytest.approx(0.030, abs=1e-5)


def test_every_sample_finishes_once_with_its_length(setup):
    for frac in (0.25, 0.5, 0.75, 1.0):
        res = _run(setup, MigrationPolicy(frac, 1, "kv"))
        assert [r.sample_id for r in res.samples] == [0, 1, 2, 3]
        assert [r.response_len for r in res.samples] == [2, 3, 10, 8]


def test_threshold_sweep_equals_one_run_per_threshold(setup):
    """``simulate_generation_each`` (one unmigrated run shared by every threshold) gives each
    policy exactly what its own ``simulate_generation`` gives, migrating or not."""
    from harness.planning.taskmodels.generation import simulate_generation_each

    cm, model = setup
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(2, 9, size=24), rng.integers(1, 40, size=24)
    task = Task("gen", "generate", "actor", Allocation((0, 1, 2, 3), ParallelStrategy(dp=4)))
    policies = [GenerationPolicy("continuous", max_batch_size=4, migration=None)] + [
        GenerationPolicy("continuous", max_batch_size=4, migration=MigrationPolicy(frac, m, transfer))
        for frac in (0.1, 0.25, 0.5, 0.9) for m, transfer in ((1, "kv"), (2, "tokens"))]
    swept = simulate_generation_each(cm, task, policies, model, prompts, outputs, 0.0, 1.0, 48)
    assert sum(r.migration_s is not None for r in swept) >= 6
    for policy, got in zip(policies, swept):
        alone = simulate_generation(cm, task, policy, model, prompts, outputs, 0.0, kv_capacity_gb=1.0, max_gen_len=48)
        assert [(r.sample_id, r.finish_s) for r in got.samples] == [(r.sample_id, r.finish_s) for r in alone.samples]
        assert (got.migrated_samples, got.tail_instances, got.migration_s) == \
            (alone.migrated_samples, alone.tail_instances, alone.migration_s)
        assert got.device_free_s() == alone.device_free_s()
    with pytest.raises(ValueError, match="more than their migration"):
        simulate_generation_each(cm, task, [policies[0], GenerationPolicy("continuous", max_batch_size=8)], model,
                                 prompts, outputs, 0.0, 1.0, 48)
