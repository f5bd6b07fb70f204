"""``python -m harness.replay``: published measurements of real RLHF runs replayed in the simulator (:mod:`harness.cli.replay`)."""
if __name__ == "__main__":
    from harness.errors import run_command

    run_command("harness.cli.replay")
