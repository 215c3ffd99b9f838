"""Datacenter network sizing and flow-level simulation of synchronized training traffic.

- :mod:`.sizing`: fat-tree arithmetic (tiers, switches, links, optics, multi-rail), pure functions;
- :mod:`.fabric`: an explicit folded-Clos topology (numpy link arrays) and its shortest paths;
- :mod:`.routing`: ECMP, ECMP over subflows, ideal packet spraying, adaptive least-loaded;
- :mod:`.engine`: max-min fair sharing (progressive filling), event-driven over completions;
- :mod:`.traffic`: permutation, ring and hierarchical all-reduce phases, all-to-all;
- :mod:`.scenario` / :mod:`.run`: the ``geotrain netsim`` scenario file, runner and report.

Importable without torch; the planner uses the same engine.
"""
