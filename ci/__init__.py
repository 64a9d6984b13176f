"""GPU CI on SkyPilot: task files, the launcher that always tears clusters down, termination receipts.

- ``ci/*.sky.yaml``: the 2×H200 gate and the nightly 8×H200 canaries (``tasks`` checks their contract);
- ``launcher``: launch, gate on the remote job status, fetch evidence, tear down, prove absence
  (``interrupts``: bounded SDK calls and signals; ``outputs``: evidence copied back and judged);
- ``receipts``: the write-once termination receipt with GPU-minutes and cost;
- ``local``: a task's own commands on this machine (``rtv run --preset gpu`` itself is the harness's one run
  path, ``canaries.suite.run``, which a task reaches through its command line: ``ci`` never imports ``canaries``);
- ``cli``: ``rtv gpu launch|status|down|receipts|local``.
"""
