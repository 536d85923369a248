"""edatalog: tensor programs as Datalog rules, compiled to join-aggs and placed on many GPUs.

import edatalog
prog = edatalog.compile("programs/llama_block.edl", dims={"S": 16})
out = prog.run(prog.random_inputs(seed=0))
print(prog.graph)
"""

from edatalog.api import Program, compile, compile_string, executable, grad
from edatalog.errors import Diagnostic, EdlError, EdlWarning
from edatalog.generation import Generation, Generator, generate
from edatalog.importer import from_torch, to_edl, torch_params
from edatalog.plans import Plan, load_plan
from edatalog.plans import make_plan as plan
from edatalog.rules.optim import SGD, AdamW
from edatalog.solver.topology import Topology
from edatalog.solver.topology import resolve as topology
from edatalog.training import Trainer, step_program

__all__ = [
    "SGD",
    "AdamW",
    "Diagnostic",
    "EdlError",
    "EdlWarning",
    "Generation",
    "Generator",
    "Plan",
    "Program",
    "Topology",
    "Trainer",
    "compile",
    "compile_string",
    "executable",
    "from_torch",
    "generate",
    "grad",
    "load_plan",
    "plan",
    "step_program",
    "to_edl",
    "topology",
    "torch_params",
]
__version__ = "0.1.0"
