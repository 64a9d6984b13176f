"""The liveness canary (``canary``: injected hangs are reported in time, naming the rank and the collective) and its job."""
