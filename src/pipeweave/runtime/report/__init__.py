"""Summaries and traces of finished runs (layer 6 of ``pipeweave.runtime``, the top).

``trace`` turns a ``RunRecord`` into per-step ``Timeline``s, the simulator's
metrics on them, profiled costs and the run simulated with them, and Chrome
traces; ``stream_summary`` does the same for asynchronous streams.
"""
