"""Error types the entry point turns into one clear paragraph (no traceback) before any result is written.

- :class:`ConfigError`: a config value that cannot work (e.g. a layout larger than the cluster).
- :class:`OverrideError`: a command-line override naming a key or group option that does not exist,
  or a value Hydra cannot parse or convert (:mod:`harness.validation`).
- :class:`PlanError`: a plan that is structurally impossible (mesh/strategy mismatch, cycles).
- :class:`PlanMemoryError`: a plan that does not fit in device memory; the message carries the numbers.
"""


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
