"""The rule compiler: from the syntax tree of an ``.edl`` program to a join-agg graph."""

from edatalog.rules.compile import compile_program

__all__ = ["compile_program"]
