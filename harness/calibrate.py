"""``python -m harness.calibrate``: the cost model against measured profiles, and our own profiles (:mod:`harness.cli.calibrate`).

Ctrl-C while the tool is still being imported ends it as it does later: one line, exit code 130."""
import sys

if __name__ == "__main__":
    try:
        from harness.cli.calibrate import main
    except KeyboardInterrupt:
        print("interrupted: nothing was run", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
