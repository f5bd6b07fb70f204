"""Counting a sweep's jobs (harness/sweep.py): the command line replaces the experiment's sweep of the
same key, as Hydra's basic sweeper does."""
from harness.sweep import count_sweep_jobs


def test_jobs_are_the_product_of_the_sweeps():
    assert count_sweep_jobs([], {"model": "a,b,c", "+system": "x,y"}) == 6
    assert count_sweep_jobs(["seed=0,1"], {"model": "a,b,c"}) == 6


def test_a_command_line_override_replaces_the_configured_sweep():
    assert count_sweep_jobs(["model=tiny"], {"model": "a,b,c", "+system": "x,y"}) == 2
    assert count_sweep_jobs(["model=a,b"], {"model": "a,b,c"}) == 2


def test_no_sweep_is_one_job():
    assert count_sweep_jobs(["model=tiny"], None) == 1
