"""The planner canary: ``canary.py`` (the grid and its runs) and ``certificate.py`` (the statistics)."""
