"""Cache policies (SPEC 2 and 3): each file one scoring/keep rule for the shared `flexentropy.cache.PolicyCache`."""
