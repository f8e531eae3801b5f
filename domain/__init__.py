"""The pure core of speculative decoding: values, acceptance rules, budgets, stops, cost model and ports.

Only the standard library and attrs are imported here; arrays never appear in domain types.
"""
