"""``python -m harness``: see :mod:`harness.app`."""
from harness.app import run

run()
