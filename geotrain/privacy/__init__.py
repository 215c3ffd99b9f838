"""Cross-organisation mode: what leaves a site is clipped, optionally noised, and securely summed.

- :mod:`.masking`: the cryptography of secure aggregation, no I/O (keys, masks, Shamir, graph);
- :mod:`.secagg`: the secure-aggregation protocol over geotrain's inter-site transport;
- :mod:`.dp`: accountants, noise calibration, DP-SGD (example-level DP);
- :mod:`.ghost`: DP-SGD of a model FSDP shards (per-example norms from layer hooks);
- :mod:`.aggregation`: clip + site-level noise + secure or plain sum of pseudo-gradients, audit log;
- :mod:`.build`: a rank's privacy machinery from the privacy section.
"""
