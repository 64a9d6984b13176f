"""The learning canary (``canary``: stale and corrected backwards learn as well as strict training) and what only it uses."""
