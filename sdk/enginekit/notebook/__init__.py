"""Notebook helpers: running sync calls on a live asyncio loop, progress bars and the live viewer."""
