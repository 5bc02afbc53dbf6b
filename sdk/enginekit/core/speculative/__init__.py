"""Speculative decoding: proposers (n-gram lookup, a draft model) and the planning of a step's proposals."""
