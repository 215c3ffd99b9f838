"""geotrain: train one language model across several datacenters as if they were one computer."""

__version__ = "0.1.0"
