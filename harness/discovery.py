"""System discovery: import every system module so that each registers its typed config schema.

Two sources, both without the harness naming any system:

- the in-tree packages ``systems`` and ``baselines``: every module in them is imported, so adding
  a system to the repository is one module plus one ``conf/system/<name>.yaml``
  (docs/ARCHITECTURE.md, "Adding a system");
- the ``rlhf_harness.systems`` entry-point group, for systems in other installed packages.

A module that fails to import is reported on stderr and skipped; the others still load.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "rlhf_harness.systems"
IN_TREE_PACKAGES = ("systems", "baselines")


def _in_tree_modules() -> list[str]:
    names = []
    for package_name in IN_TREE_PACKAGES:
        try:
            package = importlib.import_module(package_name)
        except ImportError:
            continue
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}."):
            if not info.name.rsplit(".", 1)[-1].startswith("_"):
                names.append(info.name)
    return sorted(names)


def discover_systems() -> list[str]:
    """Import every system module; returns the names of the registered systems' schemas."""
    from hydra.core.config_store import ConfigStore

    for module in _in_tree_modules():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a broken module must not take the others down
            print(f"[harness] warning: module {module} failed to import: {e}", file=sys.stderr)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001
            print(f"[harness] warning: system {ep.name!r} ({ep.value}) failed to import: {e}", file=sys.stderr)
    schemas = ConfigStore.instance().repo.get("schema", {})
    from harness.config import CORE_SCHEMAS

    return sorted(name.removesuffix(".yaml") for name in schemas if name.removesuffix(".yaml") not in CORE_SCHEMAS)
