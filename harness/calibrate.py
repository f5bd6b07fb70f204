"""``python -m harness.calibrate``: the cost model against measured profiles, and our own profiles (:mod:`harness.cli.calibrate`)."""
if __name__ == "__main__":
    from harness.errors import run_command

    run_command("harness.cli.calibrate")
