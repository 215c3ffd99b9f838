"""What a run reports: per-step metrics and log lines, the run summary, the table and the plot.

- :mod:`.metrics`: JSONL per step, TensorBoard, ``[site/rank step N]`` lines, timelines;
- :mod:`.summary`: per-rank records, the run summary, the merged summary of several runs;
- :mod:`.tables`: the side-by-side table; :mod:`.plots`: the loss-curve PNG;
- :mod:`.outputs`: the files ``geotrain train`` writes at the end.
"""
