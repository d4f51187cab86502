"""The operator's and the developer's tools around the engine: ``fsck`` (check and repair a
region offline), ``warmup`` (compile every kernel ahead, ``tract warmup``), ``soak`` (a long
mixed load that counts wrong bytes and leaks). The CLI (``tract_async.cli``) fronts them."""
