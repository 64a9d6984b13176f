"""The memory canary (``canary``: nothing outlives its backward; admission stays under the limit) and what only it uses."""
