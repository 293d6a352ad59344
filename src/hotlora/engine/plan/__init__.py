"""Memory plans: what a warm engine holds, part by part, before any weight is loaded.

    models.py       the model's configs (folder, Hub cache, built-in) and its parts on the meta device
    memory.py       the engine's own start-up code run on them: exact bytes per part
    activations.py  the per-token, per-layer activation model and how it is measured
    coefficients.py its fitted coefficients (written by bench/plan_calibrate.py)
    budget.py       accelerators, sizes, this machine's memory
    planner.py      plan_memory: the parts, the activations per size and chunk, the verdict

The planner sits in ``engine`` because it runs the engine's writers (imports point one way).
"""

from hotlora.engine.plan.budget import ACCELERATORS, format_bytes, parse_bytes, this_machine
from hotlora.engine.plan.planner import MemoryPlan, SizePlan, plan_memory

__all__ = ["ACCELERATORS", "MemoryPlan", "SizePlan", "format_bytes", "parse_bytes", "plan_memory", "this_machine"]
