"""``python -m harness.report``: one comparison table of finished runs (:mod:`harness.cli.report`).

Ctrl-C while the tool is still being imported ends it as it does later: one line, exit code 130."""
import sys

if __name__ == "__main__":
    try:
        from harness.cli.report import main
    except KeyboardInterrupt:
        print("interrupted: nothing was run", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
