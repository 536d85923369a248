"""Placement: choosing how each join space is split and where each block runs (Z3).

Empty for now; planning arrives with the partitioned-plan and solver issues.
"""
