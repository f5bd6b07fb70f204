"""Reimplemented baseline systems (DeepSpeed-Chat, later ReaLHF-style reallocation and
disaggregated/interleaved placement). Each returns a Plan; see harness.system."""
