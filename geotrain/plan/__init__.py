"""``geotrain plan``: a capacity and communication planner (pure arithmetic, every formula cited).

Sections, each a small pure module: :mod:`.facility`, :mod:`.scaling` (budget and laws),
:mod:`.architecture`, :mod:`.memory`, :mod:`.layout` (3D parallelism), :mod:`.step` (compute and
communication times), network sizing (:mod:`geotrain.netsim.sizing`), :mod:`.strategies`
(low-communication training across sites). :mod:`.scenario` reads the YAML, :mod:`.run` assembles
the report, JSON and plots. No torch import.
"""
