"""The nanotron integration: a `Config` with a `bagualu:` section and the recipe it implies.
Needs `pip install 'bagualu-plugin[nanotron]'`; PyPI nanotron 0.4 is imported through `compat`."""
