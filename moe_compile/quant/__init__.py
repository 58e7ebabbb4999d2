"""Quantized formats (int8 per-token for the EP dispatch lives in ``int8.py``)."""
