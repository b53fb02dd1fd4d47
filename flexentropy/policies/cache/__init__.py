"""Cache policies (design.md §2-3): each file one scoring/keep rule, run by `flexentropy.caches.PolicyCache`."""
