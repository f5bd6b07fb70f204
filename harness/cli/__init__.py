"""The command-line tools, each a thin layer over :mod:`harness.run` and the packages below it.

- :mod:`.app`: ``python -m harness`` (one run or a Hydra sweep; :mod:`.sweep` is its callback,
  :mod:`.help` its ``--help`` screen);
- :mod:`.replay`: ``python -m harness.replay``, published measurements replayed in the simulator
  (and the fit of the engines' constants on them);
- :mod:`.calibrate`: ``python -m harness.calibrate``, the cost model against measured profiles,
  and our own profiles;
- :mod:`.report`: ``python -m harness.report``, one comparison table of finished runs.

Nothing below this package imports it.
"""
