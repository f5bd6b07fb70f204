"""``python -m harness.replay``: published measurements of real RLHF runs replayed in the simulator (:mod:`harness.cli.replay`).

Ctrl-C while the tool is still being imported ends it as it does later: one line, exit code 130."""
import sys

if __name__ == "__main__":
    try:
        from harness.cli.replay import main
    except KeyboardInterrupt:
        print("interrupted: nothing was run", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
