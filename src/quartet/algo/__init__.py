"""Pure torch RL math for RLHF. Nothing outside torch is imported here.

Tensors are (B, R) over response tokens unless noted; `mask` is 1.0 on real response tokens (EOS included)
and 0.0 on the padding after them.
"""

from quartet.algo.advantages import (
    GROUP_KINDS,
    SCALES,
    fill_groups,
    flat_groups,
    gae,
    group_advantages,
    reinforce_advantages,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    remax_advantages,
    returns_to_go,
)
from quartet.algo.estimators import ESTIMATORS, SCALABLE, AdvantageEstimator, get_estimator
from quartet.algo.kl import KL_KINDS, AdaptiveKL, FixedKL, full_kl, kl_estimate, token_rewards
from quartet.algo.logprobs import entropy_from_logits, gather_logprobs, logprobs_and_entropy
from quartet.algo.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    RATIO_LEVELS,
    aggregate,
    cispo_loss,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    kept_rows_scale,
)
from quartet.algo.offpolicy import logprob_gap, truncated_importance_weights
from quartet.algo.positions import position_ids_from_mask
from quartet.algo.preference import PREFERENCE_LOSSES, preference_loss
from quartet.algo.sampling import inverse_cdf, nucleus
from quartet.algo.shaping import overlong_penalty
from quartet.algo.stats import (
    check_mask,
    last_token_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "GROUP_KINDS",
    "POLICY_LOSSES",
    "RATIO_LEVELS",
    "SCALABLE",
    "SCALES",
    "AdvantageEstimator",
    "get_estimator",
    "group_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_returns",
    "remax_advantages",
    "returns_to_go",
    "KL_KINDS",
    "PREFERENCE_LOSSES",
    "AdaptiveKL",
    "FixedKL",
    "aggregate",
    "check_mask",
    "cispo_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "inverse_cdf",
    "explained_variance",
    "fill_groups",
    "flat_groups",
    "full_kl",
    "gae",
    "gather_logprobs",
    "kept_rows_scale",
    "kl_estimate",
    "last_token_index",
    "logprob_gap",
    "logprobs_and_entropy",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "nucleus",
    "overlong_penalty",
    "position_ids_from_mask",
    "preference_loss",
    "reinforce_advantages",
    "token_rewards",
    "truncated_importance_weights",
]
