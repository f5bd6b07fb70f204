"""Results tree: variants, atomic run folders, the loader."""
import json

import pytest

from harness.run import results


def test_variant_keeps_only_overrides_that_change_the_run():
    label = results.variant_label(["+system=rlhfuse", "model=13b", "seed=2", "logger=none", "logger.mode=offline",
                                   "results_dir=/x", "experiment_name=e", "backend.num_iterations=3",
                                   "llama@model.critic=33b", "workload.max_gen_len=2048", "system.migration_frac=0.1"])
    assert label == "system.migration_frac=0.1,workload.max_gen_len=2048"
    assert results.variant_label(["+system=rlhfuse", "model=13b"]) == ""


def test_run_folder_is_all_or_nothing(tmp_path):
    final = results.run_path(tmp_path, "exp", "sys", "13b", 0, "a=1")
    with pytest.raises(RuntimeError):
        with results.RunFolder(final) as folder:
            folder.path("plan.json").write_text("{}")
            raise RuntimeError("crash mid-run")
    assert not final.exists() and not list(tmp_path.rglob("*.partial*"))
    with results.RunFolder(final) as folder:
        results.write_json(folder.path(results.SUMMARY_FILE), {"metrics": {"perf/samples_per_s": 2.0}, "info": {}})
        folder.commit()
    assert results.is_finished(final)


def test_loader_splits_system_and_variant(tmp_path):
    for frac in (0.1, 0.2):
        path = results.run_path(tmp_path, "exp", "rlhfuse", "13b", 0, f"system.migration_frac={frac}")
        path.mkdir(parents=True)
        (path / results.SUMMARY_FILE).write_text(json.dumps({"metrics": {"perf/samples_per_s": 10 * frac},
                                                              "info": {"system": "rlhfuse"}}))
    df = results.load_results(tmp_path, "exp").sort_values("system.migration_frac")
    assert list(df["system"]) == ["rlhfuse", "rlhfuse"]
    assert list(df["system.migration_frac"]) == [0.1, 0.2]
    assert list(df["perf/samples_per_s"]) == pytest.approx([1.0, 2.0])
    assert list(df["info/system"]) == ["rlhfuse", "rlhfuse"]


def test_long_variants_get_a_short_unique_folder(tmp_path):
    long_a = ",".join(f"system.layouts.task{i}=dp2tp2pp1" for i in range(12))
    long_b = long_a.replace("task11", "task12")
    a = results.run_path(tmp_path, "e", "rlhfuse_base", "tiny", 0, long_a)
    b = results.run_path(tmp_path, "e", "rlhfuse_base", "tiny", 0, long_b)
    assert a != b and len(a.parents[1].name) <= results.MAX_FOLDER_CHARS
    a.mkdir(parents=True)
    (a / results.SUMMARY_FILE).write_text(json.dumps({"metrics": {}, "run": {"variant": long_a}}))
    df = results.load_results(tmp_path, "e")
    assert df.loc[0, "variant"] == long_a and df.loc[0, "system"] == "rlhfuse_base"
