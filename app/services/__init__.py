"""Glue between the pages and the libraries: the pages call these, these call the worker
(:mod:`app.client`) for anything that runs the user's code or a kernel, and bench's loader and
report for result files.

- :mod:`app.services.common`: limits, shapes, fingerprints, worker calls, provenance;
- :mod:`app.services.playground`: the Playground's views and actions;
- :mod:`app.services.gallery`: the registered variants;
- :mod:`app.services.bench`: bench presets, result files and reports;
- :mod:`app.services.tables`: result tables as text;
- :mod:`app.services.export`: result records and the experiment's report.
"""
from app.services import bench, export, gallery, playground, tables
from app.services.common import (DTYPES, SHAPE_KEYS, ActionFailed, Limits, call, commit,
                                 default_shape, fingerprint, limits, provenance, provider_label,
                                 results_dir, shape_problem, worker_info, workbench_dir)

__all__ = ["bench", "export", "gallery", "playground", "tables", "DTYPES", "SHAPE_KEYS",
           "ActionFailed", "Limits", "call", "commit", "default_shape", "fingerprint", "limits",
           "provenance", "provider_label", "results_dir", "shape_problem", "worker_info",
           "workbench_dir"]
