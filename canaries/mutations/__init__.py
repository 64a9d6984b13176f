"""The mutation suite (``canary``: every injected bug is caught) and its catalogue of bugs (``catalogue``)."""
