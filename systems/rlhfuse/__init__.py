"""RLHFuse (NSDI'25, arXiv 2409.13221): stage fusion for RLHF training.

``base`` is RLHFuse-Base (no fusion). Inter-stage fusion (section 4) and intra-stage fusion
(section 5) build on it.
"""
