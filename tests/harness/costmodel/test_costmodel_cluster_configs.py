"""conf/cluster YAMLs: complete against the ClusterConfig schema, composable with Hydra."""
from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.core.config import ClusterConfig, register_configs
from harness.costmodel import CostModel

from costmodel_testdata import CLUSTER_NAMES, CONF_DIR, load_cluster, workload


@pytest.mark.parametrize("name", CLUSTER_NAMES)
def test_yaml_sets_every_schema_field(name):
    raw = OmegaConf.load(CONF_DIR / "cluster" / f"{name}.yaml")
    assert OmegaConf.to_container(raw.defaults) == [{"/schema@_here_": "cluster"}, "_self_"]
    set_keys = set(raw) - {"defaults"}
    assert set_keys == {f.name for f in dataclasses.fields(ClusterConfig)}
    cfg = load_cluster(name)
    assert OmegaConf.missing_keys(cfg) == set()
    assert cfg.name == name
    for section in ("gpu", "intra_node", "inter_node", "host_to_device"):
        for key, value in cfg[section].items():
            if key.endswith("_frac"):
                assert 0 < value <= 1, (section, key)
            elif key != "name":
                assert value > 0, (section, key)
    assert CostModel(cfg, workload()).num_devices == cfg.num_nodes * cfg.gpus_per_node


def test_testbed_matches_the_paper_and_datasheet():
    cfg = load_cluster("rlhfuse_testbed")
    assert (cfg.num_nodes, cfg.gpus_per_node) == (32, 8)
    assert cfg.gpu.peak_bf16_tflops == 989.0
    assert cfg.intra_node.bandwidth_gbps == 450.0
    assert cfg.inter_node.bandwidth_gbps == 25.0


@pytest.mark.parametrize("name", CLUSTER_NAMES)
def test_hydra_composes_with_schema_and_overrides(name):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(overrides=[f"+cluster={name}", "cluster.num_nodes=4"])
        assert OmegaConf.get_type(cfg.cluster) is ClusterConfig
        assert cfg.cluster.num_nodes == 4
        with pytest.raises(Exception, match="bogus"):
            compose(overrides=[f"+cluster={name}", "cluster.gpu.bogus=1"])
        with pytest.raises(Exception, match="num_nodes"):
            compose(overrides=[f"+cluster={name}", "cluster.num_nodes=many"])
