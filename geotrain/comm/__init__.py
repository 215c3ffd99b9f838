"""How ranks are placed and talk: topology, process groups, collectives, link emulation.

- :mod:`.topology`: sites, ranks, links; pure rank arithmetic (no torch.distributed);
- :mod:`.groups`: the one module that creates process groups;
- :mod:`.collectives`: ring collectives over point-to-point sends, counted per link;
- :mod:`.emulate`: wide-area links on one machine (in-process pacing, or kernel namespaces + tc);
- :mod:`.procs`: ranks as processes (ports, namespaces, dying with the parent, ``run_ranks``).
"""
