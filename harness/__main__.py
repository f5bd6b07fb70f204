"""``python -m harness``: see :mod:`harness.cli.app`. Ctrl-C while the harness is still being imported
ends it as it does later: one line, exit code 130."""
import sys

try:
    from harness.cli.app import run
except KeyboardInterrupt:
    print("interrupted: nothing was run", file=sys.stderr)
    sys.exit(130)

run()
