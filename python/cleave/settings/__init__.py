"""One schema for every role's settings (cleave.settings.schema) and one list for each
enumerated value (cleave.settings.choices). `python -m cleave.settings --write` regenerates
the files made from them (docs/serving.md's settings block, the Helm chart's settings.json);
`--check` says which is stale."""

from cleave.settings.choices import (
    ADMISSION_RULES,
    DEVICES,
    INCAST_ORDERS,
    MODES,
    QUEUE_POLICIES,
    RANKER_DENSE_DTYPES,
    TABLE_LAYOUTS,
    TRANSPORTS,
    Choices,
)
from cleave.settings.schema import (
    IncastConfig,
    PlanSettings,
    RankerConfig,
    RouterConfig,
    ServeConfig,
    ShardConfig,
    canonical_choices,
    choice_list,
    choice_problems,
    default,
    doc,
    flags,
    ranker_cores,
    required,
    same_as,
    setting,
)

__all__ = [
    "ADMISSION_RULES",
    "DEVICES",
    "INCAST_ORDERS",
    "MODES",
    "QUEUE_POLICIES",
    "RANKER_DENSE_DTYPES",
    "TABLE_LAYOUTS",
    "TRANSPORTS",
    "Choices",
    "IncastConfig",
    "PlanSettings",
    "RankerConfig",
    "RouterConfig",
    "ServeConfig",
    "ShardConfig",
    "canonical_choices",
    "choice_list",
    "choice_problems",
    "default",
    "doc",
    "flags",
    "ranker_cores",
    "required",
    "same_as",
    "setting",
]
