"""Rollouts: the record of what the actor sampled, and the engines that sample it."""

from quartet.rollout.engine import GenerationEngine, HFEngine, make_engine
from quartet.rollout.record import Rollout, position_ids_from_mask, response_mask_from_ids
from quartet.rollout.weights import merged_state_dict

__all__ = [
    "GenerationEngine",
    "HFEngine",
    "Rollout",
    "make_engine",
    "merged_state_dict",
    "position_ids_from_mask",
    "response_mask_from_ids",
]
