"""Pure-Python serving policy: chunk plans, usable rows, keeps, eviction, warm passes, tail."""
