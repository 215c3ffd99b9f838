"""``python -m geotrain`` is the ``geotrain`` command."""

from geotrain.cli import main

main()
