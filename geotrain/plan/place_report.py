"""``geotrain place``'s answer: the chosen placement as JSON and a table, its runner-ups and why
each lost, the naive placement beside it, and the runnable geotrain config it writes."""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from geotrain.config import Config, format_error
from geotrain.errors import ConfigError
from geotrain.plan.exchange import SHAPES
from geotrain.plan.place import Placement, Placer
from geotrain.plan.pool import Pool

RUNNER_UPS = 4


def describe(placer: Placer, p: Placement) -> dict[str, Any]:
    """A placement as JSON: sites, workers, exchange, round, predictions, bytes per link per round."""
    names = [s.name for s in placer.pool.sites]
    return {
        "sites": {names[i]: p.workers[i] for i in p.sites},
        "pace": p.pace,
        "tiers": [[names[i] for i in g] for g in p.regions],
        "region_every": p.region_every,
        "shape": p.shape,
        "order": [names[i] for i in p.order],
        "region_shape": p.region_shape if p.regions else None,
        "H": p.H,
        "codec": p.codec,
        "inner_step_s": {names[i]: t for i, t in p.step_s.items()},
        "sync_s": p.sync_s,
        "round_s": p.round_s,
        "utilization": {names[i]: u for i, u in p.utilization.items()},
        "meets_utilization": p.meets_utilization,
        "tokens_per_round": p.tokens_per_round,
        "hours": p.hours,
        "cost": p.cost,
        "link_bytes_per_round": {f"{names[a]}->{names[b]}": v for (a, b), v in sorted(placer.link_bytes(p).items())},
    }


def why_lost(placer: Placer, p: Placement, best: Placement) -> str:
    """What ``p`` does differently from ``best`` and what that costs, in one line."""
    names = [s.name for s in placer.pool.sites]
    diff = []
    gone = [names[i] for i in best.sites if not p.workers[i]]
    extra = [names[i] for i in p.sites if not best.workers[i]]
    if gone:
        diff.append("without " + ", ".join(gone))
    if extra:
        diff.append("with " + ", ".join(extra))
    fewer = [f"{names[i]} x{p.workers[i]}" for i in p.sites if best.workers[i] and p.workers[i] != best.workers[i]]
    if fewer:
        diff.append(", ".join(fewer) + " workers")
    if bool(p.regions) != bool(best.regions):
        diff.append("two tiers" if p.regions else "one tier")
    if p.shape != best.shape:
        diff.append(f"{p.shape} instead of {best.shape}")
    elif p.order != best.order and not gone and not extra:
        diff.append("order " + ",".join(names[i] for i in p.order))
    if p.pace != best.pace:
        diff.append(f"{p.pace} pace")
    if (p.H, p.codec) != (best.H, best.codec):
        diff.append(f"H {p.H}, {p.codec}")
    cost = ""
    if placer.job.objective == "cost" or placer.job.budget is not None:
        cost = f", cost {p.cost:.4g} vs {best.cost:.4g}"
    late = ""
    if placer.job.deadline_h is not None and p.hours > placer.job.deadline_h:
        late = " (misses the deadline)"
    what = "; ".join(diff) or "same sites and exchange"
    return f"{what}: {p.hours / best.hours - 1:+.1%} time (sync {p.sync_s:.3g} s vs {best.sync_s:.3g} s per round){cost}{late}"


def place_config(pool: Pool, p: Placement, base: Config) -> Config:
    """The runnable geotrain config of placement ``p`` over ``base`` (raises ConfigError when
    the base config does not combine with it, naming the field)."""
    data = base.model_dump()
    names = [s.name for s in pool.sites]
    top = max(pool.sites[i].speed for i in p.sites)
    sites = []
    for i in p.sites:
        s = pool.sites[i]
        site: dict[str, Any] = {"name": s.name, "workers": p.workers[i], "compute_speed": s.speed / top}
        if s.corpus is not None:
            site["corpus"] = s.corpus
        sites.append(site)
    chosen = set(p.sites)
    pairs = []
    for link in pool.links.pairs:
        if all(names.index(n) in chosen for n in link.sites):
            pairs.append(link.model_dump())
    data["topology"] = {
        **data["topology"],
        "sites": sites,
        "regions": [{"name": f"region{k}", "sites": [names[i] for i in g]} for k, g in enumerate(p.regions)],
        "exchange": {"order": [names[i] for i in p.order], "shape": p.shape, "region_shape": p.region_shape},
    }
    data["topology"]["links"] = {
        **data["topology"]["links"],
        "intra": pool.links.intra.model_dump(),
        "inter": pool.links.default.model_dump(),
        "between": pairs,
    }
    data["train"]["steps"] = max(1, math.ceil(pool.job.tokens / (p.tokens_per_round / p.H)))  # the fastest site's steps
    data["sync"].update(H=p.H, codec={**data["sync"]["codec"], "name": p.codec}, pace=p.pace, region_every=p.region_every)
    if data["sync"]["algorithm"] == "ddp":
        data["sync"]["algorithm"] = "diloco"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:  # one line naming the field
        raise ConfigError(f"the base config does not combine with the placement: {format_error(exc, Config)}") from None


