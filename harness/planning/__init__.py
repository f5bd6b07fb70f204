"""The planning library: everything a system needs to decide a plan, and nothing that executes one.

Layers (docs/ARCHITECTURE.md): ``systems/`` and ``baselines/`` sit side by side on top of this
package; it sits on the harness core (config, plan IR, cost model, schedule IR, workload, trace);
backends use it, it never imports a backend (a test enforces that).

| module | owns |
|---|---|
| :mod:`.workflow` | the PPO tasks and their data keys, weight-movement tasks, single-pipe stages, layout checks |
| :mod:`.dataflow` | what each training loss consumes, as workflow data keys: the training tasks' reads; a task's view of only its declared inputs |
| :mod:`.assembler` | the one PPO plan assembler: layouts in, the whole iteration plan out (reshard rule, residency, streams) |
| :mod:`.strategies` | (dp, tp, pp) enumeration, ReaLHF's mesh options, pinned layouts, best-of search |
| :mod:`.layout_search` | RLHFuse-Base's per-task brute-force search (all devices or a pool) |
| :mod:`.memory` | per-task, per-device memory feasibility of a plan |
| :mod:`.packing` | sequence packing: micro-batches as first-fit-decreasing bins of samples up to a token budget |
| :mod:`.realloc` | bytes each device receives when weights change layout (also used by the real backend) |
| :mod:`.taskmodels` | per-task cost models: generation (with migration), streaming inference, inference, training, weight movement |
| :mod:`.scheduler` | the one scheduler: readiness, device claims and releases, streams riding with their generator; driven by predicted times here, by completions on backend=ray |
| :mod:`.simulate` | whole-plan simulation through the shared interpreter (what ``backend=sim`` runs) |
| :mod:`.estimate` | task-time and whole-plan estimates for scoring candidates |
"""
