"""edatalog: tensor programs as Datalog rules, compiled to join-aggs and placed on many GPUs.

import edatalog
prog = edatalog.compile("programs/llama_block.edl", dims={"S": 16})
out = prog.run(prog.random_inputs(seed=0))
print(prog.graph)
"""

from edatalog.api import Program, compile, compile_string
from edatalog.errors import Diagnostic, EdlError, EdlWarning

__all__ = ["Diagnostic", "EdlError", "EdlWarning", "Program", "compile", "compile_string"]
__version__ = "0.1.0"
