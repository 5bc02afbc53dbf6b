"""Structured outputs in the engine core: grammar backends, compiled off the step loop, and each step's bitmask."""
