"""The benchmark canary (``canary``: the versioned step's throughput against plain PyTorch) and what only it uses."""
