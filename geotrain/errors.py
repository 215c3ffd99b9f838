"""Every exception a caller of geotrain catches, in one place.

Parts raise these; the CLI and the training entry point turn them into one-line messages and
exit codes (2: bad input, 1: a run failed, 3: refused membership). Importing this module costs
nothing: it imports no torch, so the CLI can reject bad input before loading anything heavy.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, with a one-line message that names the field."""


class LaunchError(RuntimeError):
    """A rank (or, in elastic mode, every site) failed; the message names its site and rank."""


class StartMismatch(ConfigError):
    """Ranks or sites would start from different initial models (different configs or code):
    refused before the first step."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, truncated, tampered)."""


class NonFiniteError(ValueError):
    """A tensor to encode holds NaN or inf: refused at the sender."""


class CorruptPayload(RuntimeError):
    """An encoded payload from another site is not what its codec makes (length, positions): it
    is refused before any kernel reads it. In elastic rounds the round rolls back; a syncer leaves
    the update out."""


class RoundFailed(RuntimeError):
    """The round cannot be applied consistently on every site; the caller rolls it back."""


class SecAggAborted(RoundFailed):
    """Secure aggregation cannot complete (too few survivors or shares); nothing of it was applied."""


# What a peer, the network or a store can make a round raise: the round rolls back and the run
# goes on. torch.distributed's errors (Gloo's included) are RuntimeErrors; sockets raise OSErrors.
# Anything else (a TypeError, a KeyError, an AssertionError) is a bug in this process: it must stop
# the process with its traceback, not roll the round back as if a peer had failed.
ROUND_FAILURES: tuple[type[BaseException], ...] = (RuntimeError, OSError, EOFError)


class RoundPostponed(Exception):
    """Elastic mode: the membership coordinator is down; keep training and try again next step."""


class MembershipRefused(RuntimeError):
    """This process could not prove the shared secret (or has nobody to heal from); it takes part
    in no collective."""


class ElasticTimeout(RuntimeError):
    """An elastic site went longer than ``liveness.wait_timeout_s`` without a round (the Lighthouse
    unreachable, or fewer than ``elastic.min_sites`` sites answering): it stops."""


class SiteDrained(Exception):
    """Elastic mode: this site was asked to drain (migration) and left the run right after a
    committed round, before any further step; its ranks exit with :data:`DRAINED_EXIT`."""


DRAINED_EXIT = 5  # a rank's exit code when its site drained at a round boundary (not a failure)


class CoordinatorDown(RuntimeError):
    """The Lighthouse (membership coordinator) cannot be reached."""


class SyncerTimeout(RuntimeError):
    """Asynchronous quorum rounds: a site waited longer than ``liveness.hub_timeout_s`` for the
    syncer's answer; it stops."""
