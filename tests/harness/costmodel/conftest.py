"""Fixtures of the cost-model tests."""
from __future__ import annotations

import pytest

from harness.costmodel import CostModel

from costmodel_testdata import load_cluster, workload


@pytest.fixture
def testbed():
    return load_cluster("rlhfuse_testbed")


@pytest.fixture
def cost_model(testbed):
    """The analytic (roofline, alpha-beta) cost model whose closed forms these tests check; the
    calibrated default is tested in test_calibrated.py."""
    testbed.cost_model = "roofline"
    return CostModel(testbed, workload())
