"""Elastic cross-site membership: sites that die, hang or come back without stopping the others.

In elastic mode every site is its own torch.distributed job; sites meet once per DiLoCo round.

- :mod:`.lighthouse`: the coordinator (torchft's Lighthouse) as a process of its own;
- :mod:`.coordinator`: a site's link to it (heartbeats, outages, quorum requests);
- :mod:`.auth`: the membership secret and the HMAC challenge;
- :mod:`.roundstore`: the store where a round's sites meet, the heartbeat monitor;
- :mod:`.view`: what a round is about (members, heal source, healers), pure;
- :mod:`.member`: one rank's part in a round (healing, the exchange, the vote);
- :mod:`.records`: what the sites' round records say (outcomes, time lost, merged summary).
"""
