"""Assemble a plan from a scenario: every section, the paper comparison, the report and plots."""

from __future__ import annotations

import time
from typing import Any

from geotrain.errors import ConfigError
from geotrain.netsim.sizing import hosts_capacity, size_fat_tree, tier_ports
from geotrain.plan.architecture import architecture
from geotrain.plan.facility import Rack, compute_budget, facility
from geotrain.plan.layout import layout
from geotrain.plan.memory import memory
from geotrain.plan.scaling import LAWS, optimal
from geotrain.plan.scenario import PlanScenario
from geotrain.plan.search import Machine, Space, Work, evaluate, search
from geotrain.plan.step import step_times
from geotrain.plan.strategies import STREAMING_TABLE4, TARGETS, required_bps, strategies


def _rack(sc: PlanScenario) -> Rack:
    r = sc.facility.rack
    return Rack(
        name=r.name,
        gpus=r.gpus,
        price_usd=r.price_usd,
        power_watts=r.power_watts,
        dense_flops=tuple((k, v * 1e15) for k, v in r.dense_pflops.items()),
        hbm_bytes=r.hbm_tb * 1e12,
        scale_up_bytes_per_s=r.scale_up_gbytes_per_s * 1e9,
        nic_bps=r.nic_gbps * 1e9,
    )


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def run_plan(sc: PlanScenario) -> dict[str, Any]:
    t0 = time.perf_counter()
    rack = _rack(sc)
    f = sc.facility
    budget_usd = f.budget_usd if f.racks is None else f.racks * rack.price_usd / f.compute_share
    try:
        fac = facility(budget_usd, f.compute_share, rack, f.precision, f.sparsity, f.non_compute_overhead)
    except ValueError as exc:  # e.g. a budget that buys no rack: the input's fault, reported as such
        raise ConfigError(f"facility: {exc}") from None
    flops = compute_budget(fac["peak_flops"], sc.budget.utilization, sc.budget.months)
    all_laws = {law: optimal(law, flops, sc.budget.tokens_per_param) for law in LAWS}
    scal = all_laws[sc.budget.law]
    m = sc.model
    arch = architecture(m.layers, m.hidden, m.heads, m.vocab, m.seq_len)
    p = sc.precision
    mem = memory(
        arch["params"],
        m.layers,
        m.hidden,
        m.heads,
        m.seq_len,
        m.micro_batch,
        p.weight_bytes,
        p.grad_bytes,
        p.optimizer_bytes,
        p.activation_bytes,
        p.recompute,
    )
    notes: list[str] = list(arch["notes"])
    lay, step, searched = _layout(sc, arch, mem, fac, rack, notes)
    # network: one fat tree per site for the GPUs it holds
    n = sc.network
    hosts_per_site = -(-fac["gpus"] // sc.sites.count)
    try:
        tree = size_fat_tree(
            hosts_per_site,
            n.radix,
            n.tiers,
            oversubscription=n.oversubscription,
            ports=n.ports,
            port_bps=rack.nic_bps,
            rails=n.rails,
        ).to_dict()
        tree["fits"] = True
        tree["links"] = tree["switch_links"]
    except ValueError as exc:
        tree = {"fits": False, "reason": str(exc), "tiers": n.tiers, "hosts": hosts_per_site}
        notes.append(f"scale-out network: {exc}")
    network = {
        "hosts_per_site": hosts_per_site,
        "fat_tree": tree,
        "two_tier_hosts_full": hosts_capacity(tier_ports(n.radix, 2)),
        "two_tier_hosts_4to1": hosts_capacity(tier_ports(n.radix, 2, [4.0])),
    }
    s = sc.strategies
    step_s = s.step_seconds or (lay["step_seconds"] if lay["fits"] else 1.0)  # the chosen layout's whole step
    strat = strategies(
        s.params or arch["params"],
        s.layers or m.layers,
        step_s,
        sc.sites.count,
        sc.sites.link_gbps * 1e9,
        sc.sites.rtt_ms / 1e3,
        s.H,
        s.tau,
        s.bits,
        s.target,
    )
    out: dict[str, Any] = {
        "scenario": sc.name,
        "facility": fac,
        "budget": {"compute_flops": flops, "months": sc.budget.months, "utilization": sc.budget.utilization},
        "scaling": scal,
        "scaling_all_laws": all_laws,
        "model": arch,
        "memory": mem,
        "layout": lay,
        "search": searched,
        "step": step,
        "network": network,
        "strategies": strat["rows"],
        "strategy_params": {
            "params": s.params or arch["params"],
            "step_seconds": step_s,
            "fragments": strat["fragments"],
            "tau": strat["tau"],
            "H": s.H,
            "link_bps": sc.sites.link_gbps * 1e9,
            "rtt_s": sc.sites.rtt_ms / 1e3,
        },
        "recommendation": strat["recommendation"],
        "notes": notes,
    }
    if s.compare_streaming_table4:
        out["streaming_table4"] = _table4(s)
    if sc.paper is not None:
        rows = []
        for key, theirs in sc.paper.figures.items():
            ours = _get(out, key)
            rows.append(
                {
                    "key": key,
                    "paper": theirs,
                    "ours": ours,
                    "ratio": (ours / theirs) if isinstance(ours, (int, float)) and theirs else None,
                }
            )
        out["paper"] = {"source": sc.paper.source, "figures": rows, "notes": sc.paper.notes}
    out["elapsed_seconds"] = time.perf_counter() - t0
    return out


# the search's whole-step breakdown of its chosen layout (section 6 under policy: search)
STEP_KEYS = (
    "layer_forward_seconds",
    "tp_seconds_per_layer_forward",
    "stage_forward_seconds",
    "stage_backward_seconds",
    "pp_send_bytes",
    "pp_send_seconds",
    "pipeline_seconds",
    "bubble_seconds",
    "dp_grads_per_gpu_bytes",
    "dp_reduce_seconds",
    "dp_exposed_seconds",
    "fsdp_gather_exposed_seconds",
    "step_seconds",
)


def _work(sc: PlanScenario, arch: dict[str, Any]) -> Work:
    m, p = sc.model, sc.precision
    return Work(
        layers=m.layers,
        hidden=m.hidden,
        heads=m.heads,
        seq_len=m.seq_len,
        vocab=m.vocab,
        layer_params=arch["params_per_layer"],
        layer_forward_flops=arch["layer_forward_flops"],
        micro_batch=m.micro_batch,
        global_batch_tokens=sc.parallel.global_batch_tokens,
        weight_bytes=p.weight_bytes,
        grad_bytes=p.grad_bytes,
        optimizer_bytes=p.optimizer_bytes,
        activation_bytes=p.activation_bytes,
        wire_bytes=p.wire_bytes,
    )


def _layout(
    sc: PlanScenario, arch: dict[str, Any], mem: dict[str, Any], fac: dict[str, Any], rack: Rack, notes: list[str]
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """(layout, per-layer step section, search result) under ``sc.layout_policy``.

    Raises:
        ConfigError: a fixed ``parallel.tensor_parallel`` / ``pipeline_parallel`` that fits nothing.
    """
    par, m, p = sc.parallel, sc.model, sc.precision
    machine = Machine(
        racks=fac["racks"],
        gpus_per_rack=rack.gpus,
        gpu_hbm_bytes=rack.hbm_bytes / rack.gpus,
        gpu_flops=fac["gpu_peak_flops"],
        mfu=par.mfu,
        scale_up_bytes_per_s=rack.scale_up_bytes_per_s,
        nic_bytes_per_s=rack.nic_bps / 8,
    )
    work = _work(sc, arch)
    searched: dict[str, Any] | None = None
    fixed = "parallel.tensor_parallel" if par.tensor_parallel else "parallel.pipeline_parallel"
    if sc.layout_policy == "paper":
        static = mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"]
        lay = layout(
            m.layers,
            static,
            mem["activations_bytes"],
            fac["racks"],
            rack.gpus,
            rack.hbm_bytes,
            par.tensor_parallel_max,
            par.tensor_parallel,
        )
        lay["policy"] = "paper"
        if not lay["fits"]:
            if par.tensor_parallel:
                raise ConfigError(
                    f"parallel.tensor_parallel: {par.tensor_parallel}-way TP cannot hold the model: {lay['reason']}"
                )
            notes.append(f"model does not fit: {lay['reason']}")
            return lay, None, None
        if lay["memory_per_gpu_bytes"] > lay["gpu_hbm_bytes"] and par.tensor_parallel:  # the user's TP must run
            raise ConfigError(
                f"parallel.tensor_parallel: with {par.tensor_parallel}-way TP a GPU needs "
                f"{lay['memory_per_gpu_bytes'] / 1e9:.0f} GB, one holds {lay['gpu_hbm_bytes'] / 1e9:.0f} GB"
            )
        if lay["memory_per_gpu_bytes"] > lay["gpu_hbm_bytes"]:  # the paper's own choice (50T): reproduced, flagged
            notes.append(
                f"per-GPU memory {lay['memory_per_gpu_bytes'] / 1e9:.0f} GB exceeds one GPU's "
                f"{lay['gpu_hbm_bytes'] / 1e9:.0f} GB; the layout fits the rack's pooled HBM only"
            )
        # the whole step of this layout at the scenario's global batch, as the search would cost it
        micro = max(1, -(-work.batch_sequences // (m.micro_batch * lay["data_parallel"])))
        whole = evaluate(work, machine, lay["tensor_parallel"], m.layers, micro, p.recompute, par.shard_optimizer)
        lay.update({k: whole[k] for k in ("micro_batches", "bubble_fraction", "step_seconds", "tokens_per_step")})
    else:
        tps = (par.tensor_parallel,) if par.tensor_parallel else tuple(range(1, par.tensor_parallel_max + 1))
        pps = (par.pipeline_parallel,) if par.pipeline_parallel else None
        space = Space(tps, pps, shard=par.shard_optimizer, headroom=par.memory_headroom)
        searched = search(work, machine, space, par.top)
        rule = layout(
            m.layers,
            mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"],
            mem["activations_bytes"],
            fac["racks"],
            rack.gpus,
            rack.hbm_bytes,
            par.tensor_parallel_max,
        )
        searched["paper_rule"] = _paper_rule(
            rule, work, machine, p.recompute, par.shard_optimizer, searched["memory_budget_bytes"]
        )
        if not searched["best"]:
            why = _no_fit(searched)
            if par.tensor_parallel or par.pipeline_parallel:
                raise ConfigError(f"{fixed}: no layout with it fits one GPU: {why}")
            notes.append(f"model does not fit: {why}")
            return {"fits": False, "policy": "search", "reason": why}, None, searched
        lay = {"fits": True, "policy": "search", "reason": "", **searched["best"][0]}
        return lay, {k: lay[k] for k in STEP_KEYS}, searched
    step = step_times(
        arch,
        lay,
        fac["gpu_peak_flops"],
        par.mfu,
        p.wire_bytes,
        p.grad_bytes,
        m.micro_batch,
        rack.scale_up_bytes_per_s,
        rack.nic_bps / 8,
        rack.gpus,
        sc.sites.count,
        sc.sites.rtt_ms / 1e3,
        None if sc.sites.wan_budget_ms is None else sc.sites.wan_budget_ms / 1e3,
    )
    return lay, step, searched


def _paper_rule(rule: dict[str, Any], work: Work, machine: Machine, recompute: bool, shard: str, budget: float) -> dict[str, Any]:
    """The paper rule's layout costed like the search's, and why the search did or did not keep it."""
    if not rule["fits"]:
        return {"fits": False, "reason": rule["reason"]}
    micro = max(1, -(-work.batch_sequences // (work.micro_batch * rule["data_parallel"])))
    cost = evaluate(work, machine, rule["tensor_parallel"], work.layers, micro, recompute, shard)
    idle = machine.gpus_per_rack - rule["gpus_used_per_rack"]
    fits = cost["memory_per_gpu_bytes"] <= budget
    reason = (
        ""
        if fits
        else f"{rule['memory_per_gpu_bytes'] / 1e9:.0f} GB per GPU by the paper's memory model "
        f"({rule['memory_per_gpu_bytes'] / machine.gpu_hbm_bytes:.0%} of one GPU's {machine.gpu_hbm_bytes / 1e9:.1f} GB), "
        f"{cost['memory_per_gpu_bytes'] / 1e9:.0f} GB with 1F1B's {min(work.layers, micro)} micro-batches in flight; "
        f"the budget is {budget / 1e9:.0f} GB"
    )
    return {
        "fits": fits,
        "reason": reason,
        "layers_per_rack": rule["layers_per_rack"],
        "idle_gpus_per_rack": idle,
        "paper_memory_per_gpu_bytes": rule["memory_per_gpu_bytes"],  # the paper's model: one micro-batch's activations
        **cost,
    }


def _no_fit(searched: dict[str, Any]) -> str:
    rej = ", ".join(f"{why}: {n}" for why, n in searched["rejected"].items())
    c = searched["closest_rejected"]
    near = (
        f"; the smallest needs {c['memory_per_gpu_bytes'] / 1e9:.0f} GB per GPU (TP {c['tensor_parallel']}, "
        f"PP {c['pipeline_parallel']}) against {searched['memory_budget_bytes'] / 1e9:.0f} GB"
        if c
        else ""
    )
    return f"{sum(searched['rejected'].values())} candidates rejected ({rej}){near}"


def _table4(s: Any) -> list[dict[str, Any]]:
    """Our closed form on Streaming DiLoCo's Table 4 settings (2 sites, H=100, 3-layer fragments)."""
    sizes = {"1B": (1e9, 24), "10B": (10e9, 48), "100B": (100e9, 108)}  # layer counts assumed (not in the table)
    rows = []
    for name, (params, layers) in sizes.items():
        ref: dict[str, Any] = STREAMING_TABLE4[name]
        for alg in ("dp", "diloco", "streaming", "streaming_fp4"):
            ours = [
                required_bps(alg, t, params, ref["step_s"], 2, 0.0, s.H, -(-layers // 3), s.tau, s.bits) / 1e9 for t in TARGETS
            ]
            rows.append({"model": name, "algorithm": alg, "theirs_gbps": list(ref[alg]), "ours_gbps": ours})
    return rows
