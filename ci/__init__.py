"""GPU CI on SkyPilot: task files, the launcher that always tears clusters down, termination receipts.

Not built yet (it has its own issue); this package exists so the layout of
contract §10 is in place.
"""
