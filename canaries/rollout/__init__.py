"""The rollout canary (``canary``: engine vs trainer mismatch, on-policy ratio, publication faults, per-token versions, behaviour lag) and its scenarios."""
