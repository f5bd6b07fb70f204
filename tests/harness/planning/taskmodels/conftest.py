"""Shared fixture: a tiny model whose op times come from a profile table with round numbers
(prefill 10 ms, decode step 1 ms, whatever the batch), so timelines can be worked out by hand."""
import pytest

from harness.costmodel import CostModel, ProfileTable
from harness.testing import run_config

PROFILE = """op,model,tp,num_tokens,time_s
prefill,tiny,1,1,0.010
prefill,tiny,1,100000,0.010
decode_step,tiny,1,1,0.001
decode_step,tiny,1,100000,0.001
"""


@pytest.fixture
def setup(tmp_path):
    path = tmp_path / "profile.csv"
    path.write_text(PROFILE)
    run = run_config(["+system=rlhfuse_base", "model=tiny", "workload=tiny", "cluster=h100_8x"])
    return CostModel(run.cluster, run.workload, ProfileTable.from_csv(str(path))), run.model.actor