def run_place(pool: Pool, params: int, tokens_per_step: int, base: Config) -> tuple[dict[str, Any], Config, Config]:
    """Search the pool; the answer as JSON, the chosen placement's config and the naive one's (every
    site, pool order, one ring, lock-step, the chosen H and codec: what ``bench place`` compares)."""
    # a base config that allows no tree or hub gets the ring only (the codec is the placement's own)
    placer = Placer(pool, params, tokens_per_step, ("ring",) if base.ring_only(codec="none") else SHAPES)
    ranked = placer.search()
    config, skipped = None, []  # the best placement the base config runs with (elastic, privacy, ...)
    for i, p in enumerate(ranked):
        try:
            config = place_config(pool, p, base)
        except ConfigError as exc:
            skipped.append(str(exc))
            continue
        best, ranked = p, ranked[i:]
        break
    if config is None:
        raise ConfigError(f"no placement of the pool runs with the base config ({len(skipped)} tried): {skipped[0]}")
    ups: list[dict[str, Any]] = []
    seen = {(best.workers, best.pace, bool(best.regions))}
    for p in ranked[1:]:
        if len(ups) == RUNNER_UPS:
            break
        if (p.workers, p.pace, bool(p.regions)) not in seen:
            seen.add((p.workers, p.pace, bool(p.regions)))
            ups.append({**describe(placer, p), "why": why_lost(placer, p, best)})
    naive = placer.naive(best)
    out = {
        "job": {**pool.job.model_dump(), "params": params, "tokens_per_step": tokens_per_step},
        "pool_sites": {s.name: s.model_dump() for s in pool.sites},
        "searched": placer.searched,
        "chosen": describe(placer, best),
        "skipped": {"count": len(skipped), "why": sorted(set(skipped))[:5]},
        "meets": {
            "budget": pool.job.budget is None or best.cost <= pool.job.budget,
            "deadline": pool.job.deadline_h is None or best.hours <= pool.job.deadline_h,
        },
        "runner_ups": ups,
        "naive": {**describe(placer, naive), "why": why_lost(placer, naive, best)},
        "train_steps": config.train.steps,
    }
    return out, config, place_config(pool, naive, base)


def print_place(out: dict[str, Any], console: Console) -> None:
    """The chosen placement, its runner-ups and the naive one, as tables."""
    c = out["chosen"]
    console.print(
        f"[bold]placement[/bold] of {out['job']['tokens']:.3g} tokens ({out['job']['objective']}): "
        f"{out['searched']} placements evaluated"
    )
    t = Table("site", "workers", "kind", "speed", "inner step s", "utilisation")
    for name, w in c["sites"].items():
        s = out["pool_sites"][name]
        t.add_row(name, str(w), s["kind"], f"{s['speed']:g}", f"{c['inner_step_s'][name]:.4g}", f"{c['utilization'][name]:.1%}")
    console.print(t)
    tiers = f"two tiers {c['tiers']} (every {c['region_every']} rounds; regions: {c['region_shape']}), " if c["tiers"] else ""
    console.print(
        f"exchange: {tiers}{c['shape']} over {' -> '.join(c['order'])}; H={c['H']}, codec {c['codec']}, {c['pace']} pace"
    )
    console.print(
        f"predicted: round {c['round_s']:.4g} s (sync {c['sync_s']:.3g} s), {c['hours']:.4g} h to target, "
        f"cost {c['cost']:.4g}"
        + ("" if c["meets_utilization"] else f" [yellow](below the {out['job']['utilization']:.0%} utilisation)[/yellow]")
    )
    if out["skipped"]["count"]:
        console.print(
            f"{out['skipped']['count']} better placement(s) left out: the base config does not run them "
            f"({out['skipped']['why'][0]})",
            markup=False,
            highlight=False,
        )
    links = Table("link", "bytes per round")
    for k, v in sorted(c["link_bytes_per_round"].items(), key=lambda kv: -kv[1])[:12]:
        links.add_row(k, f"{v:,.0f}")
    console.print(links)
    r = Table("runner-up", "hours", "cost", "why it lost")
    for ru in out["runner_ups"]:
        r.add_row(", ".join(f"{k}x{v}" for k, v in ru["sites"].items()), f"{ru['hours']:.4g}", f"{ru['cost']:.4g}", ru["why"])
    n = out["naive"]
    r.add_row("naive: " + ", ".join(f"{k}x{v}" for k, v in n["sites"].items()), f"{n['hours']:.4g}", f"{n['cost']:.4g}", n["why"])
    console.print(r)
