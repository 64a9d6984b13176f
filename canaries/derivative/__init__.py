"""The derivative canary (``canary``: exact stale gradients against an FP64 oracle) and what only it uses."""
