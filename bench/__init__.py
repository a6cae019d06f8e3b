"""flexlab's benchmark runner: providers × cases, timed and checked against float64, with reports.

Entry points: ``python -m bench run|report|summary|list-presets|list-providers`` and
``python -m bench.forward``. See bench/README.md for the results schema.
"""
