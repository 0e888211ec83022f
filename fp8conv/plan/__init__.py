"""Every decision before the first byte is written: the plan, strategies, bands, preflight checks."""
