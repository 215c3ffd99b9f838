"""``geotrain plan``: a capacity and communication planner (pure arithmetic, every formula cited).

Sections, each a small pure module: :mod:`.facility`, :mod:`.scaling` (budget and laws),
:mod:`.architecture`, :mod:`.memory`, :mod:`.layout` (the paper's 3D-parallel rule), :mod:`.search`
(the layout search), :mod:`.step` (compute and communication times), network sizing
(:mod:`geotrain.netsim.sizing`), :mod:`.strategies` (low-communication training across sites).
:mod:`.scenario` reads the YAML, :mod:`.run` assembles the plan, :mod:`.report` prints and plots
it, :mod:`.tonetsim` writes its traffic as a netsim scenario. No torch import.
"""
