"""Systems under study (RLHFuse and its ablations). Each returns a Plan; see harness.system."""
