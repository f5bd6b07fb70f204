"""PipeChannel under NCCL's matching rule, emulated on gloo processes (no Ray).

In ``in_order`` mode the channel posts every message with tag 0, so gloo, like NCCL, hands the
k-th receive between two ranks the k-th send. Each rank replays a searched fused schedule's lowered
action list exactly as ``pipeline.train`` executes it (receives collected and posted together,
with the queued sends, before the next computation; a send queued after its computation), each
message carrying its own identity as payload, and records every receive that got another
message's payload. Oracles:

- the schedule ordered by ``order_receives``: no receive gets a wrong payload (4 and 8 stages);
- the naive lowering (receives in the receiver's compute order): wrong payloads in in-order mode
  (what NCCL would do before this fix), none in tag mode (gloo's tags hid it from CPU tests).

Every replay runs in one gloo world of :data:`WORLD` processes, started once for the module
(starting a process, which imports torch, costs more than a replay); ranks without actions in a
schedule take part only in the barriers around it.
"""
from __future__ import annotations

import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from harness.schedule import Action, Schedule, lower  # noqa: E402
from harness.schedule.p2p_order import order_mismatches, order_receives  # noqa: E402

WORLD = 8  # ranks: the largest schedule's stages


def _message_id(send: Action) -> float:
    """A number naming the message a send action posts (pipe, direction, sender stage, mb)."""
    return float(ord(send.pipe) * 100000 + (send.kind == "SB") * 10000 + send.stage * 100 + send.mb)


def _expected_send(recv: Action) -> Action:
    stage = recv.stage - 1 if recv.kind == "RF" else recv.stage + 1
    return Action(recv.pipe, stage, "SF" if recv.kind == "RF" else "SB", recv.mb)


def _replay(rank: int, schedule: Schedule, in_order: bool) -> int:
    """Replay ``rank``'s actions of ``schedule``; the number of receives that got a wrong payload."""
    from harness.real.parallel.comm import PipeChannel

    chan = PipeChannel(torch.device("cpu"), in_order=in_order)
    wrong, pending = 0, []
    for act in schedule.order.get(rank, []):
        if act.kind in ("RF", "RB"):
            pending.append(act)
        elif act.kind in ("SF", "SB"):
            tag = ord(act.pipe) * 1000 + 2 * act.mb + (act.kind == "SB")
            chan.send(torch.full((4,), _message_id(Action(act.pipe, act.stage, act.kind, act.mb))), act.peer, tag)
        else:
            if pending:
                specs = [((4,), q.peer, ord(q.pipe) * 1000 + 2 * q.mb + (q.kind == "RB"), torch.float32)
                         for q in pending]
                for q, buf in zip(pending, chan.recv_all(specs)):
                    wrong += int(buf[0].item() != _message_id(_expected_send(q)))
                pending = []
            chan.post()
    chan.flush()
    return wrong


def _replay_all(rank: int, init_file: str, replays: list[tuple[Schedule, bool]], out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for index, (schedule, in_order) in enumerate(replays):
            dist.barrier()
            wrong = _replay(rank, schedule, in_order)
            dist.barrier()  # every message of this replay delivered before the next one starts
            out.put((index, wrong))
    finally:
        dist.destroy_process_group()


def _wrong_payloads(replays: list[tuple[Schedule, bool]]) -> list[int]:
    """Wrong payloads of each (schedule, in_order) replay, over all ranks."""
    assert all(len(schedule.ranks) <= WORLD for schedule, _ in replays)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    wrong = [0] * len(replays)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_replay_all, args=(r, init_file, replays, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        try:
            for _ in range(WORLD * len(replays)):
                index, count = out.get(timeout=120)
                wrong[index] += count
            for p in procs:
                p.join(timeout=60)
                assert p.exitcode == 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
    return wrong


def _searched(num_stages: int, num_mbs: int) -> Schedule:
    from systems.rlhfuse.intra import FusedSearchConfig, fused_costs, fused_pipes, search_fused_schedule

    pipes = fused_pipes(num_stages, num_stages, num_mbs, num_mbs)
    return search_fused_schedule(pipes, fused_costs(pipes, 1.0, 1.0), config=FusedSearchConfig(seed=0,
                                                                                               max_steps=2000)).schedule


@pytest.fixture(scope="module")
def searched() -> dict[int, Schedule]:
    """Searched fused schedules of 4 and 8 stages, 8 micro-batches per pipe."""
    return {num_stages: _searched(num_stages, 8) for num_stages in (4, 8)}


@pytest.fixture(scope="module")
def wrong_payloads(searched) -> dict[tuple[str, int, bool], int]:
    """(lowering, stages, in_order) -> wrong payloads, every replay in one world."""
    replays = {("ordered", n, True): order_receives(searched[n]) for n in (4, 8)}
    replays |= {("naive", 4, in_order): lower(searched[4]) for in_order in (True, False)}
    counts = _wrong_payloads([(schedule, key[2]) for key, schedule in replays.items()])
    return dict(zip(replays, counts))


@pytest.mark.parametrize("num_stages", [4, 8])
def test_ordered_schedule_delivers_every_message_under_in_order_matching(searched, wrong_payloads, num_stages):
    assert order_mismatches(searched[num_stages]), "the searched schedule should be one the naive lowering gets wrong"
    assert wrong_payloads[("ordered", num_stages, True)] == 0


def test_naive_lowering_is_wrong_under_in_order_matching_and_hidden_by_tags(wrong_payloads):
    assert wrong_payloads[("naive", 4, True)] > 0  # what NCCL would deliver
    assert wrong_payloads[("naive", 4, False)] == 0  # gloo's tags match by identity
