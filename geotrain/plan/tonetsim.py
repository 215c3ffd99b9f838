"""``geotrain plan SCENARIO --netsim OUT.yaml``: the chosen layout's traffic as a netsim scenario.

One source for message sizes: every byte count comes from the plan's own layout and step
(plan/search.py, plan/step.py). The file is validated as a netsim scenario before it is written,
so ``geotrain netsim OUT.yaml`` runs it as it is.

What the fabric carries: the GPUs of one pipeline stage in every replica, rack by rack (a rack
holds ``k`` replicas' copies of the stage on ``k t`` GPUs, so netsim's groups are ``k t`` hosts and
its hierarchical pattern reduces inside them on NVLink, then rings across racks). When that is
more than ``MAX_HOSTS`` hosts or more than the fabric holds, the file keeps whole racks up to the
limit: a ring's bandwidth term does not depend on how many racks it spans. Unless the scenario
fixes the port split per tier, that slice sits on the fewest tiers of the site's radix that hold it.

Exchanges of one training step, in the order they run:

- ``tp-allreduce`` (TP > 1): each GPU's tensor-parallel all-reduce, 4 per layer and micro-batch
  (2 forward, 2 backward; 6 with recomputation). It stays in the rack, so it is listed with
  ``on_fabric: false``;
- ``pp-send`` (PP > 1): activations forward and their gradients backward, ``2 m`` per step, as a
  synchronized permutation (the founding paper's section 5);
- ``dp-reduce`` (more than one rack of replicas): the gradient reduction, as an all-reduce of the
  stage's gradients (``shard_optimizer: optimizer``: half gradients, half updated weights;
  ``full``: the reduce-scatter half only, plus ``fsdp-gather``, each layer's weights gathered
  twice per micro-batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from geotrain.config.load import format_error
from geotrain.errors import ConfigError
from geotrain.netsim.scenario import Scenario
from geotrain.netsim.sizing import hosts_capacity, tier_ports
from geotrain.plan.scenario import PlanScenario

MAX_HOSTS = 4096


def netsim_scenario(sc: PlanScenario, out: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(netsim scenario as a mapping, notes on what it leaves out) for the plan ``out`` of ``sc``.

    Raises:
        ConfigError: no layout fits, or nothing of the layout crosses the scale-out fabric.
    """
    lay = out["layout"]
    if not lay["fits"]:
        raise ConfigError(f"parallel: no layout fits, so there is no traffic to simulate ({lay['reason']})")
    t, p, d = lay["tensor_parallel"], lay["pipeline_parallel"], lay["data_parallel"]
    m = lay["micro_batches"]
    if lay["policy"] == "paper":
        k, racks, lps, recompute = lay["layers_per_rack"], max(1, round(lay["dp_peers_scale_out"])), 1, sc.precision.recompute
    else:
        k, racks, lps, recompute = lay["dp_copies_per_rack"], lay["dp_racks"], lay["layers_per_stage"], lay["recompute"]
    arch, prec, net = out["model"], sc.precision, sc.network
    stage_params = lps * arch["params_per_layer"] + arch["vocab"] * arch["hidden"]
    act = arch["seq_len"] * sc.model.micro_batch * arch["hidden"] * prec.wire_bytes / t
    group = k * t
    cap = hosts_capacity(tier_ports(net.radix, net.tiers, net.oversubscription, net.ports))
    keep = max(1, min(racks, MAX_HOSTS // group, cap // group))
    notes = []
    if keep < racks:
        notes.append(f"{keep} of the stage's {racks} racks of replicas (hosts limited to {min(MAX_HOSTS, cap):,})")
    traffic: list[dict[str, Any]] = []
    if t > 1:
        count = (6 if recompute else 4) * lps * m
        traffic.append({"name": "tp-allreduce", "pattern": "ring", "message_bytes": 2 * act, "count": count, "on_fabric": False})
    if p > 1:
        traffic.append({"name": "pp-send", "pattern": "permutation", "message_bytes": act, "count": 2 * m})
    if keep > 1:
        grads, weights = stage_params * prec.grad_bytes, stage_params * prec.weight_bytes  # the stage, all t shards
        shard = sc.parallel.shard_optimizer
        size = grads if shard == "none" else (grads + weights) / 2 if shard == "optimizer" else grads / 2
        dp = {"pattern": "hierarchical", "group_size": group, "in_group_on_fabric": False}
        traffic.append({"name": "dp-reduce", "message_bytes": size, **dp})
        if shard == "full":
            per_layer = arch["params_per_layer"] * prec.weight_bytes / 2
            traffic.append({"name": "fsdp-gather", "message_bytes": per_layer, "count": 2 * m * lps, **dp})
    if not any(tr.get("on_fabric", True) for tr in traffic):
        raise ConfigError(
            f"parallel: nothing of this layout (TP {t}, PP {p}, DP {d} in {racks} rack(s)) crosses the scale-out fabric"
        )
    hosts = max(2, keep * group)
    tiers = net.tiers
    if not (net.oversubscription or net.ports):  # the slice on the smallest tree of this radix that holds it
        tiers = next(n for n in (2, 3, 4) if n >= net.tiers or hosts_capacity(tier_ports(net.radix, n)) >= hosts)
        if tiers < net.tiers:
            notes.append(f"{tiers} tiers of radix {net.radix} hold these {hosts:,} hosts (the site's tree has {net.tiers})")
    scenario = {
        "name": f"{out['scenario']}-step",
        "fabric": {
            "hosts": hosts,
            "tiers": tiers,
            "radix": net.radix,
            "port_gbps": sc.facility.rack.nic_gbps,
            "rails": net.rails,
            **({"oversubscription": net.oversubscription} if net.oversubscription else {}),
            **({"ports": net.ports} if net.ports else {}),
        },
        "traffic": traffic,
        "trials": 1,
    }
    return scenario, notes


def write_netsim(sc: PlanScenario, out: dict[str, Any], path: Path) -> Path:
    """Validate the netsim scenario of this plan and write it as YAML with a header saying where
    every number came from."""
    scenario, notes = netsim_scenario(sc, out)
    try:
        Scenario.model_validate(scenario)
    except ValidationError as exc:  # a planner bug, not the user's input: say so plainly
        raise ConfigError(f"netsim export: {format_error(exc, Scenario)}") from None
    lay = out["layout"]
    head = [
        f"# geotrain plan {sc.name} --netsim: one training step of the chosen layout ({lay['policy']} policy)",
        f"# TP {lay['tensor_parallel']} x PP {lay['pipeline_parallel']} x DP {lay['data_parallel']}, "
        f"{lay['micro_batches']} micro-batches; message sizes from the plan (geotrain/plan/tonetsim.py)",
        *(f"# note: {n}" for n in notes),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(scenario, sort_keys=False))
    return path
