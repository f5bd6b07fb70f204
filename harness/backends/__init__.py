"""Backends that execute plans: ``sim`` (discrete-event simulator over the planning library's task
models) and ``ray`` (real PPO on Ray workers). Each owns its typed config schema."""
from __future__ import annotations


def register_backend_configs() -> None:
    """Register each backend's schema as ``schema/backend_<name>``; ``conf/backend/<name>.yaml``
    extends it with ``defaults: [{/schema@_here_: backend_<name>}, _self_]``."""
    from hydra.core.config_store import ConfigStore

    from harness.backends.ray.config import RayBackendConfig
    from harness.backends.sim.config import SimBackendConfig

    cs = ConfigStore.instance()
    for name, node in (("backend_sim", SimBackendConfig), ("backend_ray", RayBackendConfig)):
        cs.store(group="schema", name=name, node=node)
