"""The README's Ray cluster started from the command line, checked as tests/test_readme.py checks
every README command: ``ray start``, a run that joins it (``backend.address=auto``), ``ray stop``,
in README order, each with exit code 0 and no traceback.

``ray stop`` stops every Ray on the machine, and a plain ``ray.init()`` would join the cluster, so
this module holds the machine lock exclusively (tests/conftest.py): no other test module runs beside
it. The cluster is stopped whatever happens.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import CLUSTER_COMMANDS, run_readme_command

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_the_readme_cluster_commands_run(tmp_path):
    assert CLUSTER_COMMANDS[0].startswith("ray start ") and CLUSTER_COMMANDS[-1] == "ray stop", CLUSTER_COMMANDS
    stopped = False
    try:
        for command in CLUSTER_COMMANDS:
            run_readme_command(command, tmp_path)
        stopped = True
    finally:
        if not stopped:
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True,
                           timeout=120)
