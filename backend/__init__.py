"""Execution backends.  For now the numpy reference evaluator, the ground truth for all others."""
