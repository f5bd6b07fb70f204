"""Error types the entry point turns into one clear paragraph (no traceback) before any result is written.

- :class:`ConfigError`: a config value that cannot work (e.g. a layout larger than the cluster).
- :class:`OverrideError`: a command-line override naming a key or group option that does not exist,
  or a value Hydra cannot parse or convert (:mod:`harness.checks.command_line`).
- :class:`PlanError`: a plan that is structurally impossible (mesh/strategy mismatch, cycles).
- :class:`PlanMemoryError`: a plan that does not fit in device memory; the message carries the numbers.

:func:`interrupt_is_one_line` makes a command's ``main`` end Ctrl-C with one line and exit code 130;
:func:`run_command` is the entry of each ``python -m harness.<tool>``.
"""
import functools
import sys
from typing import Callable


class HarnessError(Exception):
    """Base of errors caused by user input; reported without a traceback."""


class ConfigError(HarnessError):
    pass


class OverrideError(ConfigError):
    pass


class PlanError(HarnessError):
    pass


class PlanMemoryError(PlanError):
    pass


def interrupt_is_one_line(main: Callable[..., int]) -> Callable[..., int]:
    """``main`` (a command line's entry: returns its exit code) ending Ctrl-C with one line
    ``interrupted`` on stderr and exit code 130 instead of a traceback."""
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    return run


def run_command(module: str) -> None:
    """Import the command-line tool ``module`` and exit with what its ``main()`` returns; Ctrl-C
    while it is still being imported ends it as it does later: one line and exit code 130."""
    import importlib

    try:
        main = importlib.import_module(module).main
    except KeyboardInterrupt:
        print("interrupted: nothing was run", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
