"""Causal mask whose factory can hold a run inside a case, for the concurrency and kill tests.

``make()`` runs once per case. With ``FLEXLAB_TEST_GATE`` set it waits (at most a minute) until
that file exists; with ``FLEXLAB_TEST_SLEEP`` it sleeps that many seconds first, so a test can
time its kills inside cases.
"""
import os
import time


def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make():
    time.sleep(float(os.environ.get("FLEXLAB_TEST_SLEEP", "0")))
    gate = os.environ.get("FLEXLAB_TEST_GATE")
    deadline = time.monotonic() + 60
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return None, mask_mod
