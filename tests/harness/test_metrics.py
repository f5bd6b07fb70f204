"""Metric keys follow the grammar; summaries weigh iterations by time."""
import pytest

from harness.core import metrics as mk
from harness.core.trace import PipelineRun, SampleRecord, Span, StepTrace


def _trace():
    tr = StepTrace(iteration=0, num_devices=2)
    tr.spans = [Span((0, 1), "gen", "decode", 0.0, 2.0), Span((0,), "update_actor", "forward", 2.0, 3.0, 10.0),
                Span((1,), "update_actor", "backward", 3.0, 4.0, 20.0)]
    tr.samples = [SampleRecord(i, 4, 10 * (i + 1), 0.2 * (i + 1)) for i in range(10)]
    tr.pipelines = [PipelineRun("update_actor", 2.0, 2.0, 2, 2.0, 0.5)]
    return tr


def test_iteration_metrics_by_hand():
    m = mk.iteration_metrics(_trace(), total_num_tokens=1000, task_models={"update_actor": "actor"},
                             peak_flops_per_device=10.0)
    assert m[mk.STEP_TIME] == 4.0 and m[mk.timing_key("gen")] == 2.0 and m[mk.TRAIN_TIME] == 2.0
    assert m[mk.SAMPLES_PER_S] == 10 / 4 and m[mk.THROUGHPUT] == 1000 / 4 / 2
    assert m[mk.bubble_key("update_actor")] == pytest.approx(0.5)  # 1 - 2 / (2 x 2)
    assert m[mk.BUSY_MEAN] == pytest.approx(0.75) and m[mk.BUSY_MIN] == pytest.approx(0.75)
    assert m[mk.GEN_TAIL_S] == pytest.approx(2.0 - 1.8)  # last finish - 90th percentile finish
    assert m[mk.mfu_key("actor")] == pytest.approx(30.0 / (2.0 * 2 * 10.0))
    assert m[mk.response_length_key("max")] == 100


def test_every_key_follows_the_grammar():
    m = mk.iteration_metrics(_trace(), 1000, {}, 1.0)
    assert all(mk.KEY_GRAMMAR.match(k) for k in m)
    for bad in ("Timing/step", "timing_s/Step", "perf", "foo/bar", "timing_s/a/b/c"):
        assert not mk.KEY_GRAMMAR.match(bad)


def test_summary_drops_warmup_and_weighs_throughput_by_time():
    rows = [{mk.STEP_TIME: 100.0, mk.SAMPLES_PER_S: 1.0, mk.THROUGHPUT: 1.0},
            {mk.STEP_TIME: 1.0, mk.SAMPLES_PER_S: 10.0, mk.THROUGHPUT: 5.0},
            {mk.STEP_TIME: 3.0, mk.SAMPLES_PER_S: 2.0, mk.THROUGHPUT: 1.0}]
    s = mk.summarize(rows, num_warmup=1)
    assert s[mk.STEP_TIME] == 2.0
    assert s[mk.SAMPLES_PER_S] == pytest.approx((10 + 6) / 4)
    assert s[mk.GLOBAL_STEP] == 3


# ---- stages that ran at the same time: overlap_s and the summary's "span" label ---------------------

def _streaming_trace():
    """ref streams beside gen (as with inter-stage fusion); reward and the update follow."""
    tr = StepTrace(iteration=0, num_devices=4)
    tr.spans = [Span((0, 1), "gen", "decode", 0.0, 4.0), Span((2,), "ref", "forward", 1.0, 2.0),
                Span((2,), "ref", "forward", 3.5, 4.5), Span((3,), "reward", "forward", 4.5, 5.0),
                Span((0, 1, 2, 3), "update_actor", "forward", 5.0, 6.0)]
    return tr


def test_overlap_of_stage_windows_is_measured():
    m = mk.iteration_metrics(_streaming_trace(), 100, {}, 1.0)
    assert mk.overlap_key("ref", "gen") == mk.overlap_key("gen", "ref") == "overlap_s/gen/ref"
    assert m["overlap_s/gen/ref"] == pytest.approx(3.0)  # ref's window 1.0-4.5 within gen's 0-4: 1.0-4.0
    assert [k for k in m if k.startswith("overlap_s/")] == ["overlap_s/gen/ref"]  # windows that only touch: none
    assert all(mk.KEY_GRAMMAR.match(k) for k in m)


def test_summary_labels_overlapped_stage_times_as_spans(tmp_path):
    from harness.run.runner import RunOutcome, format_summary

    summary = mk.summarize([mk.iteration_metrics(_streaming_trace(), 100, {}, 1.0)], num_warmup=0)
    text = format_summary(RunOutcome(tmp_path, summary, skipped=False, info={}))
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("  timing_s/")}
    assert rows["timing_s/ref"].split()[1:] == ["3.500", "span,", "overlaps", "gen"]
    assert rows["timing_s/gen"].split()[1:] == ["4.000", "span,", "overlaps", "ref"]
    assert rows["timing_s/reward"].split()[1:] == ["0.500"] and rows["timing_s/update_actor"].split()[1:] == ["1.000"]
    assert "  (span: first start to last end of a stage that ran while the stages named ran too" in text

    sequential = StepTrace(iteration=0, num_devices=2)
    sequential.spans = [Span((0, 1), "gen", "decode", 0.0, 2.0), Span((0,), "ref", "forward", 2.0, 3.0)]
    text = format_summary(RunOutcome(tmp_path, mk.summarize([mk.iteration_metrics(sequential, 10, {}, 1.0)], 0),
                                     skipped=False, info={}))
    assert "span" not in text


def test_brief_summary_is_one_line(tmp_path):
    from harness.run.runner import RunOutcome, format_summary

    summary = mk.summarize([mk.iteration_metrics(_streaming_trace(), 100, {}, 1.0)], num_warmup=0)
    assert format_summary(RunOutcome(tmp_path, summary, skipped=False, info={"notes/x": 1}), brief=True) == \
        f"run: {tmp_path}  {summary[mk.SAMPLES_PER_S]:.3f} samples/s, step 6 s"
