"""Quantisation: q8/q4/f16 weights from a float graph, calibration, and the accuracy report."""
