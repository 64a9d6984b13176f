"""Runnable validation suites (canaries) and the ``rtv`` command line that fronts them."""
