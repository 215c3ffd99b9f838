"""Sections for failure: guarded updates, failure injection, elastic membership, and the timing
of failure detection and of every wait (liveness)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from geotrain.config.base import Section, check_site_at, parse_site_at


class GuardConfig(Section):
    enabled: bool = Field(default=True, description="Leave non-finite or outlier pseudo-gradients out of the average.")
    norm_factor: float = Field(
        default=10.0, gt=1, le=1e6, description="Exclude a site whose update norm exceeds this many times the running median."
    )
    window: int = Field(default=20, ge=1, le=10_000, description="Accepted norms the running median is taken over.")
    warmup: int = Field(default=3, ge=1, le=10_000, description="Accepted norms needed before the outlier test applies.")


SITE_FAULTS = ("kill", "hang", "tamper", "split", "migrate")  # failure injection into one site at one inner step


class FaultConfig(Section):
    nan: list[str] = Field(
        default_factory=list, description="Failure injection: 'SITE@ROUND' makes that site's pseudo-gradient NaN in that round."
    )
    kill: list[str] = Field(
        default_factory=list,
        description="Failure injection (elastic mode, or sync.quorum: any site but the first): 'SITE@STEP' SIGKILLs every "
        "process of that site at that inner step; at a round's last step, in the middle of the cross-site all-reduce.",
    )
    hang: list[str] = Field(
        default_factory=list, description="Like kill, but SIGSTOPs the site (a hung datacenter: sockets stay open)."
    )
    tamper: list[str] = Field(
        default_factory=list,
        description="Failure injection (elastic mode): 'SITE@STEP' alters that site's outgoing pseudo-gradient frames after "
        "their MAC in the round at that step (an attacker on the path): the round must roll back.",
    )
    split: list[str] = Field(
        default_factory=list,
        description="Failure injection (elastic mode): 'SITE@STEP' makes that site, in the round at that step, vote yes and "
        "then miss the others' votes (as if its heartbeat watch had timed out): it rolls back a round the others commit.",
    )
    migrate: list[str] = Field(
        default_factory=list,
        description="Migration (elastic mode, the local launcher): 'SITE@STEP' moves that site's work at that inner step: "
        "it drains at its next committed round (its processes stop between rounds: no round in flight, none rolled back) "
        "and a new incarnation starts at once with the same data slice and heals from a live site (docs/PLACE.md).",
    )
    restart_after: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="Seconds after a kill or hang when the launcher starts the site again (it heals from a live peer; with "
        "sync.quorum, after its ranks die (fault.kill or any other death once training has started) or the syncer loses "
        "it for silence, from the syncer's model); 0: never.",
    )

    @field_validator("nan", "kill", "hang", "tamper", "split", "migrate")
    @classmethod
    def _site_at_round(cls, v: list[str]) -> list[str]:
        return check_site_at(v, ())

    def nan_at(self) -> set[tuple[str, int]]:
        return {(site, rnd) for site, rnd, _ in map(parse_site_at, self.nan)}

    def at(self, kind: str) -> list[tuple[str, int]]:
        """The (site, step) pairs of one of :data:`SITE_FAULTS`."""
        return [(site, step) for site, step, _ in map(parse_site_at, getattr(self, kind))]

    def site_faults(self) -> list[tuple[str, int, str]]:
        """Every (site, step, kind) of ``kill``, ``hang``, ``tamper`` and ``split``: two kinds at one
        site and step are both kept."""
        return [(site, step, kind) for kind in SITE_FAULTS for site, step in self.at(kind)]


class ElasticConfig(Section):
    """Elastic cross-site membership (geotrain.elastic): a quorum per outer round, rollback of
    failed rounds, live healing, HMAC-authenticated joins (their heartbeats and timeouts: liveness)."""

    enabled: bool = Field(
        default=False,
        description="Run sites as independent jobs joined per round by a membership layer (torchft Lighthouse): a site may "
        "die, hang or rejoin without stopping the others. DiLoCo or Streaming DiLoCo.",
    )
    min_sites: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Fewest live sites a round needs; below it training pauses (logged) until sites return. With "
        "privacy.secure_aggregation a round needs 3 whatever this says.",
    )
    lighthouse: str | None = Field(
        default=None,
        description="HOST:PORT of a running membership coordinator (geotrain lighthouse); default: the launcher starts and "
        "supervises one on 127.0.0.1.",
    )
    secret_env: str = Field(default="GEOTRAIN_SECRET", description="Environment variable holding the shared membership secret.")
    secret_file: str | None = Field(
        default=None, description="File holding the shared membership secret (instead of secret_env)."
    )
    site_keys: str | None = Field(
        default=None,
        description="JSON file {site: Ed25519 public key hex} pinning every site's own key (geotrain keys prints it). Set: "
        "each site signs its claims and votes in every round with its key (privacy.keys_dir/<site>.key) and the "
        "frame keys come from signed ephemeral keys, so a site holding the secret cannot pose as another; read "
        "again every round: a site whose entry is removed is left out and cannot rejoin. Unset: the shared secret only.",
    )

    @model_validator(mode="after")
    def _keys(self) -> ElasticConfig:
        if self.site_keys and not self.enabled:
            raise ValueError("site_keys: pins the sites' keys of elastic mode; set elastic.enabled=true (or unset it)")
        return self


class LivenessConfig(Section):
    """How failures are detected and how long every wait may last, for every kind of run
    (docs/ELASTIC.md, docs/QUORUM.md). Two detectors read them: an elastic round's peers, whose
    silent site costs that round (it rejoins and heals), and a quorum hub, whose lost site is late
    forever, so the hub waits far longer before it gives a site up."""

    heartbeat_s: float = Field(default=0.25, gt=0, le=60, description="Elastic runs: seconds between heartbeats.")
    heartbeat_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="Elastic runs: a site silent this long is declared failed and its round aborted (it may rejoin).",
    )
    quorum_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="Elastic runs: seconds one quorum request waits before it is retried (and logged).",
    )
    start_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Elastic runs: at the start, wait this long for every site before training without the missing ones.",
    )
    wait_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Elastic runs: longest a site waits for a quorum while the Lighthouse is unreachable or fewer than "
        "elastic.min_sites sites answer (at the start, during training and for the last round; inner steps do not count); "
        "then it stops with an error.",
    )
    collective_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Elastic runs: backstop timeout of one cross-site exchange (heartbeats abort sooner).",
    )
    group_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="Every run: the torch.distributed groups' collective timeout (inside a site; across sites in lock-step runs).",
    )
    hub_heartbeat_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Quorum rounds with a hub: every rank tells the run's rendezvous store it is alive this often (a counter).",
    )
    hub_lost_after_s: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="Quorum rounds with a hub: a site one of whose ranks has not beaten for this long (stopped, hung, its "
        "machine gone) is lost: late forever, as a site that died. More than twice hub_heartbeat_s, less than hub_timeout_s.",
    )
    hub_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Quorum rounds with a hub: longest a site waits for the hub's answer before the run stops with an error.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> LivenessConfig:
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"heartbeat_timeout_s: must exceed twice heartbeat_s={self.heartbeat_s:g} (got {self.heartbeat_timeout_s:g})"
            )
        if self.hub_lost_after_s <= 2 * self.hub_heartbeat_s:
            raise ValueError(
                f"hub_lost_after_s: must exceed twice hub_heartbeat_s={self.hub_heartbeat_s:g} (got {self.hub_lost_after_s:g})"
            )
        if self.hub_lost_after_s >= self.hub_timeout_s:
            raise ValueError(
                f"hub_lost_after_s: must be less than hub_timeout_s={self.hub_timeout_s:g}, or the sites waiting for the final "
                f"round give up before a silent site is lost (got {self.hub_lost_after_s:g})"
            )
        return self


# keys that moved (into liveness; pace): an old key is refused in one line naming its new one
MOVED_KEYS = {
    "sync.quorum.local_steps": "sync.pace (local_steps=dynamic is sync.pace=adaptive)",
    **{f"elastic.{k}": f"liveness.{k}" for k in LivenessConfig.model_fields if not k.startswith(("hub_", "group_"))},
    "run.timeout_s": "liveness.group_timeout_s",
    "sync.quorum.heartbeat_s": "liveness.hub_heartbeat_s",
    "sync.quorum.lost_after_s": "liveness.hub_lost_after_s",
    "sync.quorum.timeout_s": "liveness.hub_timeout_s",
}
