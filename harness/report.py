"""``python -m harness.report``: one comparison table of finished runs (:mod:`harness.cli.report`)."""
if __name__ == "__main__":
    from harness.errors import run_command

    run_command("harness.cli.report")
