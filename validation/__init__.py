"""Reusable validation machinery: oracles, comparators, censuses, statistics, evidence."""
