"""A rank joining the elastic membership: its round member, healing on restart, and the
failure injection that asks the launcher to kill or hang this site at a given step.

A fresh site waits at the start rendezvous (no site trains rounds alone while others start); a
restarted site (incarnation > 0) heals from a live peer before its first step. Either way, local
rank 0 then marks the site live for the launcher (``OUT/elastic/live-<site>.<incarnation>``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.comm.faults import FaultPlan
from geotrain.comm.identity import Identity, site_key
from geotrain.comm.topology import RankInfo, Topology
from geotrain.config import ElasticConfig, LivenessConfig
from geotrain.elastic.commit import Masker, Noise
from geotrain.elastic.member import SiteMember
from geotrain.elastic.progress import QuorumMember
from geotrain.elastic.records import drain_file
from geotrain.elastic.view import HealHooks
from geotrain.errors import MembershipRefused, SiteDrained
from geotrain.report.metrics import log
from geotrain.round import RoundEngine
from geotrain.run.checkpoint import atomic_write
from geotrain.run.fsdp import from_whole, local_tree, sharded_like, whole_tree
from geotrain.run.state import RankObjects


def fault_file(folder: Path, site: str, step: int) -> Path:
    """The request file for a fault of ``site`` at ``step`` (the launcher reads it)."""
    return folder / f"fault-{site}-{step}.json"


def request_fault(folder: Path, where: RankInfo, kind: str, step: int, timeout_s: float = 120.0) -> None:
    """Failure injection at ``step``: the site's local rank 0 asks the launcher to signal every
    process of this site (``kind``: kill or hang) with a request file in ``folder``, and every rank
    of it waits for the signal. Returns only if the launcher declined (a ``.skip`` file: it is the
    last live site); raises if nothing happened within ``timeout_s`` (no launcher that injects faults)."""
    request = fault_file(folder, where.site, step)
    if where.local_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        # renamed into place: the launcher never reads half a file
        atomic_write(request, json.dumps({"site": where.site, "kind": kind, "step": step, "time": time.time()}).encode())
        log(where, step, f"fault injection: {kind} this site now")
    skip = request.with_suffix(".skip")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if skip.exists():
            return
        time.sleep(0.01)
    raise RuntimeError(f"fault injection: the launcher did not {kind} site {where.site} within {timeout_s:g} s")


def join_elastic(
    cfg: ElasticConfig,
    topology: Topology,
    faults: dict[int, str],
    out: Path,
    where: RankInfo,
    incarnation: int,
    objs: RankObjects,
    keys: Path,
    masker: Masker | None = None,
    plan: FaultPlan | None = None,
    noise: Noise | None = None,
    live: LivenessConfig | None = None,
) -> tuple[SiteMember, Callable[[int], None]]:
    """Join the elastic membership (:mod:`geotrain.elastic`); a restarted site (``incarnation`` > 0)
    heals from a live peer first. Returns the member and the per-step failure-injection hook.

    Args:
        topology: the whole run.
        faults: {step: 'kill' | 'hang' | 'migrate'} the launcher carries out on this site. A restarted incarnation
            asks only for those after the step it healed at that no predecessor asked for (those
            happened to its predecessors).
        where: this rank's place in the whole run.
        objs: this rank's training state (healing reads and replaces it).
        keys: the folder of the sites' own keys (``privacy.keys_dir``), for ``elastic.site_keys``.
        masker: secure aggregation inside every round (``privacy.secure_aggregation``).
        plan: the faults the member injects itself (frames altered after sealing, ``fault.tamper``).
        noise: site-level DP inside every round (``privacy.dp.unit=site``).
    """
    sync, data, groups = objs.sync, objs.data, objs.comm.groups
    assert isinstance(sync, RoundEngine)  # the config allows elastic mode with DiLoCo and Streaming DiLoCo
    (out / "elastic").mkdir(parents=True, exist_ok=True)

    drain = drain_file(out, where.site)
    boundary = {"committed": 0}

    def fault(step: int) -> None:
        kind = faults.pop(step, None)
        if kind is None or (incarnation and (member.healed_at_step is None or step <= member.healed_at_step)):
            pass
        elif incarnation and fault_file(out / "elastic", where.site, step).exists():
            pass  # a predecessor asked for it already (with adaptive pace a heal can set this site's step back)
        elif kind == "migrate":  # fault.migrate: drain at the next committed round (the launcher starts it again)
            if where.local_rank == 0:
                log(where, step, "fault injection: migrate this site after its next committed round")
                drain.touch()
        else:
            request_fault(out / "elastic", where, kind, step)

    def inject(step: int) -> None:  # after every step
        fault(step)
        drain_at_boundary(step)

    def drain_at_boundary(step: int) -> None:
        """Right after a committed round (every rank of the site sees it at the same step), leave
        the run if the site was asked to drain: local rank 0 reads the request and tells the others."""
        if committed() == boundary["committed"]:
            return
        boundary["committed"] = committed()
        flag = torch.tensor([float(where.local_rank == 0 and drain.exists())])
        dist.broadcast(flag, 0, group=groups.world)  # the site's own world
        if flag.item():
            if where.local_rank == 0:
                drain.unlink(missing_ok=True)
                record = {
                    "site": where.site,
                    "incarnation": incarnation,
                    "step": step,
                    "committed": committed(),
                    "time": time.time(),
                }
                atomic_write(out / "elastic" / f"drained-{where.site}.{incarnation}.json", json.dumps(record).encode())
            raise SiteDrained(f"site {where.site} drained after committed round {committed()} (step {step})")

    # FSDP: each rank heals its own shards from the same local rank of the source; over sites of
    # different sizes local rank i holds other shards at each site, so the state crosses whole
    whole = sync.resharded
    sharded = sync.sharded and not whole
    tiers = sync.tiers  # two tiers: region rounds sum over the region's sites
    mesh = groups.mesh
    tree = whole_tree if whole else local_tree

    def load(state: dict[str, Any]) -> None:
        if whole:
            assert mesh is not None
            state = from_whole(state, mesh)
        objs.load_training(sharded_like(objs.model, objs.optimizer, state) if sharded else state)
        sync.forget_feedback()  # the source's error feedback is its own: a healed site starts afresh
        if member.noise is not None:  # site-level DP: every committed round healed into held at most one update of ours
            member.noise.at_least(int(state["committed"]))
        if member.joining:  # a restarted site takes the source's step: its data stream catches up
            data.train.skip(int(state["step"]) * data.micro_batches)

    def note(message: str) -> None:
        if where.local_rank == 0:
            log(where, sync.local_steps, message)

    def committed() -> int:
        return sync.rounds - sync.rounds_rolled_back

    hooks = HealHooks(
        committed=committed,
        global_hash=sync.global_hash,
        step=lambda: sync.local_steps,
        state=lambda: tree({**objs.training_state(sync.local_steps), "committed": committed()}),
        load=load,
    )
    quorum: dict[str, float] = {}
    if sync.cfg.quorum is not None:  # quorum rounds: a late site heals the global part only
        hooks.load_global = lambda state: sync.load_global_state(state["sync"])
        hooks.global_state = lambda: tree({"step": sync.local_steps, "committed": committed(), "sync": sync.global_state()})
        quorum = {"staleness_power": sync.staleness_power, "world_weight": sync.world(list(topology.workers))}
    member = (QuorumMember if quorum else SiteMember)(
        cfg,
        topology,
        where.site,
        where.site_index,
        where.local_rank,
        groups.topology.workers[0],  # its world is its own site
        groups.world,
        objs.comm.wan,
        hooks,
        note,
        on_mid_round=lambda: fault(sync.local_steps),
        stats=objs.comm.stats,
        incarnation=incarnation,
        identity=_identity(cfg, where.site, keys),
        sharded=sharded,
        tiers=tiers,
        collective=whole,
        live=live,
        **quorum,
    )
    if plan is not None:
        member.faults = plan
    member.masker, member.noise = masker, noise
    member.paced = sync.clock.adaptive  # adaptive pace: tokens weigh every update, the run ends on rounds
    if sync.adapter is not None:  # sync.adapt: the exchange times a round trip; a healer's codec
        member.ping, member.codec_for = True, sync.codec_for
    if where.local_rank == 0:
        member.record_file = out / "elastic" / f"rounds-{where.site}.jsonl"
    sync.elastic = member
    present = out / "elastic" / f"live-{where.site}.{incarnation}"  # tells the launcher this site takes part
    try:
        if not incarnation:
            member.rendezvous(topology.num_sites, member.live.start_timeout_s)
        else:  # restarted: heal from a live peer at the next round boundary, before any step
            member.joining = True
            note(f"incarnation {incarnation}: joining the run and healing from a live peer")
            deadline = time.monotonic() + member.live.start_timeout_s
            while member.healed_at_step is None:
                sync.join_round()
                if member.healed_at_step is None:
                    if time.monotonic() > deadline:
                        raise MembershipRefused(
                            f"no live site to heal from within liveness.start_timeout_s={member.live.start_timeout_s:g}s"
                        )
                    time.sleep(member.live.heartbeat_s)
    except BaseException:
        member.close()  # its heartbeat thread must not outlive the interpreter
        raise
    if where.local_rank == 0:
        present.touch()
    return member, inject


def _identity(cfg: ElasticConfig, site: str, keys: Path) -> Callable[[], Identity] | None:
    """How this site's identity is made where the run pins site keys (``elastic.site_keys``): its
    key from the ``keys`` folder, checked against the pinned one."""
    pinned = cfg.site_keys
    if not pinned:
        return None
    return lambda: Identity(site, site_key(keys / f"{site}.key"), Path(pinned).expanduser())
