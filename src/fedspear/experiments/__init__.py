"""Measuring fedspear rather than running it: ``fedspear compare`` grids (``compare``), ``fedspear bench`` (``bench``)
and the lm-evaluation-harness protocol behind ``fedspear eval --harness lm-eval`` (``harness``).
"""
