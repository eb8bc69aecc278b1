"""Planning (layer L1, pure Python): schedule generators, lowering and list scheduling."""

from .generators import SCHEDULES, activation_caps, decoupled, generate, one_f_one_b, one_f_one_b_order
from .list_scheduler import ListResult, list_schedule
from .lowering import compute_orders, lower, placement_of, repeat

__all__ = [
    "SCHEDULES",
    "ListResult",
    "activation_caps",
    "compute_orders",
    "decoupled",
    "generate",
    "list_schedule",
    "lower",
    "one_f_one_b",
    "one_f_one_b_order",
    "placement_of",
    "repeat",
]
