"""Per-task cost models over the cost model (docs/DESIGN.md section 4), each turning one task (or one unit
of tasks) and a batch into spans and an end time: :mod:`.generation` (continuous/static batching,
long-tail migration, RLHFuse section 4), :mod:`.streaming` (inference consuming a generation
stream), :mod:`.passes` (inference passes, training stages, weight movements); :mod:`.migration`
holds long-tail migration's decisions, which backend=ray's streamed generation takes too."""
