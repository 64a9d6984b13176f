"""The conformance suite's command (``rtv conform``) and its part of ``rtv run`` (``canary``)."""
