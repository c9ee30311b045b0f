"""The items of ``benchmarks/real_model_remedies.py``, a module per concern (see that script's docstring)."""
